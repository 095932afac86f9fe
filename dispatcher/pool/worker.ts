/**
 * One instance of the pool and its behaviour (Arvados: worker/worker.go): its state and idle behaviour, the
 * result of each probe (boot, runner deployment, `--list`), its runners (remote-runner.ts), why it is broken, and
 * its own shutdown rules (dispatcher/README.md "Instance states"). What it needs of the fleet comes through a
 * WorkerContext; the pool (pool.ts) creates, lists and forgets workers, and decides what they are for.
 */
import type { Instance, InstanceType } from "../../cloud-drivers/types.ts";
import type { Executor } from "../../lib/executor.ts";
import type { Permit } from "../../lib/limits.ts";
import type { Logger } from "../../lib/logger.ts";
import { formatDuration } from "../../lib/units.ts";
import type { Bundle } from "../../store/types.ts";
import type { IdleBehavior, WorkerState, WorkerView } from "../types.ts";
import { instanceTags } from "./bootstrap.ts";
import type { WorkerContext } from "./context.ts";
import type { BootOutcome } from "./metrics.ts";
import { type ProbeResult, probeBooting, probeFailure, probeList } from "./probe.ts";
import { RemoteRunner, reconcileRunners, sendKill } from "./remote-runner.ts";

export type { WorkerContext } from "./context.ts";

import type { ListedRunners } from "../../lib/runner-protocol.ts";

/** Probes in a row in which the runner cannot run before the instance is shut down as broken. */
export const RUNNER_FAILURE_TRIES = 3;

const NO_CACHED: readonly string[] = Object.freeze([]);

/** Whether two lists of cache keys are the same, in the same order. */
function sameKeys(a: readonly string[], b: readonly string[]): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

export const BOOTING: ReadonlySet<WorkerState> = new Set(["unknown", "booting"]);
export const BOOTED: ReadonlySet<WorkerState> = new Set(["idle", "running"]);

export class Worker implements WorkerView {
  id: string;
  instance: Instance | null;
  instanceType: InstanceType;
  state: WorkerState;
  idleBehavior: IdleBehavior;
  placeholder: boolean;
  readonly runners = new Map<string, RemoteRunner>();
  /** When the `--list` of the last successful probe was sent. */
  probedAt: number | null = null;
  stateSince: number;
  lastBusy: number;
  /** The InstanceSecret tag: what the executor checks on connect. */
  readonly secret: string;
  /** Created by this pool (boot metrics and outcomes are only counted for these). */
  readonly created: boolean;
  /** The create call's time, or when this pool first listed the instance. */
  readonly since: number;
  /** The `creating-<n>` id this worker had before its create call returned (null if it never had one). */
  placeholderId: string | null = null;
  /** Order in which the pool learned the instance's id (sync forgets only instances known before its list). */
  knownSeq = 0;
  /** A cloud list has shown it (instances found by a list are born listed). */
  listedOnce = false;
  /** When a list first left out this created instance (it is kept for LIST_GRACE_MS); null otherwise. */
  unlistedSince: number | null = null;
  listBroken = false;
  /** `--list` said preempted (a spot interruption notice arrived on the instance). */
  preempted = false;
  /** The warm spare supervisor's socket from the last `--list`, if one waited. */
  spareSocket: string | null = null;
  /** The last `--list`'s cache keys (WorkerView.cachedManifests): a new array only when the list changed. */
  cachedManifests: readonly string[] = NO_CACHED;
  /** Why the last `--list`'s cache line was (partly) ignored, logged when it changes. */
  private cacheProblem: string | null = null;
  secretMismatch = false;
  deployFailed = false;
  /** Probes in a row in which the runner, in place, could not run (`--version`/`--list`), and the last reason. */
  runnerFailures = 0;
  runnerFailure: string | null = null;
  /** Bundles of this (preempted) instance being requeued because their runner left without reporting it. */
  readonly losing = new Set<string>();
  /** The runner binary was found or put in place by this pool. */
  runnerPresent = false;
  bootDone = false;
  sshSeen = false;
  lastProbeError: string | null = null;
  shutdownReason: string | null = null;
  lastDestroyAt: number | null = null;
  destroying = false;
  private exec: Executor | null = null;
  /** Probes and starts run one after another on a worker. */
  private chain: Promise<void> = Promise.resolve();
  private logger: { id: string; log: Logger } | null = null;

