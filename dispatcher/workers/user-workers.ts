/**
 * Users' own workers as the dispatcher sees them (docs/workers.md, dispatcher/README.md "Users' workers"): the
 * second kind of place the scheduler can put a bundle, beside instances. The dispatcher never talks to a worker;
 * they meet in the store:
 *
 * - the REST server records each check-in (store/worker-queries.ts recordCheckin) and NOTIFYs WORKER_CHANNEL when
 *   something placement depends on changed; this module reads the active and draining workers then, and at least
 *   every `workers.longPoll`;
 * - `place()` (called by the scheduler's pass, synchronously) gives a staged bundle to the best of its owner's
 *   workers that can run it now: staged -> starting with the worker's id (startBundleOnWorker, no runner token),
 *   then a NOTIFY with the worker's id, which wakes that worker's waiting check-in; the REST server makes the
 *   runner token and hands the start document over;
 * - `sweepOnce()` gives bundles back when their worker stops checking in (`workers.checkinTimeout`: the worker is
 *   marked lost, once), is gone (stopped, lost, disabled), or never reports a bundle it was given
 *   (`workers.deliveryTimeout`). Each is a guarded transition on the bundle's attempt, so each bundle goes back
 *   once however many dispatchers or sweeps race.
 *
 * Room on a worker is its reported resources and slots minus what the queue's starting and running bundles on it
 * ask for (and the claims still in flight); only workers that checked in within placeFreshMs take new bundles.
 */
import type { Config } from "../../config/schema.ts";
import type { Clock } from "../../lib/clock.ts";
import type { Logger } from "../../lib/logger.ts";
import { cacheKey } from "../../lib/runner-protocol.ts";
import type { Db } from "../../store/db.ts";
import { type Bundle, WORKER_CHANNEL, type Worker, type WorkerState } from "../../store/types.ts";
import { liveWorkers, markWorkerLost, notifyWorkers } from "../../store/worker-queries.ts";
import type { QueueChange } from "../queue/queue.ts";
import type { BundleTransitions } from "../queue/transitions.ts";
import type { QueueView, UserWorkerView } from "../types.ts";

const EPSILON = 1e-9;
const STATES: readonly WorkerState[] = ["new", "active", "draining", "stopped", "lost"];

/** A bundle's hold on a worker: what it takes there. */
interface Hold {
  workerId: string;
  vcpus: number;
  ram: number;
  scratch: number;
  gpus: readonly number[];
  /** A claim in flight (the queue does not show the bundle starting there yet). */
  pending: boolean;
}

interface Entry {
  w: Worker;
  /** clock.now() when w (and its checkinAgeMs) was read. */
  readAt: number;
  holds: Map<string, Hold>;
}

export interface WorkerPlacement {
  workerId: string;
  name: string;
  /** Input bytes its cache holds (0 without inputs). */
  held: number;
}

export interface UserWorkers {
  /** LISTEN and the first read (the dispatcher runs sweepOnce, which reads again, in a loop). */
  start(): Promise<void>;
  stop(): Promise<void>;
  /** Reads the active and draining workers again. */
  refresh(): Promise<void>;
  /** Gives bundles of lost, gone or silent workers back to the queue; marks workers lost. */
  sweepOnce(): Promise<void>;
  /** Gives the staged bundle to the best of its owner's workers that can run it now; null when none can. */
  place(bundle: Bundle): WorkerPlacement | null;
  /** Checked-in active workers of `owner` (with `tag`, when given). */
  checkedIn(owner: string, tag: string | null): number;
  /** True when one of the owner's checked-in workers is big enough for the bundle, busy or not. */
  couldEverRun(bundle: Bundle): boolean;
  /** True when some checked-in worker has a free slot (the scheduler then visits past a quota stop). */
  anyRoom(): boolean;
  views(): UserWorkerView[];
  /** Workers by state, from the last read (every state present, 0 when none). */
  countsByState(): Record<WorkerState, number>;
  /** Called after each read that changed what placement sees. */
  subscribe(fn: () => void): () => void;
}

export interface UserWorkersOptions {
  db: Db;
  queue: QueueView & { subscribe(fn: (changes: readonly QueueChange[]) => void): () => void };
  transitions: Pick<BundleTransitions, "claimOnWorker" | "requeue" | "lose">;
  clock: Clock;
  logger: Logger;
  config: Pick<Config, "workers">;
}

