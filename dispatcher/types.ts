/**
 * Views the dispatcher's parts share (dispatcher/README.md). Each consumer declares the interface it calls
 * next to itself (the scheduler's `SchedulerPool`, sync's `SyncPool`); these are the values that cross them.
 */
import type { InstanceType } from "../cloud-drivers/types.ts";
import type { Bundle } from "../store/types.ts";

/** Idle behaviours (DESIGN.md §4): kept in the instance's IdleBehavior tag. */
export const IDLE_BEHAVIORS = ["run", "hold", "drain"] as const;
export type IdleBehavior = (typeof IDLE_BEHAVIORS)[number];

export const WORKER_STATES = ["unknown", "booting", "idle", "running", "shutdown"] as const;
export type WorkerState = (typeof WORKER_STATES)[number];

/** What the pool knows of one runner on a worker. */
export interface RunnerView {
  uuid: string;
  /**
   * `starting`: the pool sent `--detach` (or is about to) and has not yet seen it in a `--list`;
   * `running`: listed by the last `--list`; `stale`: listed as stale (its holder died).
   */
  state: "starting" | "running" | "stale";
  /** GPU device indices the pool assigned (empty when the bundle asked for none). */
  gpuDevices: readonly number[];
  /** When the pool first knew of it (ms since the epoch). */
  since: number;
  /**
   * When the pool's start of it returned (the warm spare or `--detach` answered; a runner found by `--list`
   * counts from when it was found); null while that start is under way, when no list can show it yet.
   */
  readonly detachedAt: number | null;
}

/** One instance as the pool sees it; placeholders for creates in flight have ids `creating-<n>`. */
export interface WorkerView {
  readonly id: string;
  readonly instanceType: InstanceType;
  readonly state: WorkerState;
  readonly idleBehavior: IdleBehavior;
  /** True for a create still in flight (no cloud instance id yet). */
  readonly placeholder: boolean;
  readonly address: string;
  readonly runners: ReadonlyMap<string, RunnerView>;
  /** Time of the last successful probe (null before the first). */
  readonly probedAt: number | null;
  /** When it entered its current state. */
  readonly stateSince: number;
  /** Last time it had a runner (or its creation time). */
  readonly lastBusy: number;
  /**
   * `--list` said broken or preempted, a secret mismatch, or a failed runner deployment; it gets no new
   * bundles.
   */
  readonly broken: boolean;
  /** `--list` said preempted: a spot interruption notice; shut down as soon as nothing runs on it. */
  readonly preempted?: boolean;
  /**
   * The cache keys (lib/runner-protocol.ts cacheKey) of the manifests the instance's cache held in full at the
   * last successful probe (`--list`'s `cache` line), most recently used first; empty before a probe and from
   * runners that print no such line. The same array object while the list does not change (the scheduler
   * re-indexes an instance's cache only when it gets a new one).
   */
  readonly cachedManifests?: readonly string[];
  /**
   * Why it takes no bundles, may never take one, or is going away, in words for people: the runner cannot run
   * here (its first error line), a failed deployment, a secret mismatch, broken, preempted, or the shutdown
   * reason. Null when nothing is wrong.
   */
  readonly problem?: string | null;
  /**
   * Dollars per hour at `now`: the driver's price history for the instance when it has one (EC2 spot prices),
   * else the type's configured price.
   */
  pricePerHour?(now: number): number;
}

/** What the pool tells its subscribers (the scheduler, sync, metrics, tests). */
export type PoolEvent =
  | {
      type: "worker:created" | "worker:state" | "worker:gone";
      workerId: string;
      state?: WorkerState;
      /** worker:gone: "disappeared", "shut down", "create failed: ...", or "created as <id>". */
      reason?: string;
      /** worker:gone of a placeholder whose instance now exists: the instance's id. */
      replacedBy?: string;
    }
  | {
      type: "runner:started" | "runner:start_failed" | "runner:gone";
      workerId: string;
      uuid: string;
      reason?: string;
    }
  | { type: "create:error"; instanceType: string; code: string; message: string };

/** Why the pool would not create an instance now. */
export type CreateRefusal =
  | { kind: "quota"; message: string; instances: number; max: number | null; until: number | null }
  | { kind: "capacity"; message: string; until: number }
  | { kind: "rate_limit"; message: string; until: number }
  | { kind: "max_concurrent"; message: string; inFlight: number }
  /** The runner could not run on the last new instance(s): creates wait, doubling each time it happens again. */
  | { kind: "runner_failed"; message: string; until: number; instances: number };

export type CreateResult = { ok: true; worker: WorkerView } | { ok: false; refusal: CreateRefusal };

/** The queue the scheduler and sync read: every active bundle (staged, starting, running). */
export interface QueueView {
  /** Active bundles, in no particular order. */
  all(): Iterable<Bundle>;
  get(uuid: string): Bundle | undefined;
  /**
   * When (the clock's ms) the queue saw the bundle leave as `ready` or `failed`, for bundles that did so
   * recently; undefined for others. Its container is done, and a runner still listed for it only cleans up, so
   * it takes no room on its instance.
   */
  endedAt(uuid: string): number | undefined;
  /**
   * Applies a committed row this process just wrote or read (newer changeSeq wins), so a pass need not wait for
   * NOTIFY; the queue's reads do not ask for its sequence again. Never a row of a transaction still open.
   */
  apply(bundle: Bundle): void;
}

/** The scheduler's order of staged bundles (as byOrder): priority (desc), then age, then uuid. */
export const queueOrder = (a: Bundle, b: Bundle): number =>
  b.priority - a.priority ||
  a.createdAt.getTime() - b.createdAt.getTime() ||
  (a.uuid < b.uuid ? -1 : a.uuid > b.uuid ? 1 : 0);

/** A bundle's resource demand on an instance, after reserveExtraRam and the 95 % rule. */
export interface Demand {
  vcpus: number;
  /** Bytes: (ram + reserveExtraRam) x 100/95. */
  ram: number;
  scratch: number;
  gpu: Bundle["resources"]["gpu"];
  preemptible: boolean;
  /** Only instance types (and users' workers) with this tag (resources.tag). Absent: any. */
  tag?: string;
  /** Only the owner's own workers, no instance type at all (resources.workersOnly). Absent: false. */
  workersOnly?: boolean;
}

/** One of the users' own workers (docs/workers.md) as the dispatcher sees it (the management API shows these). */
export interface UserWorkerView {
  id: string;
  ownerUuid: string;
  name: string;
  state: "new" | "active" | "draining" | "stopped" | "lost";
  disabled: boolean;
  tags: readonly string[];
  slots: number;
  /** Bundles starting or running there (or being given to it). */
  bundles: readonly string[];
  version: string | null;
  /** Milliseconds since its last check-in, now (null: never). */
  checkinAgeMs: number | null;
  /** It may be given bundles now (active, enabled, checked in lately). */
  fresh: boolean;
}
