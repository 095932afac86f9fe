/**
 * The WorkerPool (dispatcher/README.md "Instance states"), fleet-wide (Arvados: worker/pool.go): the instances
 * of this dispatcher from the create call to their disappearance from the cloud's list. It creates instances
 * (placeholders at once, the cloud call in the background) within what create-gate.ts allows, lists the cloud
 * (sync: new instances found, disappeared ones forgotten, shut-down ones destroyed again), runs the probe and
 * rule loops, and hands each request about one instance to its Worker (worker.ts), which probes, starts and
 * kills runners (remote-runner.ts) and applies its own shutdown rules. Bundle transitions go through the
 * dispatcher's one owner of them (queue/transitions.ts).
 */
import type { Registry } from "prom-client";
import { cloudErrorCode } from "../../cloud-drivers/errors.ts";
import { type Instance, type InstanceSet, type InstanceType, TAG } from "../../cloud-drivers/types.ts";
import type { Config } from "../../config/schema.ts";
import type { Clock } from "../../lib/clock.ts";
import type { Executor } from "../../lib/executor.ts";
import type { Logger } from "../../lib/logger.ts";
import { formatDuration } from "../../lib/units.ts";
import type { Db } from "../../store/db.ts";
import type { Bundle } from "../../store/types.ts";
import { type BundleTransitions, createBundleTransitions } from "../queue/transitions.ts";
import { chargePerHour } from "../scheduler/eligible.ts";
import type { CreateRefusal, CreateResult, PoolEvent, QueueView, WorkerView } from "../types.ts";
import {
  IDLE_BEHAVIORS,
  type IdleBehavior,
  initScript,
  instanceTags,
  newInstanceSecret,
} from "./bootstrap.ts";
import { type CreateGate, createCreateGate } from "./create-gate.ts";
import { createPoolMetrics } from "./metrics.ts";
import { createProbeScheduler } from "./probes.ts";
import { runnerCommands } from "./runner-commands.ts";
import { BOOTING, Worker, type WorkerContext } from "./worker.ts";

export type { PoolEvent } from "../types.ts";
export { CAPACITY_BLOCK_MS, QUOTA_BLOCK_MS, RUNNER_BLOCK_MAX_MS, RUNNER_BLOCK_MS } from "./create-gate.ts";
export { IMMEDIATE_PROBE_MS, PROBE_COUNTS_FOR_MS } from "./probes.ts";
export { spotCheckIntervalMs } from "./remote-runner.ts";
export { RUNNER_FAILURE_TRIES } from "./worker.ts";

/** How long an instance this pool created may be missing from the cloud's lists before it counts as gone. */
export const LIST_GRACE_MS = 5 * 60_000;

export interface WorkerPoolOptions {
  config: Config;
  instanceSet: InstanceSet;
  instanceTypes: readonly InstanceType[];
  db: Db;
  clock: Clock;
  logger: Logger;
  registry: Registry;
  /** The queue the pool reads, and where the rows its transitions return are applied. */
  queue?: QueueView;
  /** The dispatcher's owner of bundle transitions; default one over `db` that applies rows to `queue`. */
  transitions?: BundleTransitions;
  /** Opens an executor that proves `expectedSecret` on connect (the real SSH executor, or the stub's). */
  connect(instance: Instance, expectedSecret: string): Executor;
  /** What to deploy as crunch-run. */
  runner: { content: Buffer; sha256: string };
  /** REST server URL put in the start document. */
  runnerApiUrl: string;
  /**
   * A REST server in this process waits for the claims in flight (`serve`): a warm pool then gets its start
   * document as the claim leaves (WorkerContext.handOffWithClaim). Default false: once the claim is back.
   */
  handOffWithClaim?: boolean;
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
  /**
   * Probes every due worker (within maxProbesPerSecond and maxConcurrentProbes), then applies the shutdown rules
   * and kill repeats.
   */
  probeOnce(): Promise<void>;
  workers(): readonly WorkerView[];
  /** A worker by id; a placeholder's old id still finds the instance it became. */
  worker(id: string): WorkerView | undefined;
  /** A placeholder at once; the cloud call runs in the background. */
  create(type: InstanceType): CreateResult;
  /**
   * Records a `starting` runner on the worker at once; then: the bundle claimed (staged -> starting, a new runner
   * token), the start document handed to the spare or `R --detach <uuid>`. A lost claim drops the runner; a failed
   * start requeues the bundle (event runner:start_failed). Throws if the worker cannot take bundles.
   */
  startBundle(workerId: string, bundle: Bundle, gpuDevices: number[], placement?: string): void;
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
  /** Rate limit, max concurrent creates or the runner back-off, for status sentences. */
  createsBlocked(): CreateRefusal | null;
  subscribe(fn: (event: PoolEvent) => void): () => void;
  /** Resolves when no background operation is in flight (tests). */
  settled(): Promise<void>;
}

