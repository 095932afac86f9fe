/**
 * In-memory stand-ins for the scheduler's unit tests: a SchedulerPool whose workers a test sets up in any
 * state (runners, hold, drain, broken, placeholders) and which records every create, start and shutdown, with
 * knobs for quota, capacity (by type or quota group), rate-limit and max-concurrent-create refusals; a
 * QueueView over a Map; and fixtures for instance types and bundles.
 */
import { randomBytes } from "node:crypto";
import type { InstanceType } from "../cloud-drivers/types.ts";
import type { QueueChange } from "../dispatcher/queue/queue.ts";
import type { SchedulerPool } from "../dispatcher/scheduler/scheduler.ts";
import type {
  CreateRefusal,
  CreateResult,
  IdleBehavior,
  QueueView,
  RunnerView,
  WorkerState,
  WorkerView,
} from "../dispatcher/types.ts";
import type { Clock } from "../lib/clock.ts";
import { CACHE_KEY_HEX } from "../lib/runner-protocol.ts";
import type { Bundle, GpuRequest, InputManifest } from "../store/types.ts";

const GiB = 2 ** 30;
const CAPACITY_BLOCK_MS = 60_000;

export type StubRunner = string | { uuid: string; gpuDevices?: number[]; state?: RunnerView["state"] };

export interface StubWorkerInit {
  id?: string;
  type: InstanceType;
  /** Default idle. */
  state?: WorkerState;
  idleBehavior?: IdleBehavior;
  placeholder?: boolean;
  broken?: boolean;
  runners?: StubRunner[];
  /** Cache keys (lib/runner-protocol.ts cacheKey) or manifest digests its cache holds (the last --list's). */
  cached?: string[];
}

interface StubWorker {
  id: string;
  instanceType: InstanceType;
  state: WorkerState;
  idleBehavior: IdleBehavior;
  placeholder: boolean;
  address: string;
  runners: Map<string, RunnerView>;
  probedAt: number | null;
  stateSince: number;
  lastBusy: number;
  broken: boolean;
  cachedManifests: readonly string[];
}

export class StubSchedulerPool implements SchedulerPool {
  /** Every call the scheduler made, in order. */
  readonly calls = {
    create: [] as string[],
    start: [] as { workerId: string; uuid: string; gpuDevices: number[]; placement?: string }[],
    shutdown: [] as { workerId: string; reason: string }[],
  };
  /** Most instances (placeholders included, shut down ones not); null = unlimited. */
  maxInstances: number | null = null;
  /** The cloud answered a create with a quota error (at quota with no known maximum). */
  cloudQuota = false;
  /** Creates refused with a rate-limit error until then. */
  rateLimitedUntil: number | null = null;
  /** Creates in flight (placeholders) at once; 0 = unlimited. */
  maxConcurrentCreates = 0;
  /** Types whose create calls fail with a capacity error blocking the type, or its quota group, for 1 min. */
  readonly capacityErrors = new Map<string, "type" | "group">();
  /** The quota group of a type (default: its providerType's family, the part before the first "."). */
  quotaGroupOf: (type: InstanceType) => string = (t) => t.providerType.split(".")[0]!;

  private readonly list: StubWorker[] = [];
  private readonly blockedTypes = new Map<string, number>();
  private readonly blockedGroups = new Map<string, number>();
  private nextId = 1;
  private nextCreate = 1;

  constructor(private readonly clock: Clock) {}

  addWorker(init: StubWorkerInit): WorkerView {
    const now = this.clock.now();
    const w: StubWorker = {
      id: init.id ?? `i-${this.nextId++}`,
      instanceType: init.type,
      state: init.state ?? "idle",
      idleBehavior: init.idleBehavior ?? "run",
      placeholder: init.placeholder ?? false,
      address: "",
      runners: new Map(),
      probedAt: null,
      stateSince: now,
      lastBusy: now,
      broken: init.broken ?? false,
      cachedManifests: (init.cached ?? []).map((d) => d.slice(0, CACHE_KEY_HEX)),
    };
    for (const r of init.runners ?? []) this.addRunnerTo(w, r, "running");
    if (w.runners.size > 0 && w.state === "idle") w.state = "running";
    this.list.push(w);
    return w;
  }

  worker(id: string): WorkerView | undefined {
    return this.list.find((w) => w.id === id);
  }

  /** A new probe's cache line: the worker's cache now holds these (cache keys or digests). */
  setCached(id: string, cached: string[]): void {
    this.get(id).cachedManifests = cached.map((d) => d.slice(0, CACHE_KEY_HEX));
  }

  /** Changes a worker's state, behaviour or brokenness. */
  update(id: string, patch: Partial<Pick<StubWorker, "state" | "idleBehavior" | "broken">>): void {
    Object.assign(this.get(id), patch);
  }

