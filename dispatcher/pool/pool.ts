/**
 * The WorkerPool (dispatcher/README.md, "Instance states"): every instance of this dispatcher, from the create
 * call to its disappearance from the cloud's list. It creates instances (placeholders at once, the cloud call
 * in the background), probes them, deploys the runner, starts and kills runners, keeps idle behaviours in the
 * tags, applies every shutdown rule, and turns cloud errors into quota, capacity and rate-limit states.
 */
import type { Registry } from "prom-client";
import {
  type CapacityError,
  cloudErrorCode,
  isCapacityError,
  isCloudQuotaError,
  isCloudRateLimitError,
} from "../../cloud-drivers/errors.ts";
import { type Instance, type InstanceSet, type InstanceType, TAG } from "../../cloud-drivers/types.ts";
import type { Config } from "../../config/schema.ts";
import type { Clock } from "../../lib/clock.ts";
import type { Logger } from "../../lib/logger.ts";
import { formatDuration } from "../../lib/units.ts";
import { hashToken, newRunnerToken } from "../../rest-server/tokens.ts";
import type { Db } from "../../store/db.ts";
import { loseBundle, requeueStarting, startBundle as startTransition } from "../../store/transitions.ts";
import type { Bundle } from "../../store/types.ts";
import type { Executor } from "../sshexec/types.ts";
import type { CreateRefusal, CreateResult, QueueView, WorkerState, WorkerView } from "../types.ts";
import {
  IDLE_BEHAVIORS,
  type IdleBehavior,
  initScript,
  instanceTags,
  newInstanceSecret,
} from "./bootstrap.ts";
import { type BootOutcome, createPoolMetrics } from "./metrics.ts";
import { PROBE_COMMAND_TIMEOUT_MS, type ProbeResult, probeBooting, probeList, tail } from "./probe.ts";
import { type ListedRunners, runnerCommands } from "./runner-commands.ts";
import { type PoolRunner, Worker } from "./worker.ts";

/** How long a capacity error blocks its type, quota group or everything; and a quota error with no instances. */
export const CAPACITY_BLOCK_MS = 60_000;
export const QUOTA_BLOCK_MS = 60_000;
/** probeNow: at most one immediate probe per worker per this long, repeated for at most IMMEDIATE_WINDOW_MS. */
export const IMMEDIATE_PROBE_MS = 1000;
const IMMEDIATE_WINDOW_MS = 60_000;
/**
 * Probes in a row in which the runner cannot run before the instance is shut down as broken; then creates wait
 * RUNNER_BLOCK_MS, doubled for each further instance that fails the same way in a row (at most
 * RUNNER_BLOCK_MAX_MS), until an instance becomes ready.
 */
export const RUNNER_FAILURE_TRIES = 3;
/** How long an instance this pool created may be missing from the cloud's lists before it counts as gone. */
export const LIST_GRACE_MS = 5 * 60_000;
export const RUNNER_BLOCK_MS = 60_000;
export const RUNNER_BLOCK_MAX_MS = 16 * 60_000;
/** Bounds of the start document's spotCheckIntervalMs (crunch-run/start-doc.ts). */
const SPOT_CHECK_MS = { min: 10, max: 3_600_000 } as const;

export interface WorkerPoolOptions {
  config: Config;
  instanceSet: InstanceSet;
  instanceTypes: readonly InstanceType[];
  db: Db;
  clock: Clock;
  logger: Logger;
  registry: Registry;
  /** The pool applies the rows its transitions return, so a pass need not wait for NOTIFY. */
  queue?: QueueView;
  /** Opens an executor that proves `expectedSecret` on connect (the real SSH executor, or the stub's). */
  connect(instance: Instance, expectedSecret: string): Executor;
  /** What to deploy as crunch-run. */
  runner: { content: Buffer; sha256: string };
  /** REST server URL put in the start document. */
  runnerApiUrl: string;
  /** One authorized_keys line installed on new instances when cloud.deployPublicKey is on. */
  dispatcherPublicKey?: string;
}

export interface WorkerPool {
  /** First syncOnce (listed instances -> unknown, behaviour and type from the tags), then the loops. */
  start(): Promise<void>;
  /** Stops the loops and closes executors; never destroys instances. */
  stop(): Promise<void>;
  /** Lists the cloud: adds unknown instances, forgets disappeared ones (event), re-destroys shutdown ones. */
  syncOnce(): Promise<void>;
  /** Probes every due worker (within maxProbesPerSecond), then applies the shutdown rules and kill repeats. */
  probeOnce(): Promise<void>;
  workers(): readonly WorkerView[];
  /** A worker by id; a placeholder's old id still finds the instance it became. */
  worker(id: string): WorkerView | undefined;
  /** A placeholder at once; the cloud call runs in the background. */
  create(type: InstanceType): CreateResult;
  /**
   * Records a `starting` runner on the worker at once; then: new runner token, store startBundle (staged ->
   * starting), `R --detach <uuid>` with the start document on stdin. A lost transition drops the runner; a
   * failed detach requeues the bundle (event runner:start_failed). Throws if the worker cannot take bundles.
   */
  startBundle(workerId: string, bundle: Bundle, gpuDevices: number[]): void;
  /**
   * Probes the worker now (at most once a second per worker; a probe in flight is followed by another): for a
   * runner still listed whose bundle the queue already has back in `staged` (a preempted runner that reported
   * its notice). The pool repeats it while that holds, for up to a minute.
   */
  probeNow(workerId: string): void;
  /** `--kill 15` now and every timeoutSignal until the runner is gone or timeoutTerm passes; then drain. */
  killRunner(workerId: string, uuid: string, reason: string): void;
  /** Sets the idle behaviour and rewrites the instance's tags. */
  setIdleBehavior(workerId: string, behavior: IdleBehavior): Promise<void>;
  shutdown(workerId: string, reason: string): void;
  quota(): { atQuota: boolean; instances: number; max: number | null; until: number | null };
  capacityBlocked(type: InstanceType): { until: number; message: string } | null;
  /** Rate limit or max concurrent creates, for status sentences. */
  createsBlocked(): CreateRefusal | null;
  subscribe(fn: (event: PoolEvent) => void): () => void;
  /** Resolves when no background operation is in flight (tests). */
  settled(): Promise<void>;
}

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