  constructor(
    readonly ctx: WorkerContext,
    init: {
      id: string;
      instance: Instance | null;
      instanceType: InstanceType;
      state: WorkerState;
      idleBehavior: IdleBehavior;
      secret: string;
      created: boolean;
      now: number;
      parentLogger: Logger;
    },
  ) {
    this.id = init.id;
    this.instance = init.instance;
    this.placeholder = init.instance === null;
    this.instanceType = init.instanceType;
    this.state = init.state;
    this.idleBehavior = init.idleBehavior;
    this.secret = init.secret;
    this.created = init.created;
    this.since = init.now;
    this.stateSince = init.now;
    this.lastBusy = init.now;
    this.parentLogger = init.parentLogger;
  }

  private readonly parentLogger: Logger;

  // --- what others read -----------------------------------------------------------------------------------

  pricePerHour(now: number): number {
    const history = this.instance?.priceHistory?.(this.instanceType) ?? [];
    let price = this.instanceType.price;
    let from = Number.NEGATIVE_INFINITY;
    for (const p of history) {
      if (p.startTime <= now && p.startTime >= from) {
        price = p.price;
        from = p.startTime;
      }
    }
    return price;
  }

  get address(): string {
    return this.instance?.address ?? "";
  }

  get broken(): boolean {
    return this.listBroken || this.secretMismatch || this.deployFailed || this.preempted;
  }

  /** Why it gets no bundles or is going away, for people (WorkerView.problem). */
  get problem(): string | null {
    if (this.shutdownReason !== null) return this.shutdownReason;
    if (this.secretMismatch) return "secret mismatch: not our instance";
    if (this.runnerFailure !== null) return `the runner cannot run: ${this.runnerFailure}`;
    if (this.deployFailed) return `runner deployment failed: ${this.lastProbeError ?? "unknown error"}`;
    if (this.preempted) return "preempted (spot interruption notice)";
    if (this.listBroken) return "crunch-run reports the instance broken";
    return null;
  }

  /** Shut down, or no longer in the pool (forgotten). */
  get gone(): boolean {
    return this.state === "shutdown" || !this.ctx.holds(this);
  }

  /** May take new bundles now. */
  get acceptsBundles(): boolean {
    return !this.placeholder && BOOTED.has(this.state) && this.idleBehavior === "run" && !this.broken;
  }

  /** A child logger naming the instance (renewed when a placeholder gets its real id). */
  get log(): Logger {
    if (this.logger?.id !== this.id) {
      this.logger = { id: this.id, log: this.parentLogger.child({ instanceId: this.id }) };
    }
    return this.logger.log;
  }

  // --- plumbing -------------------------------------------------------------------------------------------

  /** Runs `fn` after the worker's probes and starts before it. */
  exclusive(fn: () => Promise<void>): Promise<void> {
    const run = this.chain.then(fn);
    this.chain = run.then(
      () => {},
      () => {},
    );
    return run;
  }

  executor(): Executor {
    if (this.exec === null) {
      if (this.instance === null) throw new Error(`no instance for ${this.id} yet`);
      this.exec = this.ctx.connect(this.instance, this.secret);
    }
    return this.exec;
  }

  closeExecutor(): void {
    const exec = this.exec;
    this.exec = null;
    if (exec !== null) this.ctx.track(exec.close(), "closing the executor", this.log);
  }

  setState(state: WorkerState): void {
    if (this.state === state) return;
    const from = this.state;
    this.state = state;
    this.stateSince = this.ctx.clock.now();
    this.log.info({ from, to: state }, "instance state changed");
    this.ctx.emit({ type: "worker:state", workerId: this.id, state });
  }

  /** idle <-> running by whether any runner is on it (for booted workers only). */
  settleBusy(): void {
    if (!BOOTED.has(this.state)) return;
    const busy = this.runners.size > 0;
    const now = this.ctx.clock.now();
    if (busy || this.state === "running") this.lastBusy = now;
    this.setState(busy ? "running" : "idle");
  }

