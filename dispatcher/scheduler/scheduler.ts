/**
 * The scheduler (dispatcher/README.md "A bundle's way" and "Packing"): one `runOnce()` pass orders the staged
 * bundles, packs them onto instances with room (starting them on booted instances, planning them in memory on
 * booting ones), asks the pool for the cheapest eligible type when nothing has room, stops creating at quota
 * (shutting down instances with nothing to do), fails bundles no type can ever fit, and gives every queued
 * bundle a `schedulingStatus` sentence (status.ts), written to the store when it changes, throttled.
 *
 * Cost of a pass: O(bundles + workers + runners) plus, per resource shape met in the pass, one look at the
 * workers of its eligible types (skipped per type when no worker of it has room). Shapes, their demand and
 * eligible types are cached across passes; so is the priority order (only new or changed bundles are sorted).
 * A worker's room after its runners is kept too, recomputed only when its runners or their queue rows change;
 * the order array is compacted in place (or merged into the previous pass's array), so a pass allocates little.
 *
 * Why one file of ~850 lines: a pass is one algorithm over shared state (the order, the shapes' cursors, the
 * workers' room), and its cost depends on that state being reused, not rebuilt (bench/scheduler.ts). Fields
 * that hold for one pass are stamped with the pass number instead of living in a per-pass object, so a pass
 * allocates nothing per shape or worker; the sentences are in status.ts, eligibility in eligible.ts.
 */
import type { InstanceType } from "../../cloud-drivers/types.ts";
import type { Config } from "../../config/schema.ts";
import type { Clock } from "../../lib/clock.ts";
import type { Logger } from "../../lib/logger.ts";
import type { Db } from "../../store/db.ts";
import { setSchedulingStatus } from "../../store/queries.ts";
import type { Bundle } from "../../store/types.ts";
import type { BundleTransitions } from "../queue/transitions.ts";
import type { CreateRefusal, CreateResult, Demand, QueueView, RunnerView, WorkerView } from "../types.ts";
import { demandOf, type EligibleResult, eligibilityOptions, eligibleTypes } from "./eligible.ts";
import * as say from "./status.ts";

/** What the scheduler needs of the worker pool (a subset of WorkerPool, dispatcher/pool/pool.ts). */
export interface SchedulerPool {
  workers(): readonly WorkerView[];
  create(type: InstanceType): CreateResult;
  startBundle(workerId: string, bundle: Bundle, gpuDevices: number[]): void;
  shutdown(workerId: string, reason: string): void;
  quota(): { atQuota: boolean; instances: number; max: number | null; until: number | null };
  capacityBlocked(type: InstanceType): { until: number; message: string } | null;
  createsBlocked(): CreateRefusal | null;
  /**
   * Probe this worker now (rate-limited by the pool): a runner `--list` showed is still there although its
   * bundle is staged again (a preempted runner reported its notice), so it should be seen gone soon.
   */
  probeNow?(workerId: string): void;
}

/** What one pass did. */
export interface PassResult {
  /** Bundles handed to pool.startBundle (uuids). */
  started: string[];
  /** Bundles planned onto booting, unknown or still-being-created instances. */
  planned: number;
  /** Ids of the placeholders of instances created. */
  created: string[];
  /** Ids of instances shut down to make room at quota. */
  shutdown: string[];
  /** Bundles failed because no instance type can ever fit them (uuids). */
  failed: string[];
  /** Staged bundles not started in this pass (planned ones included). */
  waiting: number;
}

export interface Scheduler {
  runOnce(): Promise<PassResult>;
  /** The current schedulingStatus sentence of a staged bundle. */
  statusOf(uuid: string): string | undefined;
  /** The instance types that could run the bundle, cheapest first (cached per resource shape). */
  eligibleTypes(bundle: Bundle): readonly string[];
  /** Writes changed statuses to the store now (else throttled by dispatcher.schedulingStatusInterval). */
  flushStatuses(): Promise<void>;
}