export function createUserWorkers(opts: UserWorkersOptions): UserWorkers {
  const { db, queue, transitions, clock, config } = opts;
  const log = opts.logger.child({ component: "user-workers" });
  const { longPoll, checkinTimeout, deliveryTimeout } = config.workers;
  /** A worker takes new bundles only when it checked in this recently (it checks in at least every longPoll). */
  const placeFreshMs = Math.min(checkinTimeout, 3 * longPoll + 5000);

  const live = new Map<string, Entry>();
  const byOwner = new Map<string, Entry[]>();
  /** Every hold by bundle uuid (the same objects as in the entries' maps). */
  const holds = new Map<string, Hold>();
  let counts: Record<WorkerState, number> = emptyCounts();
  /** `<uuid>/<attempt>` -> clock.now() when a sweep first saw it starting on a worker. */
  const startingSeen = new Map<string, number>();
  const inflight = new Set<string>();
  const listeners = new Set<() => void>();
  let loaded = false;
  let stopped = false;
  let unlisten: (() => Promise<void>) | null = null;
  let refreshing: Promise<void> | null = null;
  let again = false;

  const holdOf = (b: Bundle, workerId: string, pending: boolean, gpus: readonly number[]): Hold => ({
    workerId,
    vcpus: b.resources.vcpus,
    ram: b.resources.ram,
    scratch: b.resources.scratch,
    gpus,
    pending,
  });
  const addHold = (uuid: string, h: Hold) => {
    dropHold(uuid);
    holds.set(uuid, h);
    live.get(h.workerId)?.holds.set(uuid, h);
  };
  const dropHold = (uuid: string) => {
    const h = holds.get(uuid);
    if (h === undefined) return;
    holds.delete(uuid);
    live.get(h.workerId)?.holds.delete(uuid);
  };

  const unsubscribeQueue = queue.subscribe((changes) => {
    for (const c of changes) {
      const b = c.bundle;
      const active = c.to === "starting" || c.to === "running";
      if (active && b.workerId !== undefined) addHold(c.uuid, holdOf(b, b.workerId, false, b.gpuDevices));
      else if (holds.get(c.uuid)?.pending !== true) dropHold(c.uuid);
    }
  });

  const ageOf = (e: Entry): number | null =>
    e.w.checkinAgeMs === null || e.w.checkinAgeMs === undefined
      ? null
      : e.w.checkinAgeMs + (clock.now() - e.readAt);
  const fresh = (e: Entry): boolean => {
    const age = ageOf(e);
    return e.w.state === "active" && e.w.disabledAt === null && age !== null && age <= placeFreshMs;
  };
  const hasTag = (e: Entry, tag: string | undefined) => tag === undefined || e.w.tags.includes(tag);

  /** Whether the worker's whole machine (ignoring what runs there) is big enough for b. */
  const bigEnough = (e: Entry, b: Bundle): boolean => {
    const r = e.w.resources;
    const want = b.resources;
    if (r === null || e.w.slots < 1) return false;
    if (r.vcpus + EPSILON < want.vcpus || r.ram < want.ram || r.freeDisk < want.scratch) return false;
    const g = want.gpu;
    if (g !== null && g.deviceCount > 0) {
      const have = r.gpu;
      if (have === null || have.stack !== g.stack || have.deviceCount < g.deviceCount || have.vram < g.vram)
        return false;
    }
    return hasTag(e, want.tag);
  };

  /** The GPU devices free on the worker for b (null: not enough); [] when b wants none. */
  const freeGpus = (e: Entry, b: Bundle): number[] | null => {
    const g = b.resources.gpu;
    if (g === null || g.deviceCount <= 0) return [];
    const used = new Set<number>();
    for (const h of e.holds.values()) for (const d of h.gpus) used.add(d);
    const out: number[] = [];
    for (let d = 0; d < (e.w.resources?.gpu?.deviceCount ?? 0) && out.length < g.deviceCount; d++)
      if (!used.has(d)) out.push(d);
    return out.length === g.deviceCount ? out : null;
  };

  const roomFor = (e: Entry, b: Bundle): number[] | null => {
    if (!fresh(e) || !bigEnough(e, b) || e.holds.size >= e.w.slots) return null;
    let vcpus = 0;
    let ram = 0;
    let scratch = 0;
    for (const h of e.holds.values()) {
      vcpus += h.vcpus;
      ram += h.ram;
      scratch += h.scratch;
    }
    const r = e.w.resources!;
    const want = b.resources;
    if (
      r.vcpus - vcpus + EPSILON < want.vcpus ||
      r.ram - ram < want.ram ||
      r.freeDisk - scratch < want.scratch
    )
      return null;
    return freeGpus(e, b);
  };

  const heldBytes = (e: Entry, b: Bundle): number => {
    let n = 0;
    for (const m of b.inputManifests ?? []) {
      const key = cacheKey(m.digest);
      if (key !== null && e.w.cache.includes(key)) n += m.bytes;
    }
    return n;
  };

  const claim = (b: Bundle, e: Entry, gpus: number[]): void => {
    const uuid = b.uuid;
    addHold(uuid, holdOf(b, e.w.id, true, gpus));
    void (async () => {
      try {
        const r = await transitions.claimOnWorker(uuid, { workerId: e.w.id, gpuDevices: gpus });
        if (!r.ok) {
          log.info(
            { bundle: uuid, workerId: e.w.id, reason: r.reason },
            "not given to the worker: it changed meanwhile",
          );
          return;
        }
        log.info(
          { bundle: uuid, workerId: e.w.id, owner: b.ownerUuid, attempt: r.bundle.attempt },
          "given to a user's worker",
        );
        await notifyWorkers(db, [e.w.id]);
      } catch (err) {
        log.error({ err, bundle: uuid, workerId: e.w.id }, "giving a bundle to a worker failed");
      } finally {
        const h = holds.get(uuid);
        if (h?.pending === true) dropHold(uuid);
      }
    })();
  };

  const emit = () => {
    for (const fn of listeners) fn();
  };

  const readWorkers = async (): Promise<void> => {
    const [rows, byState] = await Promise.all([
      liveWorkers(db),
      db.query<{ state: WorkerState; n: string | number }>(
        "SELECT state, count(*) AS n FROM workers GROUP BY state",
      ),
    ]);
    const now = clock.now();
    let changed = !loaded;
    const seen = new Set<string>();
    for (const w of rows) {
      seen.add(w.id);
      const e = live.get(w.id);
      if (e === undefined) {
        const entry: Entry = { w, readAt: now, holds: new Map() };
        for (const [uuid, h] of holds) if (h.workerId === w.id) entry.holds.set(uuid, h);
        live.set(w.id, entry);
        changed = true;
      } else {
        const wasFresh = fresh(e);
        if (placementDiffers(e.w, w)) changed = true;
        e.w = w;
        e.readAt = now;
        if (fresh(e) !== wasFresh) changed = true;
      }
    }
    for (const id of [...live.keys()]) {
      if (seen.has(id)) continue;
      live.delete(id);
      changed = true;
    }
    byOwner.clear();
    for (const e of live.values()) {
      const list = byOwner.get(e.w.ownerUuid);
      if (list === undefined) byOwner.set(e.w.ownerUuid, [e]);
      else list.push(e);
    }
    const next = emptyCounts();
    for (const r of byState.rows) if (r.state in next) next[r.state] = Number(r.n);
    counts = next;
    loaded = true;
    if (changed) emit();
  };

  const refresh = (): Promise<void> => {
    if (refreshing !== null) {
      again = true;
      return refreshing;
    }
    refreshing = (async () => {
      try {
        do {
          again = false;
          await readWorkers();
        } while (again && !stopped);
      } finally {
        refreshing = null;
      }
    })();
    return refreshing;
  };

  const giveBack = async (b: Bundle, reason: string): Promise<void> => {
    if (inflight.has(b.uuid)) return;
    inflight.add(b.uuid);
    try {
      const r =
        b.state === "starting"
          ? await transitions.requeue(b.uuid, b.attempt, reason)
          : await transitions.lose(b.uuid, b.attempt, reason);
      if (r.ok)
        log.info(
          { bundle: b.uuid, workerId: b.workerId, state: r.bundle.state, reason },
          "given back to the queue",
        );
    } catch (err) {
      log.warn({ err, bundle: b.uuid }, "giving a bundle back failed; the next sweep retries");
    } finally {
      inflight.delete(b.uuid);
    }
  };

  const sweepOnce = async (): Promise<void> => {
    if (!loaded) return;
    // Workers silent for checkinTimeout: lost (once, by the database's clock), then their bundles go back.
    for (const e of [...live.values()]) {
      const age = ageOf(e);
      if (age === null || age <= checkinTimeout) continue;
      try {
        if (await markWorkerLost(db, e.w.id, checkinTimeout)) {
          log.warn(
            { workerId: e.w.id, owner: e.w.ownerUuid, name: e.w.name, ageMs: age },
            "worker lost: no check-in",
          );
        }
      } catch (err) {
        log.warn({ err, workerId: e.w.id }, "cannot mark a worker lost; will retry");
      }
    }
    await refresh();
    const now = clock.now();
    const active = new Set<string>();
    const ops: Promise<void>[] = [];
    for (const b of queue.all()) {
      if (b.workerId === undefined || (b.state !== "starting" && b.state !== "running")) continue;
      const key = `${b.uuid}/${b.attempt}`;
      active.add(key);
      const e = live.get(b.workerId);
      if (e === undefined) {
        ops.push(giveBack(b, `its worker ${b.workerId} stopped checking in (lost, stopped or disabled)`));
        continue;
      }
      if (b.state !== "starting") continue;
      let seen = startingSeen.get(key);
      if (seen === undefined) {
        seen = now;
        startingSeen.set(key, now);
      }
      const reported = e.w.running.some((r) => r.uuid === b.uuid && r.attempt === b.attempt);
      if (!reported && now - seen > deliveryTimeout) {
        ops.push(
          giveBack(
            b,
            `its worker ${e.w.name} did not start it within ${Math.round(deliveryTimeout / 1000)} s`,
          ),
        );
      }
    }
    for (const k of startingSeen.keys()) if (!active.has(k)) startingSeen.delete(k);
    await Promise.all(ops);
  };

  return {
    async start() {
      unlisten = await db.listen(WORKER_CHANNEL, () => {
        void refresh().catch((err: unknown) => log.warn({ err }, "cannot read workers"));
      });
      await refresh();
    },
    async stop() {
      stopped = true;
      unsubscribeQueue();
      if (unlisten !== null) await unlisten().catch(() => {});
      await refreshing?.catch(() => {});
    },
    refresh,
    sweepOnce,
    place(b) {
      const h = holds.get(b.uuid);
      if (h?.pending === true) {
        const e = live.get(h.workerId);
        return { workerId: h.workerId, name: e?.w.name ?? h.workerId, held: 0 };
      }
      const mine = byOwner.get(b.ownerUuid);
      if (mine === undefined || b.attempt >= b.maxAttempts) return null;
      let best: Entry | null = null;
      let bestGpus: number[] = [];
      let bestHeld = -1;
      let bestFree = -1;
      for (const e of mine) {
        const gpus = roomFor(e, b);
        if (gpus === null) continue;
        const held = heldBytes(e, b);
        const free = e.w.slots - e.holds.size;
        if (
          held > bestHeld ||
          (held === bestHeld && (free > bestFree || (free === bestFree && e.w.id < best!.w.id)))
        ) {
          best = e;
          bestGpus = gpus;
          bestHeld = held;
          bestFree = free;
        }
      }
      if (best === null) return null;
      claim(b, best, bestGpus);
      return { workerId: best.w.id, name: best.w.name, held: bestHeld };
    },
    checkedIn(owner, tag) {
      let n = 0;
      for (const e of byOwner.get(owner) ?? []) if (fresh(e) && (tag === null || e.w.tags.includes(tag))) n++;
      return n;
    },
    couldEverRun(b) {
      return (byOwner.get(b.ownerUuid) ?? []).some((e) => fresh(e) && bigEnough(e, b));
    },
    anyRoom() {
      for (const e of live.values()) if (fresh(e) && e.holds.size < e.w.slots) return true;
      return false;
    },
    views() {
      return [...live.values()].map((e) => ({
        id: e.w.id,
        ownerUuid: e.w.ownerUuid,
        name: e.w.name,
        state: e.w.state,
        disabled: e.w.disabledAt !== null,
        tags: e.w.tags,
        slots: e.w.slots,
        bundles: [...e.holds.keys()],
        version: e.w.version,
        checkinAgeMs: ageOf(e),
        fresh: fresh(e),
      }));
    },
    countsByState: () => ({ ...counts }),
    subscribe(fn) {
      listeners.add(fn);
      return () => listeners.delete(fn);
    },
  };
}

function emptyCounts(): Record<WorkerState, number> {
  return Object.fromEntries(STATES.map((s) => [s, 0])) as Record<WorkerState, number>;
}

/** Whether placement could see the worker differently (its check-in time aside). */
function placementDiffers(a: Worker, b: Worker): boolean {
  return (
    a.state !== b.state ||
    a.disabledAt?.getTime() !== b.disabledAt?.getTime() ||
    a.slots !== b.slots ||
    JSON.stringify(a.tags) !== JSON.stringify(b.tags) ||
    JSON.stringify(a.resources) !== JSON.stringify(b.resources) ||
    JSON.stringify(a.cache) !== JSON.stringify(b.cache)
  );
}