  private bootOutcome(outcome: BootOutcome): void {
    if (!this.created || this.bootDone) return;
    this.bootDone = true;
    this.ctx.metrics.bootOutcome(outcome);
  }

  // --- tags and idle behaviour ----------------------------------------------------------------------------

  async writeTags(): Promise<void> {
    if (this.instance === null) return;
    await this.instance.setTags(
      instanceTags(this.ctx.config, this.instanceType.name, this.idleBehavior, this.secret),
    );
  }

  changeBehavior(behavior: IdleBehavior, reason: string): void {
    if (this.idleBehavior === behavior) return;
    this.log.info({ from: this.idleBehavior, to: behavior, reason }, "idle behaviour changed");
    // An instance released from hold gets a whole timeoutIdle to take work, rather than being shut down at
    // once for the time it spent held.
    if (this.idleBehavior === "hold" && behavior === "run") this.lastBusy = this.ctx.clock.now();
    this.idleBehavior = behavior;
    this.ctx.emit({ type: "worker:state", workerId: this.id, state: this.state });
  }

  /** Internal drains (broken, stale lock, kill given up, type no longer configured): tags in the background. */
  drain(reason: string): void {
    if (this.idleBehavior !== "run") return;
    this.changeBehavior("drain", reason);
    if (!this.placeholder) this.ctx.track(this.writeTags(), "writing tags", this.log);
  }

  // --- shutdown -------------------------------------------------------------------------------------------

  destroy(): void {
    const inst = this.instance;
    if (inst === null) return;
    this.destroying = true;
    this.lastDestroyAt = this.ctx.clock.now();
    this.ctx.track(
      inst
        .destroy()
        .catch((err: unknown) => this.log.warn({ err }, "destroy failed (retried while still listed)"))
        .finally(() => {
          this.destroying = false;
        }),
      "destroy",
      this.log,
    );
  }

  shutdown(reason: string, outcome: BootOutcome = "aborted"): void {
    if (this.state === "shutdown") return;
    if (BOOTING.has(this.state)) this.bootOutcome(outcome);
    this.shutdownReason = reason;
    this.log.info({ reason, state: this.state, instanceType: this.instanceType.name }, "shutting down");
    this.setState("shutdown");
    this.closeExecutor();
    // A placeholder is destroyed as soon as its create call returns.
    this.destroy();
  }

  /** The shutdown rules (ARVADOS-FACTS.md §4) and kill repeats, at `now`. */
  applyRules(now: number): void {
    if (this.placeholder || this.state === "shutdown") return;
    const cloud = this.ctx.config.cloud;
    for (const r of this.runners.values()) {
      if (r.repeatKill(now)) this.drain(`runner ${r.uuid} did not stop within timeoutTerm`);
    }
    for (const r of this.runners.values()) {
      if (r.staleSince !== null && now - r.staleSince > cloud.timeoutStaleRunLock) {
        this.drain(`runner ${r.uuid} has held a stale lock for ${formatDuration(now - r.staleSince)}`);
      }
    }
    // The cloud is taking it away anyway: not even a hold keeps it once nothing runs on it.
    if (this.preempted && this.state === "idle") {
      this.shutdown("preempted (spot interruption notice)");
      return;
    }
    if (this.idleBehavior === "hold") return;
    if (BOOTING.has(this.state)) {
      if (this.state === "booting" && this.idleBehavior === "drain") {
        this.shutdown("drained while booting");
      } else if (now - this.since >= cloud.timeoutBooting) {
        this.shutdown(`not ready after timeoutBooting (${formatDuration(cloud.timeoutBooting)})`, "failure");
      }
      return;
    }
    const lastOk = this.probedAt ?? this.stateSince;
    if (now - lastOk >= cloud.timeoutProbe) {
      this.shutdown(`no successful probe for ${formatDuration(now - lastOk)} (timeoutProbe)`);
    } else if (this.state === "idle" && this.idleBehavior === "drain") {
      this.shutdown("drained");
    } else if (this.state === "idle" && now - this.lastBusy >= cloud.timeoutIdle) {
      this.shutdown(`idle for ${formatDuration(now - this.lastBusy)} (timeoutIdle)`);
    }
  }