export interface SchedulerOptions {
  queue: QueueView;
  pool: SchedulerPool;
  /** The dispatcher's owner of bundle transitions: the scheduler fails bundles that can never run. */
  transitions: Pick<BundleTransitions, "fail">;
  instanceTypes: readonly InstanceType[];
  config: Config;
  db: Db;
  clock: Clock;
  logger: Logger;
}

/** Most statuses a throttled flush writes (head of the queue first); flushStatuses() writes them all. */
const STATUS_WRITES_PER_FLUSH = 500;
const WRITE_CONCURRENCY = 4;
/** vCPUs may be fractional: sums of them are compared with this slack. */
const EPSILON = 1e-9;
const NO_GPUS: readonly number[] = [];

/** Bundles with the same demand share one Shape: demand, eligible types and per-pass placement state. */
interface Shape {
  readonly demand: Demand;
  readonly gpuCount: number;
  readonly eligible: EligibleResult;
  /** Eligible types, cheapest first (empty when none). */
  readonly types: readonly InstanceType[];
  readonly typeNames: ReadonlySet<string>;
  // Per pass (valid when pass === the current pass):
  pass: number;
  /**
   * The pass's worker list of each eligible type (same order as types), and how far this shape has looked in
   * each: workers before the cursor have no room for it (room only shrinks within a pass).
   */
  lists: Slot[][];
  cursors: number[];
  hint: string | null | undefined;
  /** The last blocked sentence and its version with the hint (to build it once per pass, not per bundle). */
  blockedBase: string | null;
  blockedSentence: string;
  /** Set once every eligible type is at capacity (capacity blocks do not lift within a pass). */
  noType: string | null;
}

/** A worker as one pass sees it: free room after its runners and the bundles placed on it in the pass. */
interface Slot {
  readonly worker: WorkerView;
  readonly id: string;
  readonly typeName: string;
  readonly price: number;
  /** idle or running (not a placeholder): bundles start at once; otherwise they are planned. */
  readonly booted: boolean;
  readonly limit: number;
  vcpus: number;
  ram: number;
  scratch: number;
  /** Free GPU device indices, ascending. */
  gpus: readonly number[];
  /** Runners + bundles placed in this pass. */
  load: number;
}

/** A worker's room after its runners, and what it was computed from (see roomOf). */
interface WorkerRoom {
  readonly type: InstanceType;
  pass: number;
  readonly runners: RunnerView[];
  /** The queue's own uuid strings (cheaper map keys), the runners' GPU assignments and rows, by runner. */
  readonly keys: string[];
  readonly devices: (readonly number[])[];
  readonly bundles: (Bundle | undefined)[];
  /** Runners whose bundle is staged in the queue. */
  readonly staged: string[];
  vcpus: number;
  ram: number;
  scratch: number;
  gpus: readonly number[];
}

/** The most room any open worker of a type has (an upper bound: room only shrinks within a pass). */
interface Room {
  vcpus: number;
  ram: number;
  scratch: number;
  gpus: number;
}

interface Entry {
  readonly uuid: string;
  bundle: Bundle;
  priority: number;
  created: number;
  shape: Shape;
  /** Its attempts are used up (bundle.attempt >= bundle.maxAttempts; rows are never changed in place). */
  exhausted: boolean;
  /** The pass that last saw it staged. */
  seen: number;
  /** No longer staged: forgotten (a later row of the bundle gets a new Entry). */
  dropped: boolean;
  /** The worker whose runners include it, when runnerPass is the current pass. */
  runnerOn: string;
  runnerPass: number;
  /** The pass in which its priority changed: its old place in the order is skipped, it is merged anew. */
  movedPass: number;
  status: string | undefined;
  /** What status was built from (a waiting bundle's position and reason), to rebuild it only on change. */
  position: number;
  reason: string;
  /** Whether status goes to the store (not "starting on ..."; the start transition clears it). */
  persist: boolean;
  /** What the store holds, as far as we know. */
  written: string | null;
  /** The booting instance it was planned on by the last pass: kept while it has room, so plans are stable. */
  plannedOn: string | null;
}

