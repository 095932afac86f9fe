/**
 * Sync: reconciles the bundles the queue holds with the runners the pool sees (dispatcher/README.md, "Sync:
 * bundles against runners"). Every action is a guarded transition, so a stale view loses a race harmlessly;
 * only one operation runs at a time per bundle.
 *
 * | bundle     | runner                                                        | action                      |
 * | starting   | not listed on its instance, confirmed by a probe after a grace | requeue (starting -> staged) |
 * | starting   | instance unknown to the pool staleLockTimeout after start-up  | requeue                     |
 * | running    | not listed on its instance (two probes agree)                 | lose (staged, or failed)    |
 * | running    | instance disappeared (or unknown after staleLockTimeout)      | lose                        |
 * | other      | listed (killed, final, staged, not ours, elsewhere), twice    | kill the runner             |
 */
import type { Config } from "../config/schema.ts";
import type { Clock } from "../lib/clock.ts";
import type { Logger } from "../lib/logger.ts";
import type { Bundle, TransitionResult } from "../store/types.ts";
import type { BundleTransitions } from "./queue/transitions.ts";
import type { QueueView, WorkerView } from "./types.ts";

/** What sync needs of the pool (a WorkerPool fits). */
export interface SyncPool {
  workers(): readonly WorkerView[];
  worker(id: string): WorkerView | undefined;
  killRunner(workerId: string, uuid: string, reason: string): void;
}

export interface SyncOptions {
  queue: QueueView;
  pool: SyncPool;
  /** The dispatcher's owner of bundle transitions (it applies their rows to the queue). */
  transitions: Pick<BundleTransitions, "requeue" | "lose">;
  clock: Clock;
  logger: Logger;
  config: Pick<Config, "cloud" | "dispatcher">;
  /** When the dispatcher started (clock ms): instances unknown until staleLockTimeout after it are waited for. */
  startedAt: number;
}

export interface Sync {
  /** One pass over the queue and the pool; resolves when the operations it started are done. */
  syncOnce(): Promise<void>;
}

export const LOST_REASON = "instance lost";