  // --- probes ---------------------------------------------------------------------------------------------

  /**
   * One probe (in the worker's chain): the boot probe and deployment while booting, else `--list`. The
   * connection is opened first (the executor paces handshakes), then the probe's commands run in a slot of
   * `slots` (the pool's maxConcurrentProbes), if given.
   */
  probe(slots?: { acquire(): Promise<Permit> }): Promise<void> {
    return this.exclusive(async () => {
      if (this.gone) return;
      let result: ProbeResult;
      let booting = BOOTING.has(this.state);
      let permit: Permit | null = null;
      try {
        const exec = this.executor();
        if (exec.connect !== undefined) {
          try {
            await exec.connect();
          } catch (err) {
            result = probeFailure(err, false);
            this.applyProbe(booting, result);
            return;
          }
          if (this.gone) return;
        }
        permit = (await slots?.acquire()) ?? null;
        if (this.gone) return;
        booting = BOOTING.has(this.state);
        const target = {
          exec,
          cmds: this.ctx.cmds,
          runner: this.ctx.runner,
          bootProbeCommand: this.ctx.config.cloud.bootProbeCommand,
          spareSocket: this.spareSocket,
          now: () => this.ctx.clock.now(),
        };
        result = booting
          ? await probeBooting(target, {
              unknown: this.state === "unknown",
              runnerPresent: this.runnerPresent,
            })
          : await probeList(target);
      } catch (err) {
        result = { ok: false, stage: "connect", message: String(err), answered: false, mismatch: false };
      } finally {
        permit?.release();
      }
      this.applyProbe(booting, result);
    });
  }

  private applyProbe(booting: boolean, r: ProbeResult): void {
    if (this.gone) return;
    const { clock, metrics } = this.ctx;
    const now = clock.now();
    if ((r.ok || r.answered) && !this.sshSeen) {
      this.sshSeen = true;
      if (this.created) metrics.timeToSsh(now - this.since);
    }
    if (!r.ok) {
      this.lastProbeError = r.message;
      if (r.mismatch) {
        this.secretMismatch = true;
        this.log.error(
          { address: this.address },
          "instance failed the identity check: it never gets a token",
        );
        this.shutdown("secret mismatch", "failure");
        return;
      }
      if (r.stage === "runner") {
        this.runnerCannotRun(r.message);
        if (this.gone) return;
      } else if (r.stage === "deploy") {
        this.deployFailed = true;
        this.log.warn({ reason: r.message }, "runner deployment failed");
      } else if (booting) {
        this.log.debug({ stage: r.stage, reason: r.message }, "not ready yet");
      } else {
        this.log.warn({ stage: r.stage, reason: r.message }, "probe failed");
      }
      this.applyRules(now);
      return;
    }
    this.lastProbeError = null;
    this.deployFailed = false;
    this.runnerFailures = 0;
    this.runnerFailure = null;
    if (r.booted) this.runnerPresent = true;
    if (r.deployed) this.log.info({ sha256: this.ctx.runner.sha256 }, "runner deployed");
    this.probedAt = r.listSentAt;
    this.applyList(r.listed, now);
    if (booting) {
      if (this.created && !this.bootDone) metrics.timeToReady(now - this.since);
      this.bootOutcome("success");
      this.ctx.ready(this);
      this.lastBusy = now;
      this.setState(this.runners.size > 0 ? "running" : "idle");
      this.log.info({ runners: this.runners.size }, "instance ready");
    } else {
      this.settleBusy();
    }
    this.applyRules(now);
  }

  /**
   * The runner is in place but cannot run here (it exits non-zero or prints what is not its grammar): no bundle
   * could ever start. After RUNNER_FAILURE_TRIES probes in a row the instance is shut down with the runner's own
   * words, and the pool makes creates wait (ctx.runnerFailed).
   */
  private runnerCannotRun(message: string): void {
    this.runnerFailures++;
    this.runnerFailure = message;
    this.log.warn(
      { reason: message, try: this.runnerFailures, of: RUNNER_FAILURE_TRIES },
      "the runner cannot run on this instance",
    );
    if (this.runnerFailures < RUNNER_FAILURE_TRIES) return;
    this.shutdown(`the runner cannot run: ${message}`, "failure");
    if (this.created) this.ctx.runnerFailed(this, message);
  }