interface Block {
  until: number;
  message: string;
}

const BOOTING: ReadonlySet<WorkerState> = new Set(["unknown", "booting"]);
const BOOTED: ReadonlySet<WorkerState> = new Set(["idle", "running"]);

export function createWorkerPool(opts: WorkerPoolOptions): WorkerPool {
  const { config, instanceSet, db, clock, queue, runner } = opts;
  const cloud = config.cloud;
  const log = opts.logger.child({ component: "pool" });
  const prefix = cloud.tagKeyPrefix;
  const types = new Map(opts.instanceTypes.map((t) => [t.name, t]));
  const cmds = runnerCommands(cloud.deployRunnerDirectory, runner.sha256);
  const publicKey = cloud.deployPublicKey ? (opts.dispatcherPublicKey ?? "") : "";
  if (cloud.deployPublicKey && publicKey === "") {
    log.warn("no dispatcher public key given: new instances get none (cloud.deployPublicKey is on)");
  }

  const workers = new Map<string, Worker>();
  /** Old placeholder id -> the instance id it became. */
  const replaced = new Map<string, string>();
  /** Placeholders whose create call is in flight, by secret (a listed instance with that secret is theirs). */
  const creating = new Map<string, Worker>();
  const listeners = new Set<(event: PoolEvent) => void>();
  const inflight = new Set<Promise<unknown>>();
  /** Workers with an immediate probe asked for (probeNow) and not started yet. */
  const wanted = new Set<Worker>();
  /** Bundles the pool is requeueing after their runner left a preempted instance without reporting. */
  const losing = new Set<string>();
  let placeholderSeq = 0;
  /** Create calls in flight (maxConcurrentInstanceCreateOps). */
  let createCalls = 0;
  let knownSeq = 0;
  let quotaHit: { instances: number; until: number | null; message: string } | null = null;
  let rateLimit: Block | null = null;
  /** New instances in a row whose runner could not run, and the block on creates that follows. */
  let runnerFailed: { instances: number; until: number; message: string } | null = null;
  const capacity = {
    types: new Map<string, Block>(),
    groups: new Map<string, Block>(),
    all: null as Block | null,
  };
  let probeTokens = cloud.maxProbesPerSecond;
  let tokensAt = clock.now();
  let loops: AbortController | null = null;

  const metrics = createPoolMetrics(opts.registry, opts.instanceTypes, function* () {
    for (const w of workers.values()) yield { state: w.state, instanceType: w.instanceType.name };
  });

  // --- plumbing -------------------------------------------------------------------------------------------

  function emit(event: PoolEvent): void {
    for (const fn of listeners) {
      try {
        fn(event);
      } catch (err) {
        log.error({ err, event: event.type }, "pool event listener threw");
      }
    }
  }

  /** Runs `p` in the background: tracked for settled(), errors logged. */
  function track(p: Promise<unknown>, what: string, logger: Logger = log): void {
    const tracked = p.catch((err: unknown) => logger.error({ err }, `${what} failed`));
    inflight.add(tracked);
    void tracked.finally(() => inflight.delete(tracked));
  }

  /** Probes and starts of one worker run one after another. */
  function exclusive(w: Worker, fn: () => Promise<void>): Promise<void> {
    const run = w.chain.then(fn);
    w.chain = run.then(
      () => {},
      () => {},
    );
    return run;
  }

  function lookup(id: string): Worker | undefined {
    return workers.get(id) ?? workers.get(replaced.get(id) ?? "");
  }

  /** Shut down, or no longer in the pool (forgotten). */
  function isGone(w: Worker): boolean {
    return w.state === "shutdown" || workers.get(w.id) !== w;
  }

  function mustGet(id: string, what: string): Worker {
    const w = lookup(id);
    if (w === undefined) throw new Error(`${what}: the pool has no worker ${id}`);
    return w;
  }

  function setState(w: Worker, state: WorkerState): void {
    if (w.state === state) return;
    const from = w.state;
    w.state = state;
    w.stateSince = clock.now();
    w.log.info({ from, to: state }, "instance state changed");
    emit({ type: "worker:state", workerId: w.id, state });
  }

  /** idle <-> running by whether any runner is on it (for booted workers only). */
  function settleBusy(w: Worker): void {
    if (!BOOTED.has(w.state)) return;
    const busy = w.runners.size > 0;
    if (busy) w.lastBusy = clock.now();
    else if (w.state === "running") w.lastBusy = clock.now();
    setState(w, busy ? "running" : "idle");
  }

  function executorOf(w: Worker): Executor {
    if (w.executor === null) {
      if (w.instance === null) throw new Error(`no instance for ${w.id} yet`);
      w.executor = opts.connect(w.instance, w.secret);
    }
    return w.executor;
  }

  function closeExecutor(w: Worker): void {
    const exec = w.executor;
    w.executor = null;
    if (exec !== null) track(exec.close(), "closing the executor", w.log);
  }

  function bootOutcome(w: Worker, outcome: BootOutcome): void {
    if (!w.created || w.bootDone) return;
    w.bootDone = true;
    metrics.bootOutcome(outcome);
  }

  /** A deterministic share (0-10 %) of probeInterval, so workers' probes spread out. */
  function jitter(id: string): number {
    let h = 0x811c9dc5;
    for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 0x01000193) >>> 0;
    return Math.floor((h / 2 ** 32) * 0.1 * cloud.probeInterval);
  }

  // --- tags and idle behaviour ----------------------------------------------------------------------------

  async function writeTags(w: Worker): Promise<void> {
    if (w.instance === null) return;
    await w.instance.setTags(instanceTags(config, w.instanceType.name, w.idleBehavior, w.secret));
  }

  function changeBehavior(w: Worker, behavior: IdleBehavior, reason: string): void {
    if (w.idleBehavior === behavior) return;
    w.log.info({ from: w.idleBehavior, to: behavior, reason }, "idle behaviour changed");
    // An instance released from hold gets a whole timeoutIdle to take work, rather than being shut down at
    // once for the time it spent held.
    if (w.idleBehavior === "hold" && behavior === "run") w.lastBusy = clock.now();
    w.idleBehavior = behavior;
    emit({ type: "worker:state", workerId: w.id, state: w.state });
  }

  /** Internal drains (broken, stale lock, kill given up, type no longer configured): tags in the background. */
  function drain(w: Worker, reason: string): void {
    if (w.idleBehavior !== "run") return;
    changeBehavior(w, "drain", reason);
    if (!w.placeholder) track(writeTags(w), "writing tags", w.log);
  }

  // --- creating -------------------------------------------------------------------------------------------

  function realCount(): number {
    let n = 0;
    for (const w of workers.values()) if (!w.placeholder) n++;
    return n;
  }

  function quota(): { atQuota: boolean; instances: number; max: number | null; until: number | null } {
    const now = clock.now();
    const instances = workers.size;
    let max = cloud.maxInstances > 0 ? cloud.maxInstances : null;
    let atQuota = max !== null && instances >= max;
    let until: number | null = null;
    if (quotaHit !== null) {
      const over = quotaHit.until !== null ? now >= quotaHit.until : realCount() < quotaHit.instances;
      if (over) {
        log.info("cloud quota: no longer at quota");
        quotaHit = null;
      } else {
        atQuota = true;
        until = quotaHit.until;
        if (quotaHit.instances > 0) max = Math.min(max ?? Number.POSITIVE_INFINITY, quotaHit.instances);
      }
    }
    return { atQuota, instances, max, until };
  }

  function capacityBlocked(type: InstanceType): Block | null {
    const now = clock.now();
    const live = (b: Block | null | undefined): Block | null => (b != null && now < b.until ? b : null);
    const blocks = [
      live(capacity.all),
      live(capacity.types.get(type.name)),
      live(capacity.groups.get(instanceSet.quotaGroup(type))),
    ].filter((b): b is Block => b !== null);
    if (blocks.length === 0) return null;
    return blocks.reduce((a, b) => (b.until > a.until ? b : a));
  }

  function createsBlocked(): CreateRefusal | null {
    const now = clock.now();
    if (rateLimit !== null && now < rateLimit.until) {
      return { kind: "rate_limit", message: rateLimit.message, until: rateLimit.until };
    }
    if (runnerFailed !== null && now < runnerFailed.until) {
      const n = runnerFailed.instances;
      return {
        kind: "runner_failed",
        message: `the runner could not run on the last ${n === 1 ? "new instance" : `${n} new instances`} (${runnerFailed.message})`,
        until: runnerFailed.until,
        instances: n,
      };
    }
    const max = cloud.maxConcurrentInstanceCreateOps;
    if (max > 0 && createCalls >= max) {
      return {
        kind: "max_concurrent",
        message: `${createCalls} instance creation${createCalls === 1 ? "" : "s"} in flight (cloud.maxConcurrentInstanceCreateOps is ${max})`,
        inFlight: createCalls,
      };
    }
    return null;
  }

  function refusalFor(type: InstanceType): CreateRefusal | null {
    const q = quota();
    if (q.atQuota) {
      const message =
        q.max !== null
          ? `at quota: ${q.instances} of ${q.max} instances`
          : `at quota: the cloud refused more instances (${q.instances} now)`;
      return { kind: "quota", message, instances: q.instances, max: q.max, until: q.until };
    }
    const cap = capacityBlocked(type);
    if (cap !== null) return { kind: "capacity", message: cap.message, until: cap.until };
    return createsBlocked();
  }

  function create(type: InstanceType): CreateResult {
    const refusal = refusalFor(type);
    if (refusal !== null) return { ok: false, refusal };
    const w = new Worker({
      id: `creating-${++placeholderSeq}`,
      instance: null,
      instanceType: type,
      state: "booting",
      idleBehavior: "run",
      secret: newInstanceSecret(),
      created: true,
      now: clock.now(),
      parentLogger: log,
    });
    workers.set(w.id, w);
    creating.set(w.secret, w);
    w.log.info({ instanceType: type.name }, "creating an instance");
    emit({ type: "worker:created", workerId: w.id, state: w.state });
    track(createInstance(w), "create", w.log);
    return { ok: true, worker: w };
  }

  async function createInstance(w: Worker): Promise<void> {
    const type = w.instanceType;
    const behavior = w.idleBehavior;
    let inst: Instance;
    createCalls++;
    try {
      inst = await instanceSet.create(
        type,
        cloud.imageId,
        instanceTags(config, type.name, behavior, w.secret),
        initScript(w.secret, cloud.instanceInitCommand),
        publicKey,
      );
    } catch (err) {
      createCalls--;
      creating.delete(w.secret);
      createFailed(w, err);
      return;
    }
    createCalls--;
    creating.delete(w.secret);
    if (w.placeholder) becomeReal(w, inst);
    if (w.state === "shutdown") {
      destroy(w);
      return;
    }
    if (w.idleBehavior !== behavior) await writeTags(w);
  }

  /** A placeholder gets its instance: same Worker object, the instance's id. */
  function becomeReal(w: Worker, inst: Instance): void {
    const old = w.id;
    workers.delete(old);
    creating.delete(w.secret);
    w.id = inst.id;
    w.instance = inst;
    w.placeholder = false;
    w.knownSeq = ++knownSeq;
    workers.set(w.id, w);
    replaced.set(old, w.id);
    w.placeholderId = old;
    w.log.info({ placeholder: old, instanceType: w.instanceType.name }, "instance created");
    emit({ type: "worker:created", workerId: w.id, state: w.state });
    emit({ type: "worker:gone", workerId: old, reason: `created as ${w.id}`, replacedBy: w.id });
  }

  /**
   * A create call failed. Its placeholder goes; but when a list already matched the instance to this create (see
   * syncOnce) the worker is real, may even run bundles, and the driver may be deleting its instance: it is shut
   * down like a broken instance (destroyed; its runners reported gone once the cloud stops listing it).
   */
  function createFailed(w: Worker, err: unknown): void {
    const now = clock.now();
    const type = w.instanceType;
    const code = cloudErrorCode(err);
    const message = err instanceof Error ? err.message : String(err);
    if (w.placeholder) workers.delete(w.id);
    if (isCloudQuotaError(err)) {
      const instances = realCount();
      quotaHit = {
        instances,
        until: instances === 0 ? now + QUOTA_BLOCK_MS : null,
        message,
      };
      w.log.warn({ err, instances }, "cloud quota reached: no creates until an instance goes away");
    } else if (isCapacityError(err)) {
      blockCapacity(type, err, now);
    } else if (isCloudRateLimitError(err)) {
      const until = Math.max(err.earliestRetry, rateLimit?.until ?? 0);
      rateLimit = { until, message: `cloud rate limit: no creates until ${new Date(until).toISOString()}` };
      w.log.warn({ err, until }, "cloud rate limit on create");
    } else {
      w.log.error({ err, instanceType: type.name }, "create failed");
    }
    if (w.placeholder) emit({ type: "worker:gone", workerId: w.id, reason: `create failed: ${message}` });
    else shutdownWorker(w, `its create failed after it was listed: ${message}`, "failure");
    emit({ type: "create:error", instanceType: type.name, code, message });
  }

  function blockCapacity(type: InstanceType, err: CapacityError, now: number): void {
    const until = now + CAPACITY_BLOCK_MS;
    const at = new Date(until).toISOString();
    if (err.scope === "all") {
      capacity.all = { until, message: `no cloud capacity for any instance type until ${at}` };
    } else if (err.scope === "quotaGroup") {
      // Keyed as capacityBlocked() looks it up, whatever name the driver used.
      const group = instanceSet.quotaGroup(type);
      capacity.groups.set(group, { until, message: `no cloud capacity in quota group ${group} until ${at}` });
    } else {
      const name = type.name;
      capacity.types.set(name, { until, message: `${name} at capacity until ${at}` });
    }
    log.warn({ err, scope: err.scope, until }, "cloud capacity error: creates blocked");
  }

  // --- sync -----------------------------------------------------------------------------------------------

  async function syncOnce(): Promise<void> {
    const seqAtStart = knownSeq;
    let list: Instance[];
    try {
      list = await instanceSet.instances({});
    } catch (err) {
      log.warn({ err }, "listing the cloud's instances failed");
      return;
    }
    const now = clock.now();
    const listed = new Set<string>();
    for (const inst of list) {
      listed.add(inst.id);
      const known = workers.get(inst.id);
      if (known !== undefined) {
        known.instance = inst;
        if (!known.listedOnce) {
          known.listedOnce = true;
          if (known.unlistedSince !== null)
            known.log.info({ after: formatDuration(now - known.since) }, "instance listed at last");
          known.unlistedSince = null;
        }
        if (
          known.state === "shutdown" &&
          !known.destroying &&
          now - (known.lastDestroyAt ?? known.stateSince) >= cloud.timeoutShutdown
        ) {
          known.log.info("still listed after timeoutShutdown: destroying again");
          destroy(known);
        }
        continue;
      }
      const secret = inst.tags[prefix + TAG.instanceSecret] ?? "";
      const mine = secret === "" ? undefined : creating.get(secret);
      if (mine !== undefined) {
        becomeReal(mine, inst);
        mine.listedOnce = true;
      } else addUnknown(inst, now);
    }
    for (const w of [...workers.values()]) {
      if (w.placeholder || w.knownSeq > seqAtStart || listed.has(w.id)) continue;
      if (notListedYet(w, now)) continue;
      forget(w);
    }
    quota();
  }

  /**
   * A cloud's list may not show an instance for a while after its create call returned (EC2's eventual
   * consistency): one this pool created and has never seen listed is kept for LIST_GRACE_MS, said once in the
   * log, rather than forgotten as disappeared (which would requeue its bundles and create a replacement).
   */
  function notListedYet(w: Worker, now: number): boolean {
    if (w.listedOnce || !w.created || w.state === "shutdown" || now - w.since >= LIST_GRACE_MS) return false;
    if (w.unlistedSince === null) {
      w.unlistedSince = now;
      w.log.info(
        { sinceCreate: formatDuration(now - w.since), grace: formatDuration(LIST_GRACE_MS) },
        "created instance not listed by the cloud yet: kept for the grace period",
      );
    }
    return true;
  }

  function addUnknown(inst: Instance, now: number): void {
    const typeName = inst.tags[prefix + TAG.instanceType] ?? "";
    const tagBehavior = inst.tags[prefix + TAG.idleBehavior] ?? "";
    const behavior: IdleBehavior = (IDLE_BEHAVIORS as readonly string[]).includes(tagBehavior)
      ? (tagBehavior as IdleBehavior)
      : "run";
    const configured = types.get(typeName);
    const w = new Worker({
      id: inst.id,
      instance: inst,
      instanceType: configured ?? unconfiguredType(typeName, inst.providerType),
      state: "unknown",
      idleBehavior: behavior,
      secret: inst.tags[prefix + TAG.instanceSecret] ?? "",
      created: false,
      now,
      parentLogger: log,
    });
    w.knownSeq = ++knownSeq;
    w.listedOnce = true;
    workers.set(w.id, w);
    w.log.info({ instanceType: typeName, idleBehavior: behavior }, "found an instance");
    emit({ type: "worker:created", workerId: w.id, state: w.state });
    if (configured === undefined)
      drain(w, `instance type ${JSON.stringify(typeName)} is no longer configured`);
  }

  /** Forgets an instance the cloud no longer lists; its runners are reported gone. */
  function forget(w: Worker): void {
    workers.delete(w.id);
    if (w.placeholderId !== null) replaced.delete(w.placeholderId);
    closeExecutor(w);
    const disappeared = w.state !== "shutdown";
    if (disappeared) {
      metrics.disappeared(w.state);
      if (BOOTING.has(w.state)) bootOutcome(w, "disappeared");
      w.log.warn({ state: w.state, runners: w.runners.size }, "instance disappeared from the cloud's list");
    } else {
      w.log.info("instance gone");
    }
    for (const uuid of w.runners.keys()) {
      emit({ type: "runner:gone", workerId: w.id, uuid, reason: "instance disappeared" });
    }
    w.runners.clear();
    emit({ type: "worker:gone", workerId: w.id, reason: disappeared ? "disappeared" : "shut down" });
  }

  // --- shutdown -------------------------------------------------------------------------------------------

  function destroy(w: Worker): void {
    const inst = w.instance;
    if (inst === null) return;
    w.destroying = true;
    w.lastDestroyAt = clock.now();
    track(
      inst
        .destroy()
        .catch((err: unknown) => w.log.warn({ err }, "destroy failed (retried while still listed)"))
        .finally(() => {
          w.destroying = false;
        }),
      "destroy",
      w.log,
    );
  }

  function shutdownWorker(w: Worker, reason: string, outcome: BootOutcome = "aborted"): void {
    if (w.state === "shutdown") return;
    if (BOOTING.has(w.state)) bootOutcome(w, outcome);
    w.shutdownReason = reason;
    w.log.info({ reason, state: w.state, instanceType: w.instanceType.name }, "shutting down");
    setState(w, "shutdown");
    closeExecutor(w);
    // A placeholder is destroyed as soon as its create call returns.
    destroy(w);
  }

  /** The shutdown rules (ARVADOS-FACTS.md §4) and kill repeats, for one worker. */
  function applyRules(w: Worker, now: number): void {
    if (w.placeholder || w.state === "shutdown") return;
    for (const r of w.runners.values()) {
      const k = r.killing;
      if (k === null || k.gaveUp) continue;
      if (now - k.since >= cloud.timeoutTerm) {
        k.gaveUp = true;
        w.log.warn(
          { uuid: r.uuid, after: formatDuration(now - k.since) },
          "runner outlived SIGTERM: draining",
        );
        drain(w, `runner ${r.uuid} did not stop within timeoutTerm`);
      } else if (now - k.lastSent >= cloud.timeoutSignal) {
        k.lastSent = now;
        sendKill(w, r.uuid);
      }
    }
    for (const r of w.runners.values()) {
      if (r.staleSince !== null && now - r.staleSince > cloud.timeoutStaleRunLock) {
        drain(w, `runner ${r.uuid} has held a stale lock for ${formatDuration(now - r.staleSince)}`);
      }
    }
    // The cloud is taking it away anyway: not even a hold keeps it once nothing runs on it.
    if (w.preempted && w.state === "idle") {
      shutdownWorker(w, "preempted (spot interruption notice)");
      return;
    }
    if (w.idleBehavior === "hold") return;
    if (BOOTING.has(w.state)) {
      if (w.state === "booting" && w.idleBehavior === "drain") {
        shutdownWorker(w, "drained while booting");
      } else if (now - w.since >= cloud.timeoutBooting) {
        shutdownWorker(
          w,
          `not ready after timeoutBooting (${formatDuration(cloud.timeoutBooting)})`,
          "failure",
        );
      }
      return;
    }
    const lastOk = w.probedAt ?? w.stateSince;
    if (now - lastOk >= cloud.timeoutProbe) {
      shutdownWorker(w, `no successful probe for ${formatDuration(now - lastOk)} (timeoutProbe)`);
    } else if (w.state === "idle" && w.idleBehavior === "drain") {
      shutdownWorker(w, "drained");
    } else if (w.state === "idle" && now - w.lastBusy >= cloud.timeoutIdle) {
      shutdownWorker(w, `idle for ${formatDuration(now - w.lastBusy)} (timeoutIdle)`);
    }
  }

  function applyAllRules(): void {
    const now = clock.now();
    for (const w of [...workers.values()]) applyRules(w, now);
  }

  // --- probes ---------------------------------------------------------------------------------------------

  function takeProbeToken(now: number): boolean {
    const rate = cloud.maxProbesPerSecond;
    if (rate <= 0) return true;
    probeTokens = Math.min(rate, probeTokens + ((now - tokensAt) * rate) / 1000);
    tokensAt = now;
    if (probeTokens < 1) return false;
    probeTokens -= 1;
    return true;
  }

  /** Starts the immediate probe of `w` if one is wanted and allowed now; true when it started. */
  function startWanted(w: Worker, now: number): boolean {
    if (isGone(w) || w.placeholder) {
      wanted.delete(w);
      w.probeWanted = false;
      return false;
    }
    if (!w.probeWanted || w.probing || now - w.immediateProbeAt < IMMEDIATE_PROBE_MS) return false;
    wanted.delete(w);
    w.probeWanted = false;
    w.immediateProbeAt = now;
    void probe(w, now);
    return true;
  }

  function probeNow(workerId: string): void {
    const w = lookup(workerId);
    if (w === undefined || w.placeholder || w.state === "shutdown") return;
    const now = clock.now();
    w.immediateSince ??= now;
    w.probeWanted = true;
    wanted.add(w);
    startWanted(w, now);
  }

  /** A runner `--list` showed whose bundle the queue has back in `staged`: it is on its way out. */
  function requeuedButListed(w: Worker): boolean {
    if (queue === undefined) return false;
    for (const r of w.runners.values()) {
      if (r.state !== "starting" && queue.get(r.uuid)?.state === "staged") return true;
    }
    return false;
  }

  /** After an immediate probe: another one while a requeued runner is still listed (within the window). */
  function rewant(w: Worker): void {
    if (w.immediateSince === null) return;
    const now = clock.now();
    if (!isGone(w) && requeuedButListed(w) && now - w.immediateSince < IMMEDIATE_WINDOW_MS) {
      w.probeWanted = true;
      wanted.add(w);
    } else if (!w.probeWanted) {
      w.immediateSince = null;
    }
  }

  function startDueProbes(): Promise<void>[] {
    const now = clock.now();
    const started: Promise<void>[] = [];
    for (const w of [...wanted]) startWanted(w, now);
    for (const w of workers.values()) {
      if (w.placeholder || w.state === "shutdown" || w.probing || now < w.nextProbeAt) continue;
      if (!takeProbeToken(now)) break;
      started.push(probe(w, now));
    }
    return started;
  }

  function probe(w: Worker, now: number): Promise<void> {
    w.probing = true;
    w.nextProbeAt = now + cloud.probeInterval + jitter(w.id);
    const run = exclusive(w, async () => {
      if (isGone(w)) return;
      const booting = BOOTING.has(w.state);
      let result: ProbeResult;
      try {
        const target = {
          exec: executorOf(w),
          cmds,
          runner,
          bootProbeCommand: cloud.bootProbeCommand,
          now: () => clock.now(),
        };
        result = booting
          ? await probeBooting(target, { unknown: w.state === "unknown", runnerPresent: w.runnerPresent })
          : await probeList(target);
      } catch (err) {
        result = { ok: false, stage: "connect", message: String(err), answered: false, mismatch: false };
      }
      applyProbe(w, booting, result);
    }).finally(() => {
      w.probing = false;
      rewant(w);
      // Asked for while this probe ran (its --list may predate the requeue): the next one now, if allowed.
      if (w.probeWanted) startWanted(w, clock.now());
    });
    track(run, "probe", w.log);
    return run;
  }

  function applyProbe(w: Worker, booting: boolean, r: ProbeResult): void {
    if (isGone(w)) return;
    const now = clock.now();
    if ((r.ok || r.answered) && !w.sshSeen) {
      w.sshSeen = true;
      if (w.created) metrics.timeToSsh(now - w.since);
    }
    if (!r.ok) {
      w.lastProbeError = r.message;
      if (r.mismatch) {
        w.secretMismatch = true;
        w.log.error({ address: w.address }, "instance failed the identity check: it never gets a token");
        shutdownWorker(w, "secret mismatch", "failure");
        return;
      }
      if (r.stage === "runner") {
        runnerCannotRun(w, r.message, now);
        if (isGone(w)) return;
      } else if (r.stage === "deploy") {
        w.deployFailed = true;
        w.log.warn({ reason: r.message }, "runner deployment failed");
      } else if (booting) {
        w.log.debug({ stage: r.stage, reason: r.message }, "not ready yet");
      } else {
        w.log.warn({ stage: r.stage, reason: r.message }, "probe failed");
      }
      applyRules(w, now);
      return;
    }
    w.lastProbeError = null;
    w.deployFailed = false;
    w.runnerFailures = 0;
    w.runnerFailure = null;
    if (r.booted) w.runnerPresent = true;
    if (r.deployed) w.log.info({ sha256: runner.sha256 }, "runner deployed");
    w.probedAt = r.listSentAt;
    updateRunners(w, r.listed, now);
    if (booting) {
      if (w.created && !w.bootDone) metrics.timeToReady(now - w.since);
      bootOutcome(w, "success");
      if (runnerFailed !== null) {
        w.log.info("the runner runs on a new instance again: creates no longer wait");
        runnerFailed = null;
      }
      w.lastBusy = now;
      setState(w, w.runners.size > 0 ? "running" : "idle");
      w.log.info({ runners: w.runners.size }, "instance ready");
    } else {
      settleBusy(w);
    }
    applyRules(w, now);
  }

  /**
   * The runner is in place but cannot run on `w` (it exits non-zero or prints what is not its grammar): no
   * bundle could ever start there. After RUNNER_FAILURE_TRIES probes in a row it is shut down with the runner's
   * own words, and creates wait (runnerFailed) so that an artifact broken everywhere does not make the pool
   * replace instance after instance.
   */
  function runnerCannotRun(w: Worker, message: string, now: number): void {
    w.runnerFailures++;
    w.runnerFailure = message;
    w.log.warn(
      { reason: message, try: w.runnerFailures, of: RUNNER_FAILURE_TRIES },
      "the runner cannot run on this instance",
    );
    if (w.runnerFailures < RUNNER_FAILURE_TRIES) return;
    shutdownWorker(w, `the runner cannot run: ${message}`, "failure");
    if (!w.created) return;
    const instances = (runnerFailed?.instances ?? 0) + 1;
    const until = now + Math.min(RUNNER_BLOCK_MAX_MS, RUNNER_BLOCK_MS * 2 ** (instances - 1));
    runnerFailed = { instances, until, message };
    log.warn(
      { reason: message, instances, until: new Date(until).toISOString() },
      "the runner cannot run on new instances: creates wait",
    );
  }

  function updateRunners(w: Worker, listed: ListedRunners, now: number): void {
    if (listed.unknown.length > 0) w.log.warn({ lines: listed.unknown }, "unexpected lines from --list");
    w.spareSocket = listed.spare;
    if (listed.broken && !w.listBroken) {
      w.listBroken = true;
      w.log.warn("crunch-run reports the instance broken");
      drain(w, "crunch-run reports the instance broken");
    }
    if (listed.preempted && !w.preempted) {
      // No new bundles (broken), drained, shut down as soon as nothing runs on it (applyRules).
      w.preempted = true;
      metrics.preempted(w.instanceType.name);
      w.log.warn({ runners: listed.runners.size }, "spot interruption notice on the instance: draining it");
      drain(w, "spot interruption notice (preempted)");
    }
    for (const [uuid, state] of listed.runners) {
      let r = w.runners.get(uuid);
      if (r === undefined) {
        r = {
          uuid,
          state,
          gpuDevices: queue?.get(uuid)?.gpuDevices ?? [],
          since: now,
          staleSince: null,
          killing: null,
          detachedAt: now,
        };
        w.runners.set(uuid, r);
        w.log.info({ uuid }, "found a runner");
        emit({ type: "runner:started", workerId: w.id, uuid, reason: "listed" });
      }
      r.state = state;
      if (state === "stale") r.staleSince ??= now;
      else r.staleSince = null;
    }
    for (const r of [...w.runners.values()]) {
      if (listed.runners.has(r.uuid)) continue;
      if (r.state === "starting" && keepStarting(w, r, now)) continue;
      w.runners.delete(r.uuid);
      w.log.info({ uuid: r.uuid }, "runner gone");
      if (w.preempted) loseUnreported(w, r.uuid);
      emit({ type: "runner:gone", workerId: w.id, uuid: r.uuid, reason: "no longer listed" });
    }
  }

  /**
   * A runner left a preempted instance while the queue still has its bundle running there: it stopped without
   * reporting the notice (or the report has not reached the queue yet). Requeue it now, with the reason, rather
   * than wait for sync's two probes; the guarded transition loses harmlessly to a report or a finish.
   */
  function loseUnreported(w: Worker, uuid: string): void {
    const row = queue?.get(uuid);
    if (row === undefined || row.state !== "running" || row.instanceId !== w.id || losing.has(uuid)) return;
    losing.add(uuid);
    const reason = `preempted: spot interruption notice on instance ${w.id} (its runner did not report it)`;
    track(
      loseBundle(db, uuid, row.attempt, { actor: "dispatcher", reason })
        .then((res) => {
          const now = res.ok ? res.bundle : res.current;
          if (now !== null) queue?.apply(now);
          if (res.ok)
            w.log.info({ uuid, state: res.bundle.state }, "requeued a bundle of the preempted instance");
        })
        .finally(() => losing.delete(uuid)),
      "requeueing a bundle of a preempted instance",
      w.log,
    );
  }

  /**
   * A `starting` runner that `--list` does not show stays until sync decides about its bundle: while the
   * detach has not returned, and while the queue still has the bundle starting on this instance (sync requeues
   * it, or the runner got further and ended). Without a queue, for dispatcher.staleLockTimeout. A runner
   * being killed is gone as soon as a list after its detach misses it. Probes and detaches of one worker never
   * overlap, so a detach that has returned happened before this probe's `--list`.
   */
  function keepStarting(w: Worker, r: PoolRunner, now: number): boolean {
    if (r.detachedAt === null) return true;
    if (r.killing !== null) return false;
    if (queue === undefined) return now - r.detachedAt < config.dispatcher.staleLockTimeout;
    const row = queue.get(r.uuid);
    return row?.state === "starting" && row.instanceId === w.id;
  }

  // --- runners --------------------------------------------------------------------------------------------

  function startBundle(workerId: string, bundle: Bundle, gpuDevices: number[]): void {
    const w = mustGet(workerId, "startBundle");
    if (w.placeholder || !BOOTED.has(w.state) || w.idleBehavior !== "run" || w.broken) {
      throw new Error(
        `startBundle: worker ${w.id} cannot take bundles (state ${w.state}, idle behaviour ${w.idleBehavior}` +
          `${w.broken ? ", broken" : ""})`,
      );
    }
    if (w.runners.has(bundle.uuid)) throw new Error(`startBundle: ${bundle.uuid} is already on ${w.id}`);
    const entry: PoolRunner = {
      uuid: bundle.uuid,
      state: "starting",
      gpuDevices: [...gpuDevices],
      since: clock.now(),
      staleSince: null,
      killing: null,
      detachedAt: null,
    };
    w.runners.set(bundle.uuid, entry);
    settleBusy(w);
    track(
      exclusive(w, () => startRunner(w, entry, bundle)),
      "starting a runner",
      w.log,
    );
  }

  function dropStarting(w: Worker, entry: PoolRunner, reason: string): void {
    if (w.runners.get(entry.uuid) === entry && entry.state === "starting") {
      w.runners.delete(entry.uuid);
      settleBusy(w);
    }
    emit({ type: "runner:start_failed", workerId: w.id, uuid: entry.uuid, reason });
  }

  /**
   * Hands the start document straight to the instance's warm spare supervisor (crunch-run/spare.ts) over the
   * SSH connection, which skips starting a `crunch-run --detach` process. True when the spare took it;
   * false (no spare known, the executor cannot, the spare is gone or busy or refused) means use --detach.
   */
  async function handToSpare(w: Worker, uuid: string, doc: object, log: Logger): Promise<boolean> {
    const socket = w.spareSocket;
    const executor = executorOf(w);
    if (socket === null || executor.exchange === undefined) return false;
    const t0 = clock.now();
    try {
      const answer = (
        await executor.exchange(socket, `start ${uuid}\n${JSON.stringify(doc)}\n`, { timeoutMs: 5000 })
      ).toString("utf8");
      if (/^pid \d+\n$/.test(answer)) {
        log.debug({ ms: clock.now() - t0 }, "handed to the spare supervisor");
        return true;
      }
      log.debug({ answer: answer.slice(0, 200) }, "the spare supervisor refused the bundle; using --detach");
    } catch (err) {
      log.debug(
        { err: err instanceof Error ? err.message : String(err) },
        "no spare supervisor; using --detach",
      );
    }
    return false;
  }

  async function startRunner(w: Worker, entry: PoolRunner, bundle: Bundle): Promise<void> {
    const uuid = bundle.uuid;
    const log = w.log.child({ uuid });
    if (isGone(w)) {
      dropStarting(w, entry, "the instance is shutting down");
      return;
    }
    const token = newRunnerToken();
    let started: Bundle;
    try {
      const res = await startTransition(db, uuid, {
        instanceId: w.id,
        instanceType: w.instanceType.name,
        runnerTokenHash: hashToken(token),
        gpuDevices: [...entry.gpuDevices],
        actor: "dispatcher",
      });
      if (!res.ok) {
        if (res.current !== null) queue?.apply(res.current);
        log.info(
          { reason: res.reason, state: res.current?.state },
          "start lost: the bundle changed meanwhile",
        );
        dropStarting(w, entry, `the bundle could not be started (${res.reason})`);
        return;
      }
      started = res.bundle;
    } catch (err) {
      log.error({ err }, "start transition failed");
      dropStarting(w, entry, "the start transition failed");
      return;
    }
    queue?.apply(started);
    const doc = {
      uuid,
      attempt: started.attempt,
      apiUrl: opts.runnerApiUrl,
      token,
      instanceType: w.instanceType.name,
      gpuDevices: [...entry.gpuDevices],
      runtimeEngine: config.dispatcher.runtimeEngine,
      // Only the process runtime uses them (crunch-run's defaults equal the config's).
      ...(config.dispatcher.runtimeEngine === "docker"
        ? {}
        : {
            processUidFirst: config.dispatcher.processRuntimeFirstUid,
            processUidCount: config.dispatcher.processRuntimeUidCount,
          }),
      // Only preemptible types' runners watch for spot interruption notices (crunch-run's defaults: off, 5 s).
      ...(w.instanceType.preemptible
        ? { preemptible: true, spotCheckIntervalMs: spotCheckIntervalMs(cloud.spotInterruptionCheckInterval) }
        : {}),
    };
    let failure: string | null = null;
    let via: "spare" | "detach" = "spare";
    try {
      if (isGone(w)) throw new Error("the instance is shutting down");
      if (!(await handToSpare(w, uuid, doc, log))) {
        via = "detach";
        const res = await executorOf(w).execute(cmds.detach(uuid), {
          stdin: `${JSON.stringify(doc)}\n`,
          timeoutMs: PROBE_COMMAND_TIMEOUT_MS,
        });
        if (res.exitCode !== 0)
          failure = `crunch-run --detach exited ${res.exitCode}: ${tail(res.stderr, 200)}`;
      }
    } catch (err) {
      failure = `crunch-run --detach failed: ${err instanceof Error ? err.message : String(err)}`;
    }
    if (failure === null) {
      entry.detachedAt = clock.now();
      log.info({ attempt: started.attempt, via }, "runner started");
      emit({ type: "runner:started", workerId: w.id, uuid });
      return;
    }
    log.warn({ reason: failure }, "runner start failed: requeueing");
    try {
      const res = await requeueStarting(db, uuid, started.attempt, { actor: "dispatcher", reason: failure });
      const row = res.ok ? res.bundle : res.current;
      if (row !== null) queue?.apply(row);
    } catch (err) {
      log.error({ err }, "requeue after a failed start failed (sync will retry)");
    }
    dropStarting(w, entry, failure);
  }

  function sendKill(w: Worker, uuid: string): void {
    if (w.instance === null || w.state === "shutdown") return;
    const exec = executorOf(w);
    track(
      exec.execute(cmds.kill(uuid, 15), { timeoutMs: PROBE_COMMAND_TIMEOUT_MS }).then((res) => {
        if (res.exitCode !== 0) {
          w.log.info(
            { uuid, exitCode: res.exitCode, stderr: tail(res.stderr, 200) },
            "runner still running after TERM",
          );
        }
      }),
      "kill",
      w.log,
    );
  }

  function killRunner(workerId: string, uuid: string, reason: string): void {
    const w = lookup(workerId);
    if (w === undefined || w.placeholder || w.state === "shutdown") {
      log.info({ workerId, uuid, reason }, "kill: the instance is gone or shutting down");
      return;
    }
    const r = w.runners.get(uuid);
    if (r?.killing != null) return;
    const now = clock.now();
    if (r !== undefined) r.killing = { since: now, lastSent: now, reason, gaveUp: false };
    w.log.info({ uuid, reason }, "killing a runner (TERM)");
    sendKill(w, uuid);
  }

  // --- the public object ----------------------------------------------------------------------------------

  async function loop(
    signal: AbortSignal,
    interval: number,
    body: () => Promise<void> | void,
  ): Promise<void> {
    while (!signal.aborted) {
      try {
        await clock.sleep(interval, signal);
      } catch {
        return;
      }
      try {
        await body();
      } catch (err) {
        log.error({ err }, "pool loop failed");
      }
    }
  }

  return {
    async start() {
      if (loops !== null) return;
      loops = new AbortController();
      const signal = loops.signal;
      await syncOnce();
      void loop(signal, cloud.syncInterval, syncOnce);
      void loop(signal, Math.min(1000, cloud.probeInterval), () => {
        startDueProbes();
        applyAllRules();
      });
    },
    async stop() {
      loops?.abort();
      loops = null;
      for (const w of workers.values()) closeExecutor(w);
    },
    syncOnce,
    async probeOnce() {
      await Promise.all(startDueProbes());
      applyAllRules();
    },
    workers: () => [...workers.values()],
    worker: (id) => lookup(id),
    create,
    startBundle,
    probeNow,
    killRunner,
    async setIdleBehavior(workerId, behavior) {
      if (!(IDLE_BEHAVIORS as readonly string[]).includes(behavior)) {
        throw new Error(`setIdleBehavior: unknown idle behaviour ${JSON.stringify(behavior)}`);
      }
      const w = mustGet(workerId, "setIdleBehavior");
      changeBehavior(w, behavior, "requested");
      try {
        await writeTags(w);
      } finally {
        applyRules(w, clock.now());
      }
    },
    shutdown(workerId, reason) {
      const w = lookup(workerId);
      if (w === undefined) {
        log.info({ workerId, reason }, "shutdown: no such worker");
        return;
      }
      shutdownWorker(w, reason);
    },
    quota,
    capacityBlocked,
    createsBlocked,
    subscribe(fn) {
      listeners.add(fn);
      return () => listeners.delete(fn);
    },
    async settled() {
      while (inflight.size > 0) await Promise.allSettled([...inflight]);
    },
  };
}

/** A listed instance whose type tag names no configured type: kept (and drained) under a bare type. */
function unconfiguredType(name: string, providerType: string): InstanceType {
  return {
    name: name === "" ? `(unknown ${providerType})` : name,
    providerType,
    vcpus: 0,
    ram: 0,
    includedScratch: 0,
    addedScratch: 0,
    scratch: 0,
    price: 0,
    preemptible: false,
    gpu: null,
  };
}

/** cloud.spotInterruptionCheckInterval for the start document: 0 (never), else within crunch-run's bounds. */
export function spotCheckIntervalMs(ms: number): number {
  if (ms <= 0) return 0;
  return Math.min(SPOT_CHECK_MS.max, Math.max(SPOT_CHECK_MS.min, Math.round(ms)));
}