export function createSync(opts: SyncOptions): Sync {
  const { queue, pool, transitions, clock, config } = opts;
  const logger = opts.logger.child({ component: "sync" });
  const probeInterval = config.cloud.probeInterval;
  const staleLockTimeout = config.dispatcher.staleLockTimeout;
  /** Bundles with an operation in flight. */
  const inflight = new Set<string>();
  /** Every instance id the pool has shown us: one missing later has disappeared. */
  const seenWorkers = new Set<string>();
  /** `<uuid>/<attempt>` -> when sync first saw it starting. */
  const startingSeen = new Map<string, number>();
  /** `<uuid>/<attempt>` -> the worker's probedAt when its runner was first found missing. */
  const missingAt = new Map<string, number>();
  /** `<workerId>/<uuid>` of runners the pool was asked to kill (asked once while the runner is listed). */
  const killing = new Set<string>();
  /**
   * `<workerId>/<uuid>` -> the worker's probedAt when the runner was first found not ours. A runner is killed
   * only when a later probe still lists it: a runner that just called finish is gone by then.
   */
  const strays = new Map<string, number>();

  const run = async (uuid: string, what: string, op: () => Promise<TransitionResult>): Promise<void> => {
    if (inflight.has(uuid)) return;
    inflight.add(uuid);
    try {
      const result = await op();
      if (result.ok) logger.info({ bundle: uuid, state: result.bundle.state }, what);
      else logger.debug({ bundle: uuid, reason: result.reason }, `${what}: the bundle had moved on`);
    } catch (err) {
      logger.warn({ err, bundle: uuid }, `${what} failed; will retry`);
    } finally {
      inflight.delete(uuid);
    }
  };

  /** True when the instance was seen before and is gone, or is still unknown staleLockTimeout after start-up. */
  const instanceLost = (id: string, now: number): boolean =>
    seenWorkers.has(id) || now >= opts.startedAt + staleLockTimeout;

  /** True once two successful probes of `w`, the later one after `since`, have both not listed the runner. */
  const confirmedMissing = (key: string, w: WorkerView, since: number): boolean => {
    if (w.probedAt === null || w.probedAt <= since) return false;
    const first = missingAt.get(key);
    if (first === undefined) {
      missingAt.set(key, w.probedAt);
      return false;
    }
    return w.probedAt > first;
  };

  const checkBundle = (b: Bundle, now: number, ops: Promise<void>[]): void => {
    if (b.state !== "starting" && b.state !== "running") return;
    // On a user's own worker: watched by dispatcher/workers/user-workers.ts, not by probes.
    if (b.workerId !== undefined) return;
    const key = `${b.uuid}/${b.attempt}`;
    const id = b.instanceId;
    const w = id === null ? undefined : pool.worker(id);
    // The pool keeps a runner it started as `starting` until a `--list` shows it (or sync decides): for a
    // starting bundle that is not "listed" yet. A running bundle's runner got as far as calling start.
    const r = w?.runners.get(b.uuid);
    if (r !== undefined && (b.state === "running" || r.state !== "starting")) {
      missingAt.delete(key);
      return;
    }
    if (b.state === "starting") {
      // The pool is still starting it (the claim, the hand-off or --detach): no list can show it yet, and a list
      // sent before its start returned may have missed it, as the pool's own reconciling knows (keepStarting).
      if (r !== undefined && r.detachedAt === null) return;
      let seen = startingSeen.get(key);
      if (seen === undefined) {
        seen = now;
        startingSeen.set(key, now);
      }
      const gone =
        w === undefined
          ? id === null || instanceLost(id, now)
          : now >= seen + 2 * probeInterval &&
            confirmedMissing(key, w, Math.max(seen, r?.detachedAt ?? seen));
      if (!gone) return;
      const reason =
        w === undefined
          ? `its instance ${id ?? "(none)"} is gone`
          : `its runner did not appear on instance ${w.id}`;
      ops.push(
        run(b.uuid, "requeued a starting bundle", () => transitions.requeue(b.uuid, b.attempt, reason)),
      );
      return;
    }
    // running
    const gone =
      w === undefined
        ? id === null || instanceLost(id, now)
        : w.state !== "shutdown" && confirmedMissing(key, w, -1);
    if (!gone) return;
    ops.push(run(b.uuid, "bundle lost its runner", () => transitions.lose(b.uuid, b.attempt, LOST_REASON)));
  };

  const checkRunners = (w: WorkerView): void => {
    for (const r of w.runners.values()) {
      const k = `${w.id}/${r.uuid}`;
      // A runner the pool is still starting is not listed yet; the queue may not have its row either.
      if (r.state === "starting") continue;
      const b = queue.get(r.uuid);
      const ours =
        b !== undefined && (b.state === "starting" || b.state === "running") && b.instanceId === w.id;
      if (ours) {
        killing.delete(k);
        strays.delete(k);
        continue;
      }
      if (killing.has(k)) continue;
      const probedAt = w.probedAt ?? Number.NEGATIVE_INFINITY;
      const first = strays.get(k);
      if (first === undefined) {
        strays.set(k, probedAt);
        continue;
      }
      if (probedAt <= first) continue;
      strays.delete(k);
      killing.add(k);
      const why =
        b === undefined
          ? "its bundle is not active (final, killed or unknown)"
          : b.instanceId !== w.id
            ? `its bundle is ${b.state} on ${b.instanceId ?? "no instance"}`
            : `its bundle is ${b.state}`;
      logger.info({ bundle: r.uuid, instanceId: w.id }, `killing a runner: ${why}`);
      pool.killRunner(w.id, r.uuid, why);
    }
  };

  return {
    async syncOnce() {
      const now = clock.now();
      const workers = pool.workers();
      const listed = new Set<string>();
      for (const w of workers) {
        if (w.placeholder) continue;
        seenWorkers.add(w.id);
        checkRunners(w);
        for (const uuid of w.runners.keys()) listed.add(`${w.id}/${uuid}`);
      }
      for (const k of killing) if (!listed.has(k)) killing.delete(k);
      for (const k of strays.keys()) if (!listed.has(k)) strays.delete(k);

      const ops: Promise<void>[] = [];
      const active = new Set<string>();
      for (const b of queue.all()) {
        active.add(`${b.uuid}/${b.attempt}`);
        checkBundle(b, now, ops);
      }
      for (const k of startingSeen.keys()) if (!active.has(k)) startingSeen.delete(k);
      for (const k of missingAt.keys()) if (!active.has(k)) missingAt.delete(k);
      await Promise.all(ops);
    },
  };
}
