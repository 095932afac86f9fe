/**
 * The scheduler (dispatcher/README.md "A bundle's way" and "Packing"): one `runOnce()` pass orders the staged
 * bundles, packs them onto instances with room (starting them on booted instances, planning them in memory on
 * booting ones), asks the pool for the cheapest eligible type when nothing has room, stops creating at quota
 * (shutting down instances with nothing to do), fails bundles no type can ever fit, and gives every queued
 * bundle a `schedulingStatus` sentence (status.ts), written to the store when it changes, throttled.
 *
 * Cost of a pass: O(changes + workers + runners + the head of the queue), not O(bundles). The queue tells the
 * scheduler which bundles changed (subscribe), so a pass looks only at those; the priority order is kept across
 * passes (new and re-prioritised bundles are sorted and merged in, the array compacted only where bundles left).
 * The walk in order stops where the pass stops placing (at quota): every bundle after that point waits for the
 * same reason, so it is not visited; the pass records where that tail starts and at which position, and a tail
 * bundle's sentence is built from that when read or written (its place found by binary search in the order).
 * A worker's room after its runners is kept, recomputed only when its runners change or the queue says one of
 * their bundles changed. Shapes, their demand and eligible types are cached. A status flush (every
 * schedulingStatusInterval) still walks the order, but compares the position and reason a sentence was written
 * with, so an unchanged sentence is not rebuilt to be compared. `fullPasses` turns the incremental parts off.
 *
 * Why one file of ~1,100 lines: a pass is one algorithm over shared state (the order, the shapes' cursors, the
 * workers' room), and its cost depends on that state being reused, not rebuilt (bench/scheduler.ts). Fields
 * that hold for one pass are stamped with the pass number instead of living in a per-pass object, so a pass
 * allocates nothing per shape or worker; the sentences are in status.ts, eligibility in eligible.ts.
 */
import type { InstanceType } from "../../cloud-drivers/types.ts";
import type { Config } from "../../config/schema.ts";
import type { Clock } from "../../lib/clock.ts";
import type { Logger } from "../../lib/logger.ts";
import { cacheKey } from "../../lib/runner-protocol.ts";
import type { Db } from "../../store/db.ts";
import { setSchedulingStatuses } from "../../store/queries.ts";
import type { Bundle } from "../../store/types.ts";
import type { QueueChange } from "../queue/queue.ts";
import type { BundleTransitions } from "../queue/transitions.ts";
import type { CreateRefusal, CreateResult, Demand, QueueView, RunnerView, WorkerView } from "../types.ts";
import type { UserWorkers } from "../workers/user-workers.ts";
import { demandOf, type EligibleResult, eligibilityOptions, eligibleTypes } from "./eligible.ts";
import * as say from "./status.ts";

/** What the scheduler needs of the worker pool (a subset of WorkerPool, dispatcher/pool/pool.ts). */
export interface SchedulerPool {
  workers(): readonly WorkerView[];
  create(type: InstanceType): CreateResult;
  /** `placement`: why this instance, when it was chosen for its cache (for the start's log line). */
  startBundle(workerId: string, bundle: Bundle, gpuDevices: number[], placement?: string): void;
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
  /**
   * Why an active bundle was started where it was, when it was placed for its cache ("placed for its cache:
   * 1.2 GiB of 1.5 GiB of inputs held there"), while it stays in the queue (starting, running); else undefined.
   */
  placementOf(uuid: string): string | undefined;
}

/**
 * What the scheduler needs of the queue: the view, and to be told what changed (the BundleQueue tells after every
 * load, read and apply), so a pass looks only at changed bundles.
 */
export type SchedulerQueue = QueueView & {
  subscribe(fn: (changes: readonly QueueChange[]) => void): () => void;
};

export interface SchedulerOptions {
  queue: SchedulerQueue;
  pool: SchedulerPool;
  /** The dispatcher's owner of bundle transitions: the scheduler fails bundles that can never run. */
  transitions: Pick<BundleTransitions, "fail">;
  instanceTypes: readonly InstanceType[];
  config: Config;
  db: Db;
  clock: Clock;
  logger: Logger;
  /**
   * Users' own workers (dispatcher/workers/user-workers.ts): a staged bundle goes to one of its owner's workers
   * first when one can run it now; a bundle only workers can run (a tag no type has, resources.workersOnly, or
   * bigger than every type while one of the owner's workers is big enough) waits for them. None: instances only.
   */
  userWorkers?: Pick<UserWorkers, "place" | "checkedIn" | "couldEverRun" | "anyRoom">;
  /**
   * Every pass reads the whole queue, recomputes every worker's room and visits every bundle (no tail): the pass
   * the incremental one must agree with (scheduler-incremental.test.ts). Default false.
   */
  fullPasses?: boolean;
}

