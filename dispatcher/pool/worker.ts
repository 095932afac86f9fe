/**
 * One instance as the pool keeps it: the WorkerView every other part reads, plus the pool's own bookkeeping.
 * Only the pool (pool.ts) changes these fields.
 */
import type { Instance, InstanceType } from "../../cloud-drivers/types.ts";
import type { Logger } from "../../lib/logger.ts";
import type { Executor } from "../sshexec/types.ts";
import type { RunnerView, WorkerState, WorkerView } from "../types.ts";
import type { IdleBehavior } from "./bootstrap.ts";

export interface PoolRunner extends RunnerView {
  state: RunnerView["state"];
  gpuDevices: readonly number[];
  since: number;
  /** When `--list` first showed it stale (null while it is not). */
  staleSince: number | null;
  /** Set by killRunner: when the first TERM went out, when the last one did, and whether we gave up. */
  killing: { since: number; lastSent: number; reason: string; gaveUp: boolean } | null;
  /** When `--detach` returned success (runners found by `--list` count as detached when found). */
  detachedAt: number | null;
}

export class Worker implements WorkerView {
  id: string;
  instance: Instance | null;
  instanceType: InstanceType;
  state: WorkerState;
  idleBehavior: IdleBehavior;
  placeholder: boolean;
  readonly runners = new Map<string, PoolRunner>();
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
  /** An immediate probe was asked for (probeNow) and has not started yet. */
  probeWanted = false;
  /** When the last immediate probe started, and when the current run of them was first asked for. */
  immediateProbeAt = Number.NEGATIVE_INFINITY;
  immediateSince: number | null = null;
  /** The warm spare supervisor's socket from the last `--list`, if one waited. */
  spareSocket: string | null = null;
  secretMismatch = false;
  deployFailed = false;
  /** Probes in a row in which the runner, in place, could not run (`--version`/`--list`), and the last reason. */
  runnerFailures = 0;
  runnerFailure: string | null = null;
  /** The runner binary was found or put in place by this pool. */
  runnerPresent = false;
  bootDone = false;
  sshSeen = false;
  probing = false;
  nextProbeAt = 0;
  lastProbeError: string | null = null;
  shutdownReason: string | null = null;
  lastDestroyAt: number | null = null;
  destroying = false;
  executor: Executor | null = null;
  /** Probes and starts run one after another on a worker. */
  chain: Promise<void> = Promise.resolve();
  private readonly parentLogger: Logger;
  private logger: { id: string; log: Logger } | null = null;

  constructor(init: {
    id: string;
    instance: Instance | null;
    instanceType: InstanceType;
    state: WorkerState;
    idleBehavior: IdleBehavior;
    secret: string;
    created: boolean;
    now: number;
    parentLogger: Logger;
  }) {
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

  /** A child logger naming the instance (renewed when a placeholder gets its real id). */
  get log(): Logger {
    if (this.logger?.id !== this.id) {
      this.logger = { id: this.id, log: this.parentLogger.child({ instanceId: this.id }) };
    }
    return this.logger.log;
  }
}