export function createWorkerPool(opts: WorkerPoolOptions): WorkerPool {
  const { config, instanceSet, clock, queue, runner } = opts;
  const cloud = config.cloud;
  const log = opts.logger.child({ component: "pool" });
  const prefix = cloud.tagKeyPrefix;
  const types = new Map(opts.instanceTypes.map((t) => [t.name, t]));
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
  let placeholderSeq = 0;
  let knownSeq = 0;
  let loops: AbortController | null = null;

  const metrics = createPoolMetrics(opts.registry, opts.instanceTypes, function* () {
    for (const w of workers.values()) yield { state: w.state, instanceType: w.instanceType.name };
  });

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

  const gate: CreateGate = createCreateGate({
    config,
    clock,
    logger: log,
    instanceSet,
    fleet: {
      all: () => workers.size,
      real: () => {
        let n = 0;
        for (const w of workers.values()) if (!w.placeholder) n++;
        return n;
      },
    },
  });

  const ctx: WorkerContext = {
    config,
    clock,
    metrics,
    queue,
    transitions: opts.transitions ?? createBundleTransitions({ db: opts.db, queue, logger: opts.logger }),
    chargePerHour: chargePerHour(config),
    runner,
    cmds: runnerCommands(cloud.deployRunnerDirectory, runner.sha256),
    runnerApiUrl: opts.runnerApiUrl,
    handOffWithClaim: opts.handOffWithClaim ?? false,
    connect: opts.connect,
    emit,
    track,
    holds: (w) => workers.get(w.id) === w,
    runnerFailed: (_w, message) => gate.runnerFailed(message),
    ready: (w) => gate.instanceReady(w.log),
  };

  const probes = createProbeScheduler({ config, clock, track: (p, w) => track(p, "probe", w.log) });

  function newWorker(init: Omit<ConstructorParameters<typeof Worker>[1], "parentLogger">): Worker {
    return new Worker(ctx, { ...init, parentLogger: log });
  }

  function lookup(id: string): Worker | undefined {
    return workers.get(id) ?? workers.get(replaced.get(id) ?? "");
  }

  function mustGet(id: string, what: string): Worker {
    const w = lookup(id);
    if (w === undefined) throw new Error(`${what}: the pool has no worker ${id}`);
    return w;
  }

  // --- creating -------------------------------------------------------------------------------------------

  function create(type: InstanceType): CreateResult {
    const refusal = gate.refusalFor(type);
    if (refusal !== null) return { ok: false, refusal };
    const w = newWorker({
      id: `creating-${++placeholderSeq}`,
      instance: null,
      instanceType: type,
      state: "booting",
      idleBehavior: "run",
      secret: newInstanceSecret(),
      created: true,
      now: clock.now(),
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
    gate.callStarted();
    try {
      inst = await instanceSet.create(
        type,
        cloud.imageId,
        instanceTags(config, type.name, behavior, w.secret),
        initScript(w.secret, cloud.instanceInitCommand),
        publicKey,
      );
    } catch (err) {
      gate.callEnded();
      creating.delete(w.secret);
      createFailed(w, err);
      return;
    }
    gate.callEnded();
    creating.delete(w.secret);
    if (w.placeholder) becomeReal(w, inst);
    if (w.state === "shutdown") {
      w.destroy();
      return;
    }
    if (w.idleBehavior !== behavior) await w.writeTags();
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
    const type = w.instanceType;
    const message = err instanceof Error ? err.message : String(err);
    if (w.placeholder) workers.delete(w.id);
    gate.createFailed(type, err, w.log);
    if (w.placeholder) emit({ type: "worker:gone", workerId: w.id, reason: `create failed: ${message}` });
    else w.shutdown(`its create failed after it was listed: ${message}`, "failure");
    emit({ type: "create:error", instanceType: type.name, code: cloudErrorCode(err), message });
  }

  // --- the cloud's list -----------------------------------------------------------------------------------

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
          known.destroy();
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
    gate.quota();
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
    const w = newWorker({
      id: inst.id,
      instance: inst,
      instanceType: configured ?? unconfiguredType(typeName, inst.providerType),
      state: "unknown",
      idleBehavior: behavior,
      secret: inst.tags[prefix + TAG.instanceSecret] ?? "",
      created: false,
      now,
    });
    w.knownSeq = ++knownSeq;
    w.listedOnce = true;
    workers.set(w.id, w);
    w.log.info({ instanceType: typeName, idleBehavior: behavior }, "found an instance");
    emit({ type: "worker:created", workerId: w.id, state: w.state });
    if (configured === undefined)
      w.drain(`instance type ${JSON.stringify(typeName)} is no longer configured`);
  }

  /** Forgets an instance the cloud no longer lists; its runners are reported gone. */
  function forget(w: Worker): void {
    workers.delete(w.id);
    if (w.placeholderId !== null) replaced.delete(w.placeholderId);
    w.closeExecutor();
    const disappeared = w.state !== "shutdown";
    if (disappeared) {
      metrics.disappeared(w.state);
      if (BOOTING.has(w.state) && w.created && !w.bootDone) {
        w.bootDone = true;
        metrics.bootOutcome("disappeared");
      }
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

  function applyAllRules(): void {
    const now = clock.now();
    for (const w of [...workers.values()]) w.applyRules(now);
  }

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
        probes.startDue(workers.values());
        applyAllRules();
      });
    },
    async stop() {
      loops?.abort();
      loops = null;
      for (const w of workers.values()) w.closeExecutor();
    },
    syncOnce,
    async probeOnce() {
      await Promise.all(probes.startDue(workers.values()));
      applyAllRules();
    },
    workers: () => [...workers.values()],
    worker: (id) => lookup(id),
    create,
    startBundle(workerId, bundle, gpuDevices, placement) {
      mustGet(workerId, "startBundle").startRunner(bundle, gpuDevices, placement);
    },
    probeNow(workerId) {
      const w = lookup(workerId);
      if (w !== undefined) probes.probeNow(w);
    },
    killRunner(workerId, uuid, reason) {
      const w = lookup(workerId);
      if (w === undefined || w.placeholder || w.state === "shutdown") {
        log.info({ workerId, uuid, reason }, "kill: the instance is gone or shutting down");
        return;
      }
      w.killRunner(uuid, reason);
    },
    async setIdleBehavior(workerId, behavior) {
      if (!(IDLE_BEHAVIORS as readonly string[]).includes(behavior)) {
        throw new Error(`setIdleBehavior: unknown idle behaviour ${JSON.stringify(behavior)}`);
      }
      const w = mustGet(workerId, "setIdleBehavior");
      w.changeBehavior(behavior, "requested");
      try {
        await w.writeTags();
      } finally {
        w.applyRules(clock.now());
      }
    },
    shutdown(workerId, reason) {
      const w = lookup(workerId);
      if (w === undefined) {
        log.info({ workerId, reason }, "shutdown: no such worker");
        return;
      }
      w.shutdown(reason);
    },
    quota: () => gate.quota(),
    capacityBlocked: (type) => gate.capacityBlocked(type),
    createsBlocked: () => gate.createsBlocked(),
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