/** Most statuses a throttled flush writes (head of the queue first); flushStatuses() writes them all. */
const STATUS_WRITES_PER_FLUSH = 500;
/** Statuses per UPDATE statement (setSchedulingStatuses). */
const STATUS_WRITES_PER_STATEMENT = 1000;
const WRITE_CONCURRENCY = 4;
/** vCPUs may be fractional: sums of them are compared with this slack. */
const EPSILON = 1e-9;
const NO_GPUS: readonly number[] = [];
/**
 * Locality: the most holders of one input tree a bundle's placement looks at (in the order they were indexed).
 * A tree held by thousands of instances would otherwise cost thousands of checks per bundle; past the bound the
 * preference is best-effort (never worse than the usual choice).
 */
const HOLDERS_PER_INPUT = 128;

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
  /** The last blocked sentence and its version with the hint (to build it once per pass, not per bundle). */
  blockedBase: string | null;
  blockedSentence: string;
  /** Set once every eligible type is at capacity (capacity blocks do not lift within a pass). */
  noType: string | null;
  /** The hint (waitingForIdle, onlyHeld, or none) as of pass hintPass. */
  hintPass: number;
  hintText: string | null;
  /** The reason of this shape's bundles in the pass's tail (tail.base with the hint), as of pass tailPass. */
  tailPass: number;
  tailReason: string;
}

/**
 * A worker as one pass sees it: free room after its runners and the bundles placed on it in the pass. One object
 * per worker, kept with its room and refilled by each pass that sees the worker (pass).
 */
interface Slot {
  pass: number;
  readonly worker: WorkerView;
  id: string;
  typeName: string;
  price: number;
  /** idle or running (not a placeholder): bundles start at once; otherwise they are planned. */
  booted: boolean;
  vcpus: number;
  ram: number;
  scratch: number;
  /** Free GPU device indices, ascending. */
  gpus: readonly number[];
  /** Runners (but those whose bundle ended) + bundles placed in this pass. */
  load: number;
  /**
   * A runner's bundle ended here less than CLEANING_UP_MS ago: it is still cleaning up (the instance is busier
   * than its load says).
   */
  cleaning: boolean;
  /** The worker's cachedManifests this slot's cache index was built from, and that index (null: none). */
  cacheList: readonly string[];
  cache: ReadonlySet<string> | null;
  /** Locality: the bytes of the bundle being placed that it holds, valid while heldStamp is that bundle's stamp. */
  heldStamp: number;
  held: number;
}

/** A worker's room after its runners, and what it was computed from (see roomOf); its slot. */
interface WorkerRoom {
  readonly slot: Slot;
  readonly type: InstanceType;
  pass: number;
  readonly runners: RunnerView[];
  /** The runners' bundle uuids (the queue's own strings when it has the bundle) and GPU assignments. */
  readonly keys: string[];
  readonly devices: (readonly number[])[];
  /** Runners whose bundle is staged in the queue. */
  readonly staged: string[];
  /** The queue changed a row of one of its runners' bundles: recompute. */
  stale: boolean;
  /** Runners whose bundle has ended (called finish): they only clean up, so they take no bundle slot. */
  ended: number;
  /** When the last of those bundles ended (the queue's endedAt); -Infinity when none did. */
  lastEnded: number;
  vcpus: number;
  ram: number;
  scratch: number;
  gpus: readonly number[];
}

/**
 * An instance type as the last pass saw it: whether a live worker of it takes bundles (runPass) or is held
 * (heldPass), for the hints; this pass's workers of it with room, and the most room any of them has (an upper
 * bound: room only shrinks within a pass).
 */
interface TypeState {
  runPass: number;
  heldPass: number;
  listPass: number;
  readonly list: Slot[];
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
  /** No type fits it or its attempts are used up: failed by every pass until that works. */
  unrunnable: boolean;
  /** The pass that last visited it (else, when it is staged, it is in that pass's tail). */
  visited: number;
  /** The pass that last read it staged (full passes only). */
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
  /** What the store holds, as far as we know, and the position and reason it was built from (-1: not known). */
  written: string | null;
  writtenPosition: number;
  writtenReason: string;
  /** Its inputs (cache keys and bytes; null: none, most bundles), from bundle.inputManifests. */
  inputs: Inputs | null;
  /** The booting instance (id and slot) it was planned on in pass plannedPass: kept by the next pass while it has room. */
  plannedOn: string | null;
  plannedSlot: Slot | null;
  plannedPass: number;
}

/** A bundle's input trees as the scheduler weighs them: cache keys (lib/runner-protocol.ts cacheKey), bytes. */
interface Inputs {
  readonly keys: readonly string[];
  readonly bytes: readonly number[];
  readonly total: number;
}

const NO_KEYS: readonly string[] = [];

/** The inputs of a bundle (null when it has none, or none with a usable digest). */
function inputsOf(b: Bundle): Inputs | null {
  const list = b.inputManifests;
  if (list === undefined || list.length === 0) return null;
  const keys: string[] = [];
  const bytes: number[] = [];
  let total = 0;
  for (const m of list) {
    const key = cacheKey(m.digest);
    if (key === null || keys.includes(key)) continue;
    total += m.bytes;
    keys.push(key);
    bytes.push(m.bytes);
  }
  return keys.length === 0 ? null : { keys, bytes, total };
}