  /** A placeholder's create returned: it becomes instance newId (default i-<n>) in the given state. */
  boot(id: string, opts: { newId?: string; state?: WorkerState } = {}): WorkerView {
    const w = this.get(id);
    w.placeholder = false;
    w.id = opts.newId ?? `i-${this.nextId++}`;
    w.state = opts.state ?? "idle";
    w.stateSince = this.clock.now();
    return w;
  }

  addRunner(id: string, runner: StubRunner): void {
    const w = this.get(id);
    this.addRunnerTo(w, runner, "running");
    if (w.state === "idle") w.state = "running";
  }

  removeRunner(id: string, uuid: string): void {
    const w = this.get(id);
    w.runners.delete(uuid);
    if (w.runners.size === 0 && w.state === "running") w.state = "idle";
  }

  removeWorker(id: string): void {
    this.list.splice(this.list.indexOf(this.get(id)), 1);
  }

  blockType(name: string, until: number): void {
    this.blockedTypes.set(name, until);
  }

  blockQuotaGroup(group: string, until: number): void {
    this.blockedGroups.set(group, until);
  }

  // SchedulerPool

  workers(): readonly WorkerView[] {
    return [...this.list];
  }

  create(type: InstanceType): CreateResult {
    const q = this.quota();
    if (q.atQuota) {
      return {
        ok: false,
        refusal: { kind: "quota", message: "at quota", instances: q.instances, max: q.max, until: q.until },
      };
    }
    const refused = this.createsBlocked();
    if (refused !== null) return { ok: false, refusal: refused };
    const blocked = this.capacityBlocked(type);
    if (blocked !== null) return { ok: false, refusal: { kind: "capacity", ...blocked } };
    const error = this.capacityErrors.get(type.name);
    if (error !== undefined) {
      const until = this.clock.now() + CAPACITY_BLOCK_MS;
      if (error === "type") this.blockedTypes.set(type.name, until);
      else this.blockedGroups.set(this.quotaGroupOf(type), until);
      return {
        ok: false,
        refusal: { kind: "capacity", message: `${type.name}: insufficient capacity`, until },
      };
    }
    this.calls.create.push(type.name);
    const worker = this.addWorker({
      id: `creating-${this.nextCreate++}`,
      type,
      state: "booting",
      placeholder: true,
    });
    return { ok: true, worker };
  }

  startBundle(workerId: string, bundle: Bundle, gpuDevices: number[], placement?: string): void {
    const w = this.get(workerId);
    this.calls.start.push({
      workerId,
      uuid: bundle.uuid,
      gpuDevices,
      ...(placement === undefined ? {} : { placement }),
    });
    this.addRunnerTo(w, { uuid: bundle.uuid, gpuDevices }, "starting");
    if (w.state === "idle") w.state = "running";
  }

  shutdown(workerId: string, reason: string): void {
    const w = this.get(workerId);
    this.calls.shutdown.push({ workerId, reason });
    w.state = "shutdown";
  }

  quota(): { atQuota: boolean; instances: number; max: number | null; until: number | null } {
    const instances = this.list.filter((w) => w.state !== "shutdown").length;
    const atQuota = this.cloudQuota || (this.maxInstances !== null && instances >= this.maxInstances);
    return { atQuota, instances, max: this.maxInstances, until: null };
  }

  capacityBlocked(type: InstanceType): { until: number; message: string } | null {
    const now = this.clock.now();
    const t = this.blockedTypes.get(type.name);
    if (t !== undefined && t > now) return { until: t, message: `${type.name} at capacity` };
    const group = this.quotaGroupOf(type);
    const g = this.blockedGroups.get(group);
    if (g !== undefined && g > now) return { until: g, message: `quota group ${group} at capacity` };
    return null;
  }

  createsBlocked(): CreateRefusal | null {
    const now = this.clock.now();
    if (this.rateLimitedUntil !== null && this.rateLimitedUntil > now) {
      return { kind: "rate_limit", message: "rate limited", until: this.rateLimitedUntil };
    }
    const inFlight = this.list.filter((w) => w.placeholder && w.state !== "shutdown").length;
    if (this.maxConcurrentCreates > 0 && inFlight >= this.maxConcurrentCreates) {
      return { kind: "max_concurrent", message: "too many creates in flight", inFlight };
    }
    return null;
  }

  private get(id: string): StubWorker {
    const w = this.list.find((x) => x.id === id);
    if (w === undefined) throw new Error(`stub pool: no worker ${id}`);
    return w;
  }

  private addRunnerTo(w: StubWorker, r: StubRunner, state: RunnerView["state"]): void {
    const runner = typeof r === "string" ? { uuid: r } : r;
    w.runners.set(runner.uuid, {
      uuid: runner.uuid,
      state: typeof r === "string" ? state : (r.state ?? state),
      gpuDevices: runner.gpuDevices ?? [],
      since: this.clock.now(),
      // The stub's starts return at once.
      detachedAt: this.clock.now(),
    });
    w.lastBusy = this.clock.now();
  }
}