  /** A runner `--list` showed whose bundle the queue has back in `staged`: it is on its way out. */
  requeuedButListed(): boolean {
    const queue = this.ctx.queue;
    if (queue === undefined) return false;
    for (const r of this.runners.values()) {
      if (r.state !== "starting" && queue.get(r.uuid)?.state === "staged") return true;
    }
    return false;
  }

  learnSpareSocket(socket: string | null): void {
    if (socket === null || this.spareSocket === socket) return;
    this.spareSocket = socket;
    this.log.debug({ socket }, "warm pool named by --detach");
  }

  /** What `--list` said of the instance (broken, preempted, a spare) and of its runners (remote-runner.ts). */
  private applyList(listed: ListedRunners, now: number): void {
    if (listed.unknown.length > 0) this.log.warn({ lines: listed.unknown }, "unexpected lines from --list");
    this.spareSocket = listed.spare;
    if (!sameKeys(this.cachedManifests, listed.cachedManifests)) {
      this.cachedManifests = listed.cachedManifests.length === 0 ? NO_CACHED : listed.cachedManifests;
    }
    if (listed.cacheProblem !== this.cacheProblem) {
      this.cacheProblem = listed.cacheProblem;
      if (listed.cacheProblem !== null)
        this.log.warn({ reason: listed.cacheProblem }, "odd cache line from --list");
    }
    if (listed.broken && !this.listBroken) {
      this.listBroken = true;
      this.log.warn("crunch-run reports the instance broken");
      this.drain("crunch-run reports the instance broken");
    }
    if (listed.preempted && !this.preempted) {
      // No new bundles (broken), drained, shut down as soon as nothing runs on it (applyRules).
      this.preempted = true;
      this.ctx.metrics.preempted(this.instanceType.name);
      this.log.warn(
        { runners: listed.runners.size },
        "spot interruption notice on the instance: draining it",
      );
      this.drain("spot interruption notice (preempted)");
    }
    reconcileRunners(this, listed.runners, now);
  }

  // --- runners --------------------------------------------------------------------------------------------

  /**
   * Records a `starting` runner at once, then starts it (beside probes and other starts). Throws if it cannot.
   * `placement`: why the scheduler chose this instance (its cache), for the start's log line.
   */
  startRunner(bundle: Bundle, gpuDevices: readonly number[], placement?: string): void {
    if (!this.acceptsBundles) {
      throw new Error(
        `startBundle: worker ${this.id} cannot take bundles (state ${this.state}, idle behaviour ${this.idleBehavior}` +
          `${this.broken ? ", broken" : ""})`,
      );
    }
    if (this.runners.has(bundle.uuid))
      throw new Error(`startBundle: ${bundle.uuid} is already on ${this.id}`);
    const r = new RemoteRunner(this, bundle.uuid, {
      state: "starting",
      gpuDevices: [...gpuDevices],
      now: this.ctx.clock.now(),
      detached: false,
      ...(placement === undefined ? {} : { placement }),
    });
    this.runners.set(bundle.uuid, r);
    this.settleBusy();
    // A start waits neither for the probe in flight nor for other starts, and no probe waits for it: starts
    // happen only on booted instances, whose probes are a `--list` (a new process on the instance, hundreds of
    // ms on a busy one), and in a burst one start's hand-off overlaps the next one's claim. A `--list` that runs
    // meanwhile and misses the new runner leaves it alone (reconcileRunners keeps a starting runner while its
    // start is under way, and then while the queue has it starting here).
    this.ctx.track(r.start(bundle), "starting a runner", this.log);
  }

  /** TERM to the runner (known or not), repeated until it is gone (applyRules); then drained if it outlives it. */
  killRunner(uuid: string, reason: string): void {
    const r = this.runners.get(uuid);
    if (r !== undefined) {
      r.kill(reason);
      return;
    }
    this.log.info({ uuid, reason }, "killing a runner (TERM)");
    sendKill(this, uuid);
  }
}