/** Where the last pass stopped visiting: order[start..] wait at positions from position + 1, for `base`. */
interface Tail {
  pass: number;
  start: number;
  position: number;
  base: string;
  /** Indexes in the order (ascending) of tail bundles that do not wait: started already, or unrunnable. */
  skips: number[];
}

const byOrder = (a: Entry, b: Entry): number =>
  b.priority - a.priority || a.created - b.created || (a.uuid < b.uuid ? -1 : a.uuid > b.uuid ? 1 : 0);

export { queueOrder } from "../types.ts";

/**
 * How long after a bundle ended its instance counts as cleaning up when equally loaded instances are compared:
 * its supervisor's clean-up and its return to the warm pool (well under a second when nothing is wrong). Only
 * this long, not until the next probe no longer lists the runner (up to probeInterval): a trickle of short
 * bundles would otherwise go round every instance a burst left, each bundle to the one that had not ended one
 * lately, and keep them all from timeoutIdle (test/dispatcher-trickle.test.ts).
 */
export const CLEANING_UP_MS = 1000;

/**
 * Packing first (most runners + planned, those cleaning up after `finish` left out), then not cleaning up (a
 * bundle ended there within CLEANING_UP_MS), then booted over booting, then cheaper, then id.
 */
const bySlot = (a: Slot, b: Slot): number =>
  b.load - a.load ||
  (a.cleaning ? 1 : 0) - (b.cleaning ? 1 : 0) ||
  (a.booted ? 0 : 1) - (b.booted ? 0 : 1) ||
  a.price - b.price ||
  (a.id < b.id ? -1 : a.id > b.id ? 1 : 0);

function hasRoom(s: Slot, d: Demand, gpuCount: number, limit: number): boolean {
  return (
    s.load < limit &&
    s.vcpus + EPSILON >= d.vcpus &&
    s.ram >= d.ram &&
    s.scratch >= d.scratch &&
    s.gpus.length >= gpuCount
  );
}

/** Only users' workers can run bundles of this shape (a tag no instance type has, or resources.workersOnly). */
const workerBound = (shape: Shape): boolean =>
  !shape.eligible.ok && (shape.demand.workersOnly === true || shape.demand.tag !== undefined);

/** The resource signature of a demand (what JSON.stringify would tell apart, cheaper). */
function shapeKey(d: Demand): string {
  const g = d.gpu;
  const gpu =
    g === null
      ? ""
      : `|${g.stack}|${g.deviceCount}|${g.vram}|${g.driverVersion ?? ""}|${JSON.stringify(g.hardwareTarget)}`;
  const only =
    d.tag === undefined && d.workersOnly !== true ? "" : `|${d.tag ?? ""}|${d.workersOnly ? 1 : 0}`;
  return `${d.vcpus}|${d.ram}|${d.scratch}|${d.preemptible ? 1 : 0}${gpu}${only}`;
}

async function eachLimited<T>(items: readonly T[], n: number, fn: (item: T) => Promise<void>): Promise<void> {
  let next = 0;
  const worker = async () => {
    while (next < items.length) await fn(items[next++]!);
  };
  await Promise.all(Array.from({ length: Math.min(n, items.length) }, worker));
}