const byOrder = (a: Entry, b: Entry): number =>
  b.priority - a.priority || a.created - b.created || (a.uuid < b.uuid ? -1 : a.uuid > b.uuid ? 1 : 0);

export { queueOrder } from "../types.ts";

/** Packing first (most runners + planned), then booted over booting, then cheaper, then id. */
const bySlot = (a: Slot, b: Slot): number =>
  b.load - a.load ||
  (a.booted ? 0 : 1) - (b.booted ? 0 : 1) ||
  a.price - b.price ||
  (a.id < b.id ? -1 : a.id > b.id ? 1 : 0);

function hasRoom(s: Slot, d: Demand, gpuCount: number): boolean {
  return (
    s.load < s.limit &&
    s.vcpus + EPSILON >= d.vcpus &&
    s.ram >= d.ram &&
    s.scratch >= d.scratch &&
    s.gpus.length >= gpuCount
  );
}

/** The resource signature of a demand (what JSON.stringify would tell apart, cheaper). */
function shapeKey(d: Demand): string {
  const g = d.gpu;
  const gpu =
    g === null
      ? ""
      : `|${g.stack}|${g.deviceCount}|${g.vram}|${g.driverVersion ?? ""}|${JSON.stringify(g.hardwareTarget)}`;
  return `${d.vcpus}|${d.ram}|${d.scratch}|${d.preemptible ? 1 : 0}${gpu}`;
}

async function eachLimited<T>(items: readonly T[], n: number, fn: (item: T) => Promise<void>): Promise<void> {
  let next = 0;
  const worker = async () => {
    while (next < items.length) await fn(items[next++]!);
  };
  await Promise.all(Array.from({ length: Math.min(n, items.length) }, worker));
}