/**
 * A QueueView over a Map (apply: the newer changeSeq wins) that tells subscribers what changed, at once, as the
 * BundleQueue does (set and delete too, so tests that arrange rows directly are seen as changes).
 */
export class MemoryQueue implements QueueView {
  private readonly rows = new Map<string, Bundle>();
  private readonly listeners = new Set<(changes: readonly QueueChange[]) => void>();

  /** `clock` stamps the bundles seen ending (endedAt), as the BundleQueue's does. */
  constructor(
    private readonly clock: Clock,
    bundles: Iterable<Bundle> = [],
  ) {
    for (const b of bundles) this.rows.set(b.uuid, b);
  }

  all(): Iterable<Bundle> {
    return this.rows.values();
  }

  get(uuid: string): Bundle | undefined {
    return this.rows.get(uuid);
  }

  private readonly endedTimes = new Map<string, number>();

  endedAt(uuid: string): number | undefined {
    return this.endedTimes.get(uuid);
  }

  apply(bundle: Bundle): void {
    const old = this.rows.get(bundle.uuid);
    if (old !== undefined && old.changeSeq > bundle.changeSeq) return;
    if (bundle.state === "staged" || bundle.state === "starting" || bundle.state === "running") {
      this.rows.set(bundle.uuid, bundle);
    } else {
      this.rows.delete(bundle.uuid);
      if ((bundle.state === "ready" || bundle.state === "failed") && !this.endedTimes.has(bundle.uuid))
        this.endedTimes.set(bundle.uuid, this.clock.now());
    }
    this.tell([{ uuid: bundle.uuid, from: old?.state ?? null, to: bundle.state, bundle }]);
  }

  /** Adds or replaces rows as given (no changeSeq check). */
  set(...bundles: Bundle[]): void {
    const changes: QueueChange[] = [];
    for (const b of bundles) {
      changes.push({ uuid: b.uuid, from: this.rows.get(b.uuid)?.state ?? null, to: b.state, bundle: b });
      this.rows.set(b.uuid, b);
    }
    this.tell(changes);
  }

  delete(uuid: string): void {
    const old = this.rows.get(uuid);
    this.rows.delete(uuid);
    if (old !== undefined) this.tell([{ uuid, from: old.state, to: old.state, bundle: old }]);
  }

  subscribe(fn: (changes: readonly QueueChange[]) => void): () => void {
    this.listeners.add(fn);
    return () => {
      this.listeners.delete(fn);
    };
  }

  private tell(changes: readonly QueueChange[]): void {
    if (changes.length === 0) return;
    for (const fn of [...this.listeners]) fn(changes);
  }
}

let seq = 0;
const ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789";

/** A staged bundle (not in any database): sizes in GiB; createdAt advances 1 s per call unless given. */
export function testBundle(
  opts: {
    uuid?: string;
    vcpus?: number;
    ramGiB?: number;
    scratchGiB?: number;
    gpu?: Partial<GpuRequest> & { deviceCount: number };
    preemptible?: boolean;
    priority?: number;
    createdAt?: Date;
    state?: Bundle["state"];
    /** Its input manifests (bundle.inputManifests). */
    inputs?: InputManifest[];
  } = {},
): Bundle {
  seq++;
  const created = opts.createdAt ?? new Date(Date.UTC(2025, 11, 1) + seq * 1000);
  const gpu: GpuRequest | null =
    opts.gpu === undefined
      ? null
      : { stack: "cuda", vram: 0, driverVersion: null, hardwareTarget: [], ...opts.gpu };
  return {
    uuid: opts.uuid ?? `zzzzz-bndl-${Array.from(randomBytes(15), (b) => ALNUM[b % ALNUM.length]).join("")}`,
    ownerUuid: "zzzzz-user-000000000000000",
    name: "test",
    command: ["true"],
    image: "busybox",
    env: {},
    resources: {
      vcpus: opts.vcpus ?? 1,
      ram: (opts.ramGiB ?? 1) * GiB,
      scratch: (opts.scratchGiB ?? 1) * GiB,
      gpu,
    },
    preemptible: opts.preemptible ?? false,
    priority: opts.priority ?? 500,
    limits: { time: null, disk: null, network: true },
    dependencies: [],
    allowFailedDependencies: false,
    maxAttempts: 3,
    attempt: 0,
    state: opts.state ?? "staged",
    stateReason: null,
    schedulingStatus: null,
    instanceId: null,
    instanceType: null,
    gpuDevices: [],
    exitCode: null,
    resourceUsage: null,
    costDollars: null,
    changeSeq: seq,
    createdAt: created,
    updatedAt: created,
    stagedAt: created,
    startingAt: null,
    runningAt: null,
    finishedAt: null,
    ...(opts.inputs === undefined ? {} : { inputManifests: opts.inputs }),
  };
}