export function createScheduler(opts: SchedulerOptions): Scheduler {
  const { queue, pool, transitions, instanceTypes, config, db, clock, userWorkers } = opts;
  const log = opts.logger.child({ component: "scheduler" });
  const { demand: demandOpts, eligible: eligibleOpts } = eligibilityOptions(config);
  const perInstance = config.cloud.maxRunningBundlesPerInstance;
  const limit = perInstance > 0 ? perInstance : Number.POSITIVE_INFINITY;

  const shapes = new Map<string, Shape>();
  const shapeOfBundle = new WeakMap<Bundle, Shape>();
  const entries = new Map<string, Entry>();
  let order: Entry[] = [];
  /** An empty array kept for walkInOrder's next merge. */
  let spare: Entry[] = [];
  /** Places in `order` to skip: bundles no longer staged, and the old places of re-prioritised ones. */
  let holes = 0;
  /** Staged bundles that can never run (failed by each pass until that works). */
  const unrunnables = new Set<Entry>();
  let pass = 0;
  const tail: Tail = { pass: -1, start: 0, position: 0, base: "", skips: [] };
  const typeStates = new Map<string, TypeState>();
  /** A type's state, its list and room reset when this pass first asks. */
  function typeState(name: string): TypeState {
    let ts = typeStates.get(name);
    if (ts === undefined) {
      ts = { runPass: -1, heldPass: -1, listPass: -1, list: [], vcpus: -1, ram: -1, scratch: -1, gpus: -1 };
      typeStates.set(name, ts);
    }
    if (ts.listPass !== pass) {
      ts.listPass = pass;
      ts.list.length = 0;
      ts.vcpus = ts.ram = ts.scratch = ts.gpus = -1;
    }
    return ts;
  }
  let lastFlushAt = Number.NEGATIVE_INFINITY;
  let chain: Promise<unknown> = Promise.resolve();

  /** Bundles the queue changed since the last pass (all of them before the first: it reads the whole queue). */
  const changed = new Set<string>();
  const full = opts.fullPasses === true;
  let readAll = true;
  /** Why active bundles were started where they are, when placed for their cache (placementOf). */
  const placements = new Map<string, string>();
  queue.subscribe((changes) => {
    if (placements.size > 0) {
      for (const c of changes) {
        if (
          (c.to === "staged" && c.from !== "staged") ||
          (c.to !== "staged" && c.to !== "starting" && c.to !== "running")
        )
          placements.delete(c.uuid);
      }
    }
    if (readAll) return;
    for (const c of changes) changed.add(c.uuid);
  });

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
        blockedBase: null,
        blockedSentence: "",
        noType: null,
        hintPass: -1,
        hintText: null,
        tailPass: -1,
        tailReason: "",
      };
      shapes.set(key, shape);
    }
    shapeOfBundle.set(bundle, shape);
    return shape;
  }

  /** A staged row: a new entry, or the entry's row replaced (new and moved entries go onto `added`, to be merged). */
  function noteStaged(b: Bundle, added: Entry[]): void {
    let e = entries.get(b.uuid);
    if (e === undefined) {
      e = {
        uuid: b.uuid,
        bundle: b,
        priority: b.priority,
        created: b.createdAt.getTime(),
        shape: shapeOf(b),
        exhausted: b.attempt >= b.maxAttempts,
        unrunnable: false,
        visited: -1,
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
        writtenPosition: -1,
        writtenReason: "",
        inputs: inputsOf(b),
        plannedOn: null,
        plannedSlot: null,
        plannedPass: -1,
      };
      entries.set(b.uuid, e);
      added.push(e);
    } else {
      if (e.bundle === b) return;
      e.bundle = b;
      e.shape = shapeOf(b);
      e.inputs = inputsOf(b);
      e.exhausted = b.attempt >= b.maxAttempts;
      e.written = b.schedulingStatus;
      e.writtenPosition = -1;
      const created = b.createdAt.getTime();
      if (b.priority !== e.priority || created !== e.created) {
        e.priority = b.priority;
        e.created = created;
        // Its old place stays in the order until the walk skips it.
        if (e.movedPass !== pass) holes++;
        e.movedPass = pass;
        added.push(e);
      }
    }
    e.unrunnable = (!e.shape.eligible.ok && !workerBound(e.shape)) || e.exhausted;
    if (e.unrunnable) unrunnables.add(e);
    else unrunnables.delete(e);
  }

  /** Notes what the queue changed since the last pass; returns the new and re-prioritised entries, sorted. */
  function scanStaged(): Entry[] {
    const added: Entry[] = [];
    if (readAll) {
      readAll = full;
      for (const b of queue.all()) {
        if (b.state !== "staged") continue;
        noteStaged(b, added);
        entries.get(b.uuid)!.seen = pass;
      }
      if (full) {
        for (const c of rooms.values()) c.stale = true;
        for (const e of entries.values()) if (e.seen !== pass) drop(e);
      }
      return added.sort(byOrder);
    }
    staleRooms(changed);
    for (const uuid of changed) {
      const b = queue.get(uuid);
      if (b !== undefined && b.state === "staged") {
        noteStaged(b, added);
        continue;
      }
      const e = entries.get(uuid);
      if (e !== undefined) drop(e);
    }
    changed.clear();
    return added.sort(byOrder);
  }

  /** No longer staged: forgotten; the walk skips its place in the order. */
  function drop(e: Entry): void {
    entries.delete(e.uuid);
    unrunnables.delete(e);
    e.dropped = true;
    holes++;
  }

  /**
   * Walks the staged bundles in order: the last pass's order (without the bundles no longer staged or moved)
   * merged with the new and moved ones; what it returns becomes the next order. `visit` returns false to stop
   * visiting: the rest is only merged and compacted (and not even that where nothing changed), and sets
   * tail.start to where visiting stopped (the length of the order when it never stopped).
   */
  function walkInOrder(added: readonly Entry[], visit: (e: Entry) => boolean): Entry[] {
    const old = order;
    // Nothing to merge: the order is compacted in place (it never writes ahead of where it reads). Else the
    // spare array (the order before last) is refilled, so no pass allocates an array of the whole queue.
    const inPlace = added.length === 0;
    const next = inPlace ? old : spare;
    let k = 0;
    let i = 0;
    let j = 0;
    let visiting = true;
    tail.start = -1;
    for (;;) {
      if (!visiting && holes === 0 && j >= added.length) {
        // Nothing left to skip or merge: the rest moves down as it is (nothing at all when in place and k === i).
        if (!inPlace || k !== i) while (i < old.length) next[k++] = old[i++]!;
        else k = old.length;
        break;
      }
      while (i < old.length) {
        const o = old[i]!;
        if (!o.dropped && o.movedPass !== pass) break;
        holes--;
        i++;
      }
      let e: Entry;
      if (i < old.length && (j >= added.length || byOrder(old[i]!, added[j]!) <= 0)) e = old[i++]!;
      else if (j < added.length) e = added[j++]!;
      else break;
      next[k++] = e;
      if (visiting && !visit(e)) {
        visiting = false;
        tail.start = k;
      }
    }
    next.length = k;
    holes = 0;
    if (tail.start < 0) tail.start = k;
    if (!inPlace) {
      old.length = 0;
      spare = old;
    }
    return next;
  }

  /** The hint of a shape's sentences as of the last pass (what else could run its bundles). */
  function hintOf(shape: Shape): string | null {
    if (shape.hintPass === pass) return shape.hintText;
    let hint: string | null = null;
    const run = shape.types.find((t) => typeStates.get(t.name)?.runPass === pass);
    if (run !== undefined) hint = say.waitingForIdle(run.name);
    else {
      const held = shape.types.find((t) => typeStates.get(t.name)?.heldPass === pass);
      if (held !== undefined) hint = say.onlyHeld(held.name);
    }
    shape.hintPass = pass;
    shape.hintText = hint;
    return hint;
  }

  /** The reason of a bundle of this shape in the last pass's tail. */
  function tailReasonOf(shape: Shape): string {
    if (shape.tailPass !== pass) {
      shape.tailPass = pass;
      shape.tailReason = say.withHint(tail.base, hintOf(shape));
    }
    return shape.tailReason;
  }

  /** Where a staged entry is in the order (binary search: the order is sorted by byOrder). */
  function indexOf(e: Entry): number {
    let lo = 0;
    let hi = order.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (byOrder(order[mid]!, e) < 0) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  /** How many of the tail's skips are before order index i. */
  function skipsBefore(i: number): number {
    const s = tail.skips;
    let lo = 0;
    let hi = s.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (s[mid]! < i) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  /** In the last pass's tail (not visited): it waits for tail.base, unless started or unrunnable. */
  const inTail = (e: Entry): boolean => e.visited !== pass && tail.pass === pass && !e.dropped;

  /**
   * A bundle's current sentence: built from its position and reason while it waits (a tail bundle's from its
   * index in the order, `at` when the caller knows it). Fills `said` with what a waiting sentence is built from.
   */
  const said = { position: 0, reason: "" };
  function waitingAs(e: Entry, at: number): boolean {
    if (!inTail(e)) {
      if (!e.persist) return false;
      said.position = e.position;
      said.reason = e.reason;
      return true;
    }
    if (e.runnerPass === pass || e.unrunnable) return false;
    const i = at >= 0 ? at : indexOf(e);
    said.position = tail.position + (i - tail.start) - skipsBefore(i) + 1;
    said.reason = tailReasonOf(e.shape);
    return true;
  }
  function statusText(e: Entry, at = -1): string | undefined {
    if (waitingAs(e, at)) return say.inQueue(said.position, said.reason);
    if (inTail(e) && e.runnerPass === pass) return say.startingOn(e.runnerOn);
    return e.persist ? say.inQueue(e.position, e.reason) : e.status;
  }

  function exclusive<T>(fn: () => Promise<T>): Promise<T> {
    const p = chain.then(fn);
    chain = p.catch(() => {});
    return p;
  }

  async function flush(max: number): Promise<void> {
    lastFlushAt = clock.now();
    const todo: { e: Entry; status: string; position: number; reason: string }[] = [];
    for (let i = 0; i < order.length && todo.length < max; i++) {
      const e = order[i]!;
      if (!waitingAs(e, i)) continue;
      const { position, reason } = said;
      // What the store has was built from the same position and reason: unchanged, nothing to build.
      if (e.writtenPosition === position && e.writtenReason === reason) continue;
      const status = say.inQueue(position, reason);
      if (status === e.written) {
        e.writtenPosition = position;
        e.writtenReason = reason;
        continue;
      }
      if (e.dropped || queue.get(e.uuid)?.state !== "staged") continue;
      todo.push({ e, status, position, reason });
    }
    // One statement per STATUS_WRITES_PER_STATEMENT statuses: a flush is a few round trips, not hundreds.
    for (let from = 0; from < todo.length; from += STATUS_WRITES_PER_STATEMENT) {
      const part = todo.slice(from, from + STATUS_WRITES_PER_STATEMENT);
      try {
        await setSchedulingStatuses(
          db,
          part.map((t) => t.e.uuid),
          part.map((t) => t.status),
        );
      } catch (err) {
        log.warn({ err, bundles: part.length }, "cannot write bundles' scheduling statuses");
        continue;
      }
      for (const { e, status, position, reason } of part) {
        e.written = status;
        e.writtenPosition = position;
        e.writtenReason = reason;
      }
    }
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
   * A worker's free room after its runners, kept across passes: recomputed only when its type or runners (same
   * objects in the same order, same GPU assignments) differ from the last pass's, or the queue changed the row of
   * one of their bundles (the room is then stale: see roomsOfRunner). Also notes the staged bundles among its
   * runners (markRunner).
   */
  const rooms = new Map<WorkerView, WorkerRoom>();
  /** The rooms computed with a runner of this bundle (to mark them stale when the queue changes its row). */
  const roomsOfRunner = new Map<string, WorkerRoom[]>();
  function indexRoom(c: WorkerRoom): void {
    for (const key of c.keys) {
      const list = roomsOfRunner.get(key);
      if (list === undefined) roomsOfRunner.set(key, [c]);
      else list.push(c);
    }
  }
  function unindexRoom(c: WorkerRoom): void {
    for (const key of c.keys) {
      const list = roomsOfRunner.get(key);
      if (list === undefined) continue;
      const at = list.indexOf(c);
      if (at >= 0) list.splice(at, 1);
      if (list.length === 0) roomsOfRunner.delete(key);
    }
  }
  /** The queue changed these bundles: rooms computed with their rows are recomputed when next used. */
  function staleRooms(uuids: Iterable<string>): void {
    for (const uuid of uuids) {
      const list = roomsOfRunner.get(uuid);
      if (list !== undefined) for (const c of list) c.stale = true;
    }
  }
  /**
   * Locality: which slots' caches hold each manifest (by cache key). A slot is re-indexed only when its worker
   * has a new cachedManifests array (after a probe whose cache line changed), and unindexed when it leaves.
   */
  const holders = new Map<string, Set<Slot>>();
  function indexCache(slot: Slot, list: readonly string[]): void {
    for (const key of slot.cacheList) {
      const set = holders.get(key);
      if (set === undefined) continue;
      set.delete(slot);
      if (set.size === 0) holders.delete(key);
    }
    slot.cacheList = list;
    slot.cache = list.length === 0 ? null : new Set(list);
    for (const key of list) {
      const set = holders.get(key);
      if (set === undefined) holders.set(key, new Set([slot]));
      else set.add(slot);
    }
  }
  /** Bumped per locality choice: a slot's `held` is for the bundle being placed when its heldStamp equals it. */
  let heldStamp = 0;
  /** The bytes of these inputs the slot's cache holds. */
  function heldOn(slot: Slot, inputs: Inputs): number {
    if (slot.heldStamp === heldStamp) return slot.held;
    let held = 0;
    const cache = slot.cache;
    if (cache !== null)
      for (let i = 0; i < inputs.keys.length; i++) if (cache.has(inputs.keys[i]!)) held += inputs.bytes[i]!;
    slot.heldStamp = heldStamp;
    slot.held = held;
    return held;
  }

  function roomOf(w: WorkerView, t: InstanceType): WorkerRoom {
    let c = rooms.get(w);
    if (c !== undefined && !c.stale && c.type === t && c.runners.length === w.runners.size) {
      let i = 0;
      let same = true;
      for (const r of w.runners.values()) {
        if (r !== c.runners[i] || r.gpuDevices !== c.devices[i]) {
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
    let slot: Slot;
    if (c !== undefined) {
      unindexRoom(c);
      slot = c.slot;
    } else {
      slot = {
        pass: -1,
        worker: w,
        id: w.id,
        typeName: t.name,
        price: t.price,
        booted: false,
        vcpus: 0,
        ram: 0,
        scratch: 0,
        gpus: NO_GPUS,
        load: 0,
        cleaning: false,
        cacheList: NO_KEYS,
        cache: null,
        heldStamp: -1,
        held: 0,
      };
    }
    c = {
      slot,
      type: t,
      pass,
      runners: [],
      keys: [],
      devices: [],
      staged: [],
      stale: false,
      ended: 0,
      lastEnded: Number.NEGATIVE_INFINITY,
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
      // Only a bundle staged in the queue has an entry this pass sees (scanStaged just read the same queue).
      if (bundle !== undefined && bundle.state === "staged") {
        c.staged.push(r.uuid);
        stagedRunner(r.uuid, w);
      }
      // Its runner called finish: the container is gone, only the runner's clean-up is left. Its slot is free
      // at once, not once a probe sees the runner gone (up to probeInterval later).
      const endedAt = bundle === undefined ? queue.endedAt(r.uuid) : undefined;
      if (endedAt !== undefined) {
        c.ended++;
        if (endedAt > c.lastEnded) c.lastEnded = endedAt;
        continue;
      }
      if (full) continue;
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
    indexRoom(c);
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

  /** Staged bundles with a runner, noted this pass (markRunner). */
  let marked: Entry[] = [];
  /** Notes that a staged bundle already has a runner (the pool started it; the store may not say so yet). */
  function markRunner(uuid: string, workerId: string): void {
    const e = entries.get(uuid);
    if (e !== undefined) {
      if (e.runnerPass !== pass) marked.push(e);
      e.runnerOn = workerId;
      e.runnerPass = pass;
    }
  }

  async function runPass(): Promise<PassResult> {
    pass++;
    marked = [];
    const now = clock.now();
    const result: PassResult = { started: [], planned: 0, created: [], shutdown: [], failed: [], waiting: 0 };
    const added = scanStaged();

    // The workers as this pass sees them.
    const slots: Slot[] = [];

    const addSlot = (w: WorkerView): Slot | null => {
      const t = w.instanceType;
      const ts = typeState(t.name);
      const live = w.state !== "shutdown" && !w.broken;
      if (live && !w.placeholder && w.idleBehavior === "run") ts.runPass = pass;
      if (live && w.idleBehavior === "hold") ts.heldPass = pass;
      if (!live || w.idleBehavior !== "run") {
        for (const uuid of w.runners.keys()) {
          if (queue.get(uuid)?.state === "staged") stagedRunner(uuid, w);
        }
        return null;
      }
      const c = roomOf(w, t);
      const slot = c.slot;
      slot.pass = pass;
      slot.id = w.id;
      slot.typeName = t.name;
      slot.price = t.price;
      slot.booted = !w.placeholder && (w.state === "idle" || w.state === "running");
      slot.vcpus = c.vcpus;
      slot.ram = c.ram;
      slot.scratch = c.scratch;
      slot.gpus = c.gpus;
      slot.load = w.runners.size - c.ended;
      slot.cleaning = now - c.lastEnded < CLEANING_UP_MS;
      const cached = w.cachedManifests ?? NO_KEYS;
      if (cached !== slot.cacheList) indexCache(slot, cached);
      slots.push(slot);
      if (slot.load >= limit) return slot;
      ts.list.push(slot);
      if (c.vcpus > ts.vcpus) ts.vcpus = c.vcpus;
      if (c.ram > ts.ram) ts.ram = c.ram;
      if (c.scratch > ts.scratch) ts.scratch = c.scratch;
      if (c.gpus.length > ts.gpus) ts.gpus = c.gpus.length;
      return slot;
    };
    for (const t of instanceTypes) typeState(t.name);
    for (const w of pool.workers()) addSlot(w);
    for (const ts of typeStates.values()) if (ts.listPass === pass) ts.list.sort(bySlot);
    for (const [w, c] of rooms) {
      if (c.pass === pass) continue;
      rooms.delete(w);
      unindexRoom(c);
      indexCache(c.slot, NO_KEYS);
    }

    const prepare = (shape: Shape) => {
      if (shape.pass === pass) return;
      shape.pass = pass;
      shape.noType = null;
      shape.blockedBase = null;
      const d = shape.demand;
      shape.lists = shape.types.map((t) => typeState(t.name).list);
      shape.cursors = shape.types.map((t, i) => {
        const room = typeState(t.name);
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
        while (c < list.length && !hasRoom(list[c]!, demand, gpuCount, limit)) c++;
        cursors[i] = c;
        const s = list[c];
        if (s !== undefined && (best === null || bySlot(s, best) < 0)) best = s;
      }
      return best;
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

    const setStarting = (
      e: Entry,
      instanceId: string,
      cache: { held: number; total: number } | null = null,
    ) => {
      e.status =
        cache === null
          ? say.startingOn(instanceId)
          : say.startingOnForCache(instanceId, cache.held, cache.total);
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
        shape.blockedSentence = say.withHint(base, hintOf(shape));
      }
      return shape.blockedSentence;
    };

    /**
     * Locality (dispatcher/README.md "A bundle's way"): `slot` is the usual choice for a bundle with inputs; a
     * booted instance with room, of an eligible type no dearer than it, whose cache holds more of the inputs' bytes
     * wins instead (the one holding the most; ties by the usual order). Only instances that can start it now are
     * weighed, so no bundle waits for its cache. Returns the choice and, when its cache holds any of the inputs,
     * how much (for the sentence and the log); null when it holds none.
     */
    let cacheChoice: { held: number; total: number } | null = null;
    const preferCache = (slot: Slot, e: Entry, inputs: Inputs): Slot => {
      heldStamp++;
      const { demand, gpuCount, typeNames } = e.shape;
      let best = slot;
      let bestHeld = heldOn(slot, inputs);
      // The usual choice holds every input: nothing can beat it (the common case once caches are warm).
      if (bestHeld < inputs.total)
        for (const key of inputs.keys) {
          const set = holders.get(key);
          if (set === undefined) continue;
          let visits = 0;
          for (const s of set) {
            if (++visits > HOLDERS_PER_INPUT) break;
            if (s === best || s.pass !== pass || !s.booted || s.price > slot.price) continue;
            if (!typeNames.has(s.typeName) || !hasRoom(s, demand, gpuCount, limit)) continue;
            const h = heldOn(s, inputs);
            if (h > bestHeld || (h === bestHeld && best !== slot && bySlot(s, best) < 0)) {
              best = s;
              bestHeld = h;
            }
          }
        }
      cacheChoice = bestHeld > 0 ? { held: bestHeld, total: inputs.total } : null;
      return best;
    };

    const place = (slot: Slot, e: Entry) => {
      const { demand, gpuCount } = e.shape;
      const cache = cacheChoice;
      cacheChoice = null;
      e.plannedOn = slot.booted ? null : slot.id;
      e.plannedSlot = slot.booted ? null : slot;
      e.plannedPass = pass;
      slot.vcpus -= demand.vcpus;
      slot.ram -= demand.ram;
      slot.scratch -= demand.scratch;
      const devices = slot.gpus.slice(0, gpuCount);
      if (gpuCount > 0) slot.gpus = slot.gpus.slice(gpuCount);
      slot.load++;
      if (slot.booted) {
        const note = cache === null ? undefined : say.forCache(cache.held, cache.total);
        try {
          if (note === undefined) pool.startBundle(slot.id, e.bundle, devices);
          else pool.startBundle(slot.id, e.bundle, devices, note);
        } catch (err) {
          log.error({ err, bundleUuid: e.uuid, instanceId: slot.id }, "pool refused to start a bundle");
          setWaiting(e, say.waitingForIdle(slot.typeName));
          return;
        }
        result.started.push(e.uuid);
        setStarting(e, slot.id, cache);
        if (note === undefined) placements.delete(e.uuid);
        else placements.set(e.uuid, note);
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

    /** Visits one bundle; returns false once the pass places nothing more (the rest is its tail). */
    const visit = (e: Entry): boolean => {
      e.visited = pass;
      if (e.runnerPass === pass) {
        // The pool already started it (the store may not say so yet).
        setStarting(e, e.runnerOn);
        return true;
      }
      const shape = e.shape;
      if (userWorkers !== undefined && !e.exhausted) {
        // The owner's own workers first (docs/workers.md).
        const w = userWorkers.place(e.bundle);
        if (w !== null) {
          result.started.push(e.uuid);
          e.status = say.startingOnWorker(
            w.name,
            w.held > 0 ? { held: w.held, total: inputBytes(e.bundle) } : null,
          );
          e.persist = false;
          e.reason = "";
          return true;
        }
      }
      if (
        workerBound(shape) ||
        (e.unrunnable && !e.exhausted && userWorkers?.couldEverRun(e.bundle) === true)
      ) {
        const tag = shape.demand.tag ?? null;
        setWaiting(
          e,
          say.waitingForWorkers({
            tag,
            workersOnly: shape.demand.workersOnly === true,
            have: userWorkers?.checkedIn(e.bundle.ownerUuid, tag) ?? 0,
          }),
        );
        return true;
      }
      // No type fits it, or a bundle requeued after its last attempt (its runner never started) would otherwise
      // wait forever: failed below.
      if (e.unrunnable) return true;
      prepare(shape);
      let sentence: string | null = null;
      const before = e.plannedPass === pass - 1 ? e.plannedOn : null;
      e.plannedOn = null;
      if (stoppedAt() === null) {
        const sticky = before === null ? null : e.plannedSlot;
        let slot =
          sticky !== null &&
          sticky.pass === pass &&
          sticky.id === before &&
          shape.typeNames.has(sticky.typeName) &&
          hasRoom(sticky, shape.demand, shape.gpuCount, limit)
            ? sticky
            : pick(shape);
        // Bundles without inputs (most) skip this entirely.
        if (slot !== null && e.inputs !== null && slot !== sticky) slot = preferCache(slot, e, e.inputs);
        if (slot !== null) {
          place(slot, e);
          return true;
        }
        sentence = create(e);
        if (sentence === null && stoppedAt() === null) return true; // placed on a new instance
      }
      setWaiting(e, sentence ?? withHint(shape, stoppedAt()!));
      // Past a quota stop only users' workers can still take bundles: walk on while one has a free slot.
      return full || stoppedAt() === null || userWorkers?.anyRoom() === true;
    };
    order = walkInOrder(added, visit);
    // The tail: every bundle after the stop waits for the same reason; only those that do not wait are noted.
    tail.pass = full || stoppedAt() === null ? -1 : pass;
    tail.position = position;
    tail.base = stoppedAt() ?? "";
    tail.skips = [];
    if (tail.pass === pass) {
      for (const e of marked) if (e.visited !== pass && !e.dropped) tail.skips.push(indexOf(e));
      for (const e of unrunnables)
        if (e.visited !== pass && e.runnerPass !== pass) tail.skips.push(indexOf(e));
      tail.skips.sort((a, b) => a - b);
      result.waiting = position + (order.length - tail.start) - tail.skips.length;
    } else result.waiting = position;

    const unrunnable = [...unrunnables]
      .filter((e) => e.runnerPass !== pass && (e.exhausted || userWorkers?.couldEverRun(e.bundle) !== true))
      .sort(byOrder);
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
    placementOf: (uuid) => placements.get(uuid),
  };
}

/** The bytes of a bundle's inputs (its input trees as the store measured them). */
function inputBytes(b: Bundle): number {
  let n = 0;
  for (const m of b.inputManifests ?? []) n += m.bytes;
  return n;
}