export function createScheduler(opts: SchedulerOptions): Scheduler {
  const { queue, pool, transitions, instanceTypes, config, db, clock } = opts;
  const log = opts.logger.child({ component: "scheduler" });
  const { demand: demandOpts, eligible: eligibleOpts } = eligibilityOptions(config);
  const perInstance = config.cloud.maxRunningBundlesPerInstance;
  const limit = perInstance > 0 ? perInstance : Number.POSITIVE_INFINITY;

  const shapes = new Map<string, Shape>();
  const shapeOfBundle = new WeakMap<Bundle, Shape>();
  const entries = new Map<string, Entry>();
  /** The entry of a row object (rows are replaced, never changed, so an unchanged row needs no uuid lookup). */
  const entryOf = new WeakMap<Bundle, Entry>();
  let order: Entry[] = [];
  /** An empty array kept for walkInOrder's next merge. */
  let spare: Entry[] = [];
  let pass = 0;
  let lastFlushAt = Number.NEGATIVE_INFINITY;
  let chain: Promise<unknown> = Promise.resolve();

  function shapeOf(bundle: Bundle): Shape {
    let shape = shapeOfBundle.get(bundle);
    if (shape !== undefined) return shape;
    const demand = demandOf(bundle, demandOpts);
    const key = shapeKey(demand);
    shape = shapes.get(key);
    if (shape === undefined) {
      const eligible = eligibleTypes(demand, instanceTypes, eligibleOpts);
      const types = eligible.ok ? eligible.types : [];
      shape = {
        demand,
        gpuCount: demand.gpu?.deviceCount ?? 0,
        eligible,
        types,
        typeNames: new Set(types.map((t) => t.name)),
        pass: -1,
        lists: [],
        cursors: [],
        hint: undefined,
        blockedBase: null,
        blockedSentence: "",
        noType: null,
      };
      shapes.set(key, shape);
    }
    shapeOfBundle.set(bundle, shape);
    return shape;
  }

  /** Notes which bundles are staged; returns the new and re-prioritised ones, sorted (the others keep their place). */
  function scanStaged(): Entry[] {
    const added: Entry[] = [];
    for (const b of queue.all()) {
      if (b.state !== "staged") continue;
      let e = entryOf.get(b);
      if (e !== undefined && !e.dropped) {
        e.seen = pass;
        continue;
      }
      e = entries.get(b.uuid);
      if (e === undefined) {
        e = {
          uuid: b.uuid,
          bundle: b,
          priority: b.priority,
          created: b.createdAt.getTime(),
          shape: shapeOf(b),
          exhausted: b.attempt >= b.maxAttempts,
          seen: pass,
          dropped: false,
          runnerOn: "",
          runnerPass: -1,
          movedPass: -1,
          status: undefined,
          position: 0,
          reason: "",
          persist: false,
          written: b.schedulingStatus,
          plannedOn: null,
        };
        entries.set(b.uuid, e);
        entryOf.set(b, e);
        added.push(e);
        continue;
      }
      if (e.seen === pass) continue;
      e.seen = pass;
      if (e.bundle !== b) {
        e.bundle = b;
        entryOf.set(b, e);
        e.shape = shapeOf(b);
        e.exhausted = b.attempt >= b.maxAttempts;
        e.written = b.schedulingStatus;
        const created = b.createdAt.getTime();
        if (b.priority !== e.priority || created !== e.created) {
          e.priority = b.priority;
          e.created = created;
          e.movedPass = pass;
          added.push(e);
        }
      }
    }
    return added.sort(byOrder);
  }

  /**
   * Walks the staged bundles in order: the last pass's order (without the bundles no longer staged, which are
   * forgotten here, or moved) merged with the new and moved ones; what it returns becomes the next order.
   */
  function walkInOrder(added: readonly Entry[], visit: (e: Entry) => void): Entry[] {
    const old = order;
    // Nothing to merge: the order is compacted in place (it never writes ahead of where it reads). Else the
    // spare array (the order before last) is refilled, so no pass allocates an array of the whole queue.
    const inPlace = added.length === 0;
    const next = inPlace ? old : spare;
    let k = 0;
    let i = 0;
    let j = 0;
    for (;;) {
      while (i < old.length) {
        const o = old[i]!;
        if (o.seen !== pass) {
          o.dropped = true;
          if (entries.get(o.uuid) === o) entries.delete(o.uuid);
        } else if (o.movedPass !== pass) break;
        i++;
      }
      let e: Entry;
      if (i < old.length && (j >= added.length || byOrder(old[i]!, added[j]!) <= 0)) e = old[i++]!;
      else if (j < added.length) e = added[j++]!;
      else break;
      next[k++] = e;
      visit(e);
    }
    next.length = k;
    if (!inPlace) {
      old.length = 0;
      spare = old;
    }
    return next;
  }

  /** A bundle's current sentence: built from its position and reason while it waits. */
  function statusText(e: Entry): string | undefined {
    return e.persist ? say.inQueue(e.position, e.reason) : e.status;
  }

  function exclusive<T>(fn: () => Promise<T>): Promise<T> {
    const p = chain.then(fn);
    chain = p.catch(() => {});
    return p;
  }

  async function flush(max: number): Promise<void> {
    lastFlushAt = clock.now();
    const todo: { e: Entry; status: string }[] = [];
    for (const e of order) {
      if (todo.length >= max) break;
      if (!e.persist) continue;
      const status = statusText(e);
      if (status === undefined || status === e.written) continue;
      if (entries.get(e.uuid) !== e || queue.get(e.uuid)?.state !== "staged") continue;
      todo.push({ e, status });
    }
    await eachLimited(todo, WRITE_CONCURRENCY, async ({ e, status }) => {
      try {
        await setSchedulingStatus(db, e.uuid, status);
        e.written = status;
      } catch (err) {
        log.warn({ err, bundleUuid: e.uuid }, "cannot write a bundle's scheduling status");
      }
    });
  }

  /** Fails staged bundles that can never run: no type fits them, or their attempts are used up. */
  async function failUnrunnable(bundles: readonly Entry[], result: PassResult): Promise<void> {
    await eachLimited(bundles, WRITE_CONCURRENCY, async (e) => {
      const b = e.bundle;
      const reason =
        b.attempt >= b.maxAttempts
          ? `attempts exhausted (${b.attempt} of ${b.maxAttempts})${b.stateReason ? `; last: ${b.stateReason}` : ""}`
          : e.shape.eligible.ok
            ? "no instance type fits"
            : e.shape.eligible.reason;
      try {
        const r = await transitions.fail(e.uuid, reason);
        if (r.ok) {
          result.failed.push(e.uuid);
          log.info({ bundleUuid: e.uuid, reason }, "bundle failed: it can never run");
        }
      } catch (err) {
        log.warn({ err, bundleUuid: e.uuid }, "cannot fail a bundle that can never run");
      }
    });
  }

  /**
   * A worker's free room after its runners, kept across passes: recomputed only when its type, runners (same
   * objects in the same order, same GPU assignments) or their queue rows (rows are replaced, never changed)
   * differ from the last pass's. Also notes the staged bundles among its runners (markRunner).
   */
  const rooms = new Map<WorkerView, WorkerRoom>();
  function roomOf(w: WorkerView, t: InstanceType): WorkerRoom {
    let c = rooms.get(w);
    if (c !== undefined && c.type === t && c.runners.length === w.runners.size) {
      let i = 0;
      let same = true;
      for (const r of w.runners.values()) {
        const bundle = queue.get(c.keys[i]!);
        if (r !== c.runners[i] || r.gpuDevices !== c.devices[i] || bundle !== c.bundles[i]) {
          same = false;
          break;
        }
        i++;
      }
      if (same) {
        c.pass = pass;
        for (let k = 0; k < c.staged.length; k++) stagedRunner(c.staged[k]!, w);
        return c;
      }
    }
    let vcpus = t.vcpus;
    let ram = t.ram;
    let scratch = t.scratch;
    const deviceCount = t.gpu?.deviceCount ?? 0;
    let gpus: readonly number[] = NO_GPUS;
    let used: Set<number> | null = deviceCount > 0 ? new Set() : null;
    let full = false;
    c = {
      type: t,
      pass,
      runners: [],
      keys: [],
      devices: [],
      bundles: [],
      staged: [],
      vcpus,
      ram,
      scratch,
      gpus,
    };
    for (const r of w.runners.values()) {
      const bundle = queue.get(r.uuid);
      c.runners.push(r);
      c.keys.push(bundle === undefined ? r.uuid : bundle.uuid);
      c.devices.push(r.gpuDevices);
      c.bundles.push(bundle);
      // Only a bundle staged in the queue has an entry this pass sees (scanStaged just read the same queue).
      if (bundle !== undefined && bundle.state === "staged") {
        c.staged.push(r.uuid);
        stagedRunner(r.uuid, w);
      }
      if (full) continue;
      // Its runner called finish: the container is gone, only the runner's clean-up is left.
      if (bundle === undefined && queue.ended(r.uuid)) continue;
      if (bundle === undefined) {
        // Not ours to measure (final, or unknown): it fills the whole worker.
        vcpus = ram = scratch = 0;
        used = null;
        full = true;
        continue;
      }
      const { demand: d, gpuCount } = shapeOf(bundle);
      vcpus -= d.vcpus;
      ram -= d.ram;
      scratch -= d.scratch;
      if (used === null || gpuCount === 0) continue;
      // The pool's assignment, else the store's (a runner found after a restart); unknown: all are taken.
      const devices = r.gpuDevices.length > 0 ? r.gpuDevices : bundle.gpuDevices;
      if (devices.length < gpuCount) used = null;
      else for (const g of devices) used.add(g);
    }
    if (used !== null) {
      const free: number[] = [];
      for (let g = 0; g < deviceCount; g++) if (!used.has(g)) free.push(g);
      gpus = free;
    }
    c.vcpus = vcpus;
    c.ram = ram;
    c.scratch = scratch;
    c.gpus = gpus;
    rooms.set(w, c);
    return c;
  }
  /**
   * A runner on `w` whose bundle the queue has staged: noted (the bundle waits for it to go), and when `--list`
   * has shown it (not one the pool is starting), the pool probes `w` now to see it leave.
   */
  function stagedRunner(uuid: string, w: WorkerView): void {
    markRunner(uuid, w.id);
    const r = w.runners.get(uuid);
    if (r !== undefined && r.state !== "starting") pool.probeNow?.(w.id);
  }

  /** Notes that a staged bundle already has a runner (the pool started it; the store may not say so yet). */
  function markRunner(uuid: string, workerId: string): void {
    const e = entries.get(uuid);
    if (e !== undefined) {
      e.runnerOn = workerId;
      e.runnerPass = pass;
    }
  }

  async function runPass(): Promise<PassResult> {
    pass++;
    const now = clock.now();
    const result: PassResult = { started: [], planned: 0, created: [], shutdown: [], failed: [], waiting: 0 };
    const added = scanStaged();

    // The workers as this pass sees them.
    const slots: Slot[] = [];
    const slotById = new Map<string, Slot>();
    const byType = new Map<string, Slot[]>();
    const typeRoom = new Map<string, Room>();
    const runTypes = new Set<string>();
    const heldTypes = new Set<string>();

    const addSlot = (w: WorkerView): Slot | null => {
      const live = w.state !== "shutdown" && !w.broken;
      if (live && !w.placeholder && w.idleBehavior === "run") runTypes.add(w.instanceType.name);
      if (live && w.idleBehavior === "hold") heldTypes.add(w.instanceType.name);
      if (!live || w.idleBehavior !== "run") {
        for (const uuid of w.runners.keys()) {
          if (queue.get(uuid)?.state === "staged") stagedRunner(uuid, w);
        }
        return null;
      }
      const t = w.instanceType;
      const { vcpus, ram, scratch, gpus } = roomOf(w, t);
      const slot: Slot = {
        worker: w,
        id: w.id,
        typeName: t.name,
        price: t.price,
        booted: !w.placeholder && (w.state === "idle" || w.state === "running"),
        limit,
        vcpus,
        ram,
        scratch,
        gpus,
        load: w.runners.size,
      };
      slots.push(slot);
      slotById.set(slot.id, slot);
      if (slot.load >= limit) return slot;
      let list = byType.get(slot.typeName);
      let room = typeRoom.get(slot.typeName);
      if (list === undefined || room === undefined) {
        list = [];
        room = { vcpus: -1, ram: -1, scratch: -1, gpus: -1 };
        byType.set(slot.typeName, list);
        typeRoom.set(slot.typeName, room);
      }
      list.push(slot);
      room.vcpus = Math.max(room.vcpus, vcpus);
      room.ram = Math.max(room.ram, ram);
      room.scratch = Math.max(room.scratch, scratch);
      room.gpus = Math.max(room.gpus, gpus.length);
      return slot;
    };
    for (const t of instanceTypes) {
      byType.set(t.name, []);
      typeRoom.set(t.name, { vcpus: -1, ram: -1, scratch: -1, gpus: -1 });
    }
    for (const w of pool.workers()) addSlot(w);
    for (const list of byType.values()) list.sort(bySlot);
    for (const [w, c] of rooms) if (c.pass !== pass) rooms.delete(w);

    const prepare = (shape: Shape) => {
      if (shape.pass === pass) return;
      shape.pass = pass;
      shape.hint = undefined;
      shape.noType = null;
      shape.blockedBase = null;
      const d = shape.demand;
      shape.lists = shape.types.map((t) => byType.get(t.name)!);
      shape.cursors = shape.types.map((t, i) => {
        const room = typeRoom.get(t.name)!;
        const none =
          room.vcpus + EPSILON < d.vcpus ||
          room.ram < d.ram ||
          room.scratch < d.scratch ||
          room.gpus < shape.gpuCount;
        return none ? shape.lists[i]!.length : 0;
      });
    };
    /**
     * The best worker with room for shape: the first with room in each eligible type's list (sorted at the start
     * of the pass; new instances are appended), the best of those by current load, state, price and id.
     */
    const pick = (shape: Shape): Slot | null => {
      const { demand, gpuCount, lists, cursors } = shape;
      let best: Slot | null = null;
      for (let i = 0; i < lists.length; i++) {
        const list = lists[i]!;
        let c = cursors[i]!;
        while (c < list.length && !hasRoom(list[c]!, demand, gpuCount)) c++;
        cursors[i] = c;
        const s = list[c];
        if (s !== undefined && (best === null || bySlot(s, best) < 0)) best = s;
      }
      return best;
    };
    const hintFor = (shape: Shape): string | null => {
      if (shape.hint !== undefined) return shape.hint;
      let hint: string | null = null;
      const run = shape.types.find((t) => runTypes.has(t.name));
      if (run !== undefined) hint = say.waitingForIdle(run.name);
      else {
        const held = shape.types.find((t) => heldTypes.has(t.name));
        if (held !== undefined) hint = say.onlyHeld(held.name);
      }
      shape.hint = hint;
      return hint;
    };

    let position = 0;
    /** Set when the pass stops creating (rate limit, creates in flight): the sentence without the hint. */
    let createsStopped: string | null = null;
    /** Set at quota: the pass places nothing more. */
    let quotaStop: string | null = null;
    const stoppedAt = () => quotaStop;
    const capacity = new Map<string, { until: number } | null>();
    const blockedType = (t: InstanceType) => {
      let b = capacity.get(t.name);
      if (b === undefined) {
        b = pool.capacityBlocked(t);
        capacity.set(t.name, b);
      }
      return b;
    };

    const setStarting = (e: Entry, instanceId: string) => {
      e.status = say.startingOn(instanceId);
      e.persist = false;
      e.reason = "";
    };
    /** A waiting bundle: its position and reason; the sentence is built only when it is read or written. */
    const setWaiting = (e: Entry, reason: string) => {
      position++;
      e.persist = true;
      e.position = position;
      e.reason = reason;
      e.status = undefined; // built on demand (statusText): positions shift every pass, sentences are read rarely
    };
    /** A blocked sentence with the shape's hint, built once per pass and shape. */
    const withHint = (shape: Shape, base: string): string => {
      if (shape.blockedBase !== base) {
        shape.blockedBase = base;
        shape.blockedSentence = say.withHint(base, hintFor(shape));
      }
      return shape.blockedSentence;
    };

    const place = (slot: Slot, e: Entry) => {
      const { demand, gpuCount } = e.shape;
      e.plannedOn = slot.booted ? null : slot.id;
      slot.vcpus -= demand.vcpus;
      slot.ram -= demand.ram;
      slot.scratch -= demand.scratch;
      const devices = slot.gpus.slice(0, gpuCount);
      if (gpuCount > 0) slot.gpus = slot.gpus.slice(gpuCount);
      slot.load++;
      if (slot.booted) {
        try {
          pool.startBundle(slot.id, e.bundle, devices);
        } catch (err) {
          log.error({ err, bundleUuid: e.uuid, instanceId: slot.id }, "pool refused to start a bundle");
          setWaiting(e, say.waitingForIdle(slot.typeName));
          return;
        }
        result.started.push(e.uuid);
        setStarting(e, slot.id);
        return;
      }
      result.planned++;
      setWaiting(
        e,
        slot.worker.placeholder
          ? say.waitingForNewInstance(slot.typeName)
          : say.waitingForBoot(slot.id, slot.typeName, slot.worker.problem ?? null),
      );
    };

    /** At quota: stop placing, and shut down what has nothing to run, to make room for what the queue needs. */
    const reachQuota = (instances: number, max: number | null) => {
      quotaStop = say.atQuota(instances, max);
      for (const s of slots) {
        const w = s.worker;
        if (s.load > 0 || w.placeholder || (w.state !== "idle" && w.state !== "booting")) continue;
        pool.shutdown(s.id, "at quota: making room");
        result.shutdown.push(s.id);
      }
      if (result.shutdown.length > 0) {
        log.info({ shutdown: result.shutdown }, "at quota: shutting down instances with nothing to run");
      }
    };

    /** No worker has room: create one. Returns the waiting sentence (without position), or null once placed. */
    const create = (e: Entry): string | null => {
      const shape = e.shape;
      if (createsStopped !== null) return withHint(shape, createsStopped);
      if (shape.noType !== null) return withHint(shape, shape.noType);
      const q = pool.quota();
      if (q.atQuota) {
        reachQuota(q.instances, q.max);
        return null;
      }
      const refused = pool.createsBlocked();
      if (refused !== null && refused.kind === "quota") {
        reachQuota(refused.instances, refused.max);
        return null;
      }
      if (refused !== null && refused.kind !== "capacity") {
        createsStopped = say.waitingToCreate(refused);
        return withHint(shape, createsStopped);
      }
      const blocked: { typeName: string; until: number }[] = [];
      for (const type of shape.types) {
        const b = blockedType(type);
        if (b !== null) {
          blocked.push({ typeName: type.name, until: b.until });
          continue;
        }
        const r = pool.create(type);
        if (r.ok) {
          const slot = addSlot(r.worker);
          result.created.push(r.worker.id);
          log.info(
            { instanceId: r.worker.id, instanceType: type.name, bundleUuid: e.uuid },
            "creating an instance",
          );
          if (slot === null) {
            // A placeholder that takes no bundles (should not happen): say what we wait for anyway.
            return say.waitingForNewInstance(type.name);
          }
          place(slot, e);
          return null;
        }
        const refusal = r.refusal;
        if (refusal.kind === "capacity") {
          // The pool now blocks this type (or its quota group, or everything): ask again for the others.
          capacity.clear();
          capacity.set(type.name, { until: refusal.until });
          blocked.push({ typeName: type.name, until: refusal.until });
          continue;
        }
        if (refusal.kind === "quota") {
          reachQuota(refusal.instances, refusal.max);
          return null;
        }
        createsStopped = say.waitingToCreate(refusal);
        return withHint(shape, createsStopped);
      }
      shape.noType = say.noTypeAvailable(blocked);
      return withHint(shape, shape.noType);
    };

    const unrunnable: Entry[] = [];
    const visit = (e: Entry) => {
      if (e.runnerPass === pass) {
        // The pool already started it (the store may not say so yet).
        setStarting(e, e.runnerOn);
        return;
      }
      const shape = e.shape;
      // A bundle requeued after its last attempt (its runner never started) would otherwise wait forever.
      if (!shape.eligible.ok || e.exhausted) {
        unrunnable.push(e);
        return;
      }
      prepare(shape);
      let sentence: string | null = null;
      const before = e.plannedOn;
      e.plannedOn = null;
      if (stoppedAt() === null) {
        const sticky = before === null ? undefined : slotById.get(before);
        const slot =
          sticky !== undefined &&
          shape.typeNames.has(sticky.typeName) &&
          hasRoom(sticky, shape.demand, shape.gpuCount)
            ? sticky
            : pick(shape);
        if (slot !== null) {
          place(slot, e);
          return;
        }
        sentence = create(e);
        if (sentence === null && stoppedAt() === null) return; // placed on a new instance
      }
      setWaiting(e, sentence ?? withHint(shape, stoppedAt()!));
    };
    order = walkInOrder(added, visit);
    result.waiting = position;

    if (unrunnable.length > 0) await failUnrunnable(unrunnable, result);
    log.debug(
      {
        staged: order.length,
        started: result.started.length,
        planned: result.planned,
        created: result.created.length,
        shutdown: result.shutdown.length,
        failed: result.failed.length,
        ms: clock.now() - now,
      },
      "scheduling pass",
    );
    if (clock.now() - lastFlushAt >= config.dispatcher.schedulingStatusInterval) {
      await flush(STATUS_WRITES_PER_FLUSH);
    }
    return result;
  }

  return {
    runOnce: () => exclusive(runPass),
    statusOf: (uuid) => {
      const e = entries.get(uuid);
      return e === undefined ? undefined : statusText(e);
    },
    eligibleTypes: (bundle) => [...shapeOf(bundle).typeNames],
    flushStatuses: () => exclusive(() => flush(Number.POSITIVE_INFINITY)),
  };
}
