/**
 * The bundle manager moves `created` bundles on: to `staged` once every dependency is ready (or final,
 * with allowFailedDependencies), to `failed` when a dependency failed or was killed. It wakes on the bundle
 * NOTIFY channel; the poll interval is only a fallback (the loop is notified-loop.ts). One pass is `runOnce()`.
 */
import type { Logger } from "../lib/logger.ts";
import type { Db } from "../store/db.ts";
import { anyCreatedBundles, createdBundlesReady } from "../store/queries.ts";
import { failCreated, stageBundles } from "../store/transitions.ts";
import { BUNDLE_CHANNEL, type Bundle, type BundleState, isFinalState } from "../store/types.ts";
import { notifiedLoop } from "./notified-loop.ts";

export interface BundleManagerOptions {
  db: Db;
  logger: Logger;
  /** Fallback pass interval in ms when no notification arrives (default 10s). */
  pollInterval?: number;
  /** Bundles read per query (default 500). */
  batchSize?: number;
}

export interface BundleManager {
  /** One pass; resolves to the number of bundles moved. */
  runOnce(): Promise<number>;
  start(): Promise<void>;
  stop(): Promise<void>;
}

const ACTOR = "bundle-manager";

export type Decision =
  | { action: "stage"; reason: string | null }
  | { action: "fail"; reason: string }
  | { action: "wait" };

/** What to do with a created bundle given the states of its dependencies (null = does not exist). */
export function decide(
  bundle: Bundle,
  dependencyStates: { uuid: string; state: BundleState | null }[],
): Decision {
  const byUuid = new Map(dependencyStates.map((d) => [d.uuid, d.state]));
  let waiting = false;
  const tolerated: string[] = [];
  for (const dep of bundle.dependencies) {
    const state = byUuid.get(dep.bundle) ?? null;
    if (state === null) return { action: "fail", reason: `dependency ${dep.bundle} does not exist` };
    if (state === "ready") continue;
    if (isFinalState(state)) {
      if (!bundle.allowFailedDependencies)
        return { action: "fail", reason: `dependency ${dep.bundle} is ${state}` };
      tolerated.push(`${dep.bundle} is ${state}`);
      continue;
    }
    waiting = true;
  }
  if (waiting) return { action: "wait" };
  const reason =
    tolerated.length === 0 ? null : `allowFailedDependencies: dependency ${tolerated.join(", ")}`;
  return { action: "stage", reason };
}

export function createBundleManager(opts: BundleManagerOptions): BundleManager {
  const { db } = opts;
  const log = opts.logger.child({ component: "bundle-manager" });
  const pollInterval = opts.pollInterval ?? 10_000;
  const batchSize = opts.batchSize ?? 500;

  async function runOnce(): Promise<number> {
    // Woken by every bundle that ends, mostly with nothing created (submissions without dependencies are staged
    // by their insert): one cheap query then, instead of the full read (~16 ms on PGlite).
    if (!(await anyCreatedBundles(db))) return 0;
    let moved = 0;
    // Pages in (created_at, uuid) order, each after the last: a bundle left created (waiting, or a failed move)
    // is not read again in this pass, and no page sorts what earlier pages covered.
    let after: { createdAt: Date; uuid: string } | null = null;
    for (;;) {
      const rows = await createdBundlesReady(db, batchSize, after);
      const last = rows.at(-1)?.bundle;
      if (last !== undefined) after = { createdAt: last.createdAt, uuid: last.uuid };
      const toStage: { uuid: string; reason: string | null }[] = [];
      for (const { bundle, dependencyStates } of rows) {
        const d = decide(bundle, dependencyStates);
        if (d.action === "stage") toStage.push({ uuid: bundle.uuid, reason: d.reason });
        if (d.action !== "fail") continue;
        try {
          const result = await failCreated(db, bundle.uuid, { actor: ACTOR, reason: d.reason });
          if (result.ok) {
            moved++;
            log.info({ bundleUuid: bundle.uuid, state: result.bundle.state }, "bundle failed");
          }
        } catch (err) {
          // One bad row must not block the others; it is tried again on the next pass.
          log.error({ err, bundleUuid: bundle.uuid }, "could not move a created bundle");
        }
      }
      // The page's stageable bundles in one statement (a batch submission stages as fast as it was inserted).
      try {
        const staged = await stageBundles(db, toStage, ACTOR);
        moved += staged.length;
        // One line per page (a batch of 10,000 would otherwise write 10,000 lines); each bundle at debug.
        if (staged.length > 0) log.info({ staged: staged.length, first: staged[0]!.uuid }, "bundles staged");
        if (log.isLevelEnabled("debug"))
          for (const b of staged) log.debug({ bundleUuid: b.uuid, state: b.state }, "bundle staged");
      } catch (err) {
        log.error(
          { err, bundles: toStage.length },
          "could not stage created bundles; tried again on the next pass",
        );
      }
      // Another page only if this one was full.
      if (rows.length < batchSize) return moved;
    }
  }

  const loop = notifiedLoop({
    db,
    channel: BUNDLE_CHANNEL,
    // Payload `<uuid> <state> <changeSeq>`: new bundles and final states can unblock someone.
    filter: (payload) => {
      const state = payload.split(" ")[1];
      return state === undefined || state === "created" || isFinalState(state as BundleState);
    },
    pollInterval,
    pass: runOnce,
    log,
    name: "bundle manager",
  });

  return { runOnce, start: loop.start, stop: loop.stop };
}
