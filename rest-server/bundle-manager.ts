/**
 * The bundle manager moves `created` bundles on: to `staged` once every dependency is ready (or final,
 * with allowFailedDependencies), to `failed` when a dependency failed or was killed. It wakes on the bundle
 * NOTIFY channel; the poll interval is only a fallback. One pass is `runOnce()`.
 */
import type { Logger } from "../lib/logger.ts";
import type { Db } from "../store/db.ts";
import { createdBundlesReady } from "../store/queries.ts";
import { failCreated, stageBundles } from "../store/transitions.ts";
import { BUNDLE_CHANNEL, type Bundle, type BundleState, isFinalState } from "../store/types.ts";

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

/** The longest rest between two passes under a stream of notifications. */
const MAX_REST_MS = 100;

export function createBundleManager(opts: BundleManagerOptions): BundleManager {
  const { db } = opts;
  const log = opts.logger.child({ component: "bundle-manager" });
  const pollInterval = opts.pollInterval ?? 10_000;
  const batchSize = opts.batchSize ?? 500;

  async function runOnce(): Promise<number> {
    let moved = 0;
    const seen = new Set<string>();
    for (;;) {
      const rows = await createdBundlesReady(db, batchSize);
      let progress = false;
      const toStage: { uuid: string; reason: string | null }[] = [];
      for (const { bundle, dependencyStates } of rows) {
        if (seen.has(bundle.uuid)) continue;
        seen.add(bundle.uuid);
        progress = true;
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
        for (const b of await stageBundles(db, toStage, ACTOR)) {
          moved++;
          log.info({ bundleUuid: b.uuid, state: b.state }, "bundle staged");
        }
      } catch (err) {
        log.error(
          { err, bundles: toStage.length },
          "could not stage created bundles; tried again on the next pass",
        );
      }
      // Another page only if this one was full and brought something new.
      if (rows.length < batchSize || !progress) return moved;
    }
  }

  let timer: NodeJS.Timeout | undefined;
  let unlisten: (() => unknown) | undefined;
  let running: Promise<void> | undefined;
  let again = false;
  let stopped = true;

  function trigger(): void {
    if (stopped) return;
    if (running !== undefined) {
      again = true;
      return;
    }
    running = (async () => {
      for (;;) {
        again = false;
        const t0 = performance.now();
        try {
          await runOnce();
        } catch (err) {
          log.error({ err }, "bundle manager pass failed");
        }
        if (!again || stopped) break;
        // Woken while it ran: under a stream of submissions, rest as long as the pass took (at most 0.1 s)
        // so the passes take at most half the database's time and each stages more at once. On PGlite, whose
        // one connection also serves every request, a pass per submission cost more than the submission.
        await new Promise((r) => setTimeout(r, Math.min(MAX_REST_MS, performance.now() - t0)));
      }
    })().finally(() => {
      running = undefined;
    });
  }

  return {
    runOnce,
    async start() {
      if (!stopped) return;
      stopped = false;
      unlisten = await db.listen(BUNDLE_CHANNEL, (payload: string) => {
        // Payload `<uuid> <state> <changeSeq>`: new bundles and final states can unblock someone.
        const state = payload.split(" ")[1];
        if (state === undefined || state === "created" || isFinalState(state as BundleState)) trigger();
      });
      timer = setInterval(trigger, pollInterval);
      timer.unref();
      trigger();
    },
    async stop() {
      stopped = true;
      if (timer !== undefined) clearInterval(timer);
      timer = undefined;
      await unlisten?.();
      unlisten = undefined;
      await running;
    },
  };
}
