/**
 * The stub cloud: an in-process, deterministic (seeded) simulation for scheduler/pool tests and benchmarks.
 * VMs live in a StubCloud, not in an InstanceSet, so instance sets opened over the same StubCloud (say,
 * before and after a dispatcher restart) see the same VMs. Nothing runs on a timer: boot, tag staleness and
 * lingering after destroy are computed from the injected Clock whenever they are looked at.
 * Over 500 lines because it simulates a whole provider (quotas, capacity, rate limits, tag lag, errors on
 * demand) for tests and benchmarks; its VMs are in vm.ts, its knobs in knobs.ts, its shell in executor.ts.
 */
import { createHash } from "node:crypto";
import { EventEmitter } from "node:events";
import type { Clock } from "../../lib/clock.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import type { Logger } from "../../lib/logger.ts";
import { CapacityError, CloudError, CloudQuotaError, CloudRateLimitError } from "../errors.ts";
import { type EmbeddedSshServer, generateKeyPair, startEmbeddedSshServer } from "../ssh-server.ts";
import type { CloudDriver, Instance, InstanceSet, InstanceType, PricePoint, Tags } from "../types.ts";
import { type StubExecHost, StubExecutor } from "./executor.ts";
import type { StubCloudOptions, StubKnobs, VmSelector } from "./knobs.ts";
import { parseStubParameters } from "./params.ts";
import { type StubRunner, StubVm, type StubVmEvents } from "./vm.ts";

export type StubOp = "create" | "list" | "destroy" | "setTags";

export type { StubCapacityErrors, StubCloudOptions, StubKnobs, VmSelector } from "./knobs.ts";

export interface StubCall {
  seq: number;
  op: StubOp;
  instanceSetId: string;
  /** When the call was made, and when it completed (later if held). */
  at: number;
  doneAt: number;
  instanceType?: string;
  instanceId?: string;
  /** "ok" or the error's code. */
  outcome: string;
}

/** Events of the cloud: VM events with the VM first, plus the cloud's own. */
export type StubCloudEvents = { [K in keyof StubVmEvents]: [vm: StubVm, ...StubVmEvents[K]] } & {
  "vm:create": [vm: StubVm];
  "vm:destroy": [vm: StubVm];
  call: [call: StubCall];
  /** A cloud op started waiting because ops are held. */
  "op:held": [op: StubOp];
  "hook:error": [err: unknown];
};

/** mulberry32: a tiny seeded PRNG returning floats in [0, 1). */
export function mulberry32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/**
 * The EC2 rule: the alphabetic prefix of the provider type ("m" for "m5.large", "inf" for "inf2.xlarge"),
 * plus "-spot" for preemptible types.
 */
export function stubQuotaGroup(type: Pick<InstanceType, "providerType" | "preemptible">): string {
  const family = /^[a-z]+/i.exec(type.providerType)?.[0]?.toLowerCase() ?? type.providerType;
  return type.preemptible ? `${family}-spot` : family;
}

const DEFAULT_OPS_HELD: readonly StubOp[] = ["create", "destroy", "setTags"];

export class StubCloud extends EventEmitter<StubCloudEvents> implements StubExecHost {
  readonly clock: Clock;
  readonly seed: number;
  readonly knobs: StubKnobs;
  /** Every VM still known to the cloud (destroyed ones only while they linger). */
  readonly vms = new Map<string, StubVm>();
  /** The most recent calls (see callLogLimit). */
  calls: StubCall[] = [];
  /** Calls by op and outcome, e.g. counts.create.ok, counts.create["cloud.quota"]. */
  readonly counts: Record<StubOp, Record<string, number>> = {
    create: {},
    list: {},
    destroy: {},
    setTags: {},
  };
  private serial = 0;
  private seq = 0;
  private live = 0;
  private allowCreateAt = Number.NEGATIVE_INFINITY;
  private allowListAt = Number.NEGATIVE_INFINITY;
  private readonly rng: Record<"create" | "destroy" | "crash" | "select", () => number>;
  private heldOps = new Set<StubOp>();
  private waiting: Array<() => void> = [];
  private readonly hashes = new WeakMap<Buffer, string>();
  private readonly sshServers = new Set<EmbeddedSshServer>();

  constructor(opts: StubCloudOptions) {
    super();
    const { clock, seed = 1, capacityErrors, ...knobs } = opts;
    this.clock = clock;
    this.seed = seed;
    const seeds = mulberry32(seed);
    const next = () => mulberry32(Math.floor(seeds() * 2 ** 32));
    this.rng = { create: next(), destroy: next(), crash: next(), select: next() };
    this.knobs = {
      errorRateCreate: 0,
      errorRateDestroy: 0,
      quotaMaxInstances: 0,
      minTimeBetweenCreateCalls: 0,
      minTimeBetweenListCalls: 0,
      bootDelay: 0,
      broken: false,
      commandsFail: false,
      neverBoot: false,
      runnerMissing: false,
      runnerFails: null,
      runnerCrashRate: 0,
      runnerDetachDelay: 0,
      runnersIgnoreTerm: false,
      staleTagsFor: 0,
      destroyedVmsLinger: 0,
      bootProbeCommand: "true",
      onRunnerStart: null,
      callLogLimit: 100_000,
      priceHistory: null,
      ...knobs,
      capacityErrors: {
        instanceTypes: capacityErrors?.instanceTypes ?? new Set(),
        quotaGroups: capacityErrors?.quotaGroups ?? new Set(),
        all: capacityErrors?.all ?? false,
      },
    };
  }

  /** An InstanceSet over this cloud (what stubDriver returns). */
  instanceSet(instanceSetId: string): InstanceSet {
    return new StubInstanceSet(this, instanceSetId);
  }

  vm(id: string): StubVm | undefined {
    return this.vms.get(id);
  }

  /** VMs not destroyed. */
  liveVms(): StubVm[] {
    return [...this.vms.values()].filter((vm) => !vm.destroyed);
  }

  /** Number of VMs not destroyed (what the quota counts). */
  get liveCount(): number {
    return this.live;
  }

  /** Every runner on every known VM, optionally only those in one state. */
  runners(state?: StubRunner["state"]): Array<{ vm: StubVm; runner: StubRunner }> {
    const out: Array<{ vm: StubVm; runner: StubRunner }> = [];
    for (const vm of this.vms.values()) {
      for (const runner of vm.runners.values()) {
        if (state === undefined || runner.state === state) out.push({ vm, runner });
      }
    }
    return out;
  }

  /**
   * An Executor that runs commands on the instance's stub VM. With `expectedSecret`, it proves the VM's
   * identity on its first connection as the SSH executor does: no secret file yet -> ssh.not_ready (try
   * again later); a different secret -> ssh.host_mismatch, and every later command is refused too.
   */
  executorFor(instance: Pick<Instance, "id"> | string, opts: { expectedSecret?: string } = {}): StubExecutor {
    return new StubExecutor(this, typeof instance === "string" ? instance : instance.id, opts.expectedSecret);
  }

  quotaGroup(type: InstanceType): string {
    return stubQuotaGroup(type);
  }

  /**
   * Serves the VM's stub executor through a real (embedded ssh2) SSH server on 127.0.0.1, accepting the
   * public key the VM was created with, and sets the VM's address to it, so the real SSH executor can run
   * commands on a stub VM. A command to a VM that is not up exits 255 with the reason on stderr.
   * `close()` stops every server started this way. `streamLocalUnder`: channels to unix sockets under it are
   * allowed (a warm pool's socket, which a bench serves).
   */
  async startSshServer(
    vm: StubVm | string,
    opts: { logger?: Logger; streamLocalUnder?: string } = {},
  ): Promise<EmbeddedSshServer> {
    const target = typeof vm === "string" ? this.vms.get(vm) : vm;
    if (target === undefined) throw new Error(`stub cloud has no VM ${String(vm)}`);
    const exec = this.executorFor(target.id);
    const server = await startEmbeddedSshServer({
      host: "127.0.0.1",
      port: 0,
      hostKey: generateKeyPair().privateKey,
      authorizedKeys: [target.publicKey],
      ...(opts.logger === undefined ? {} : { logger: opts.logger }),
      ...(opts.streamLocalUnder === undefined ? {} : { streamLocalUnder: opts.streamLocalUnder }),
      onExec: async (command, session) => {
        try {
          const res = await exec.execute(command, { stdin: session.stdin });
          session.stdout.write(res.stdout);
          session.stderr.write(res.stderr);
          return { exitCode: res.exitCode };
        } catch (err) {
          session.stderr.write(`${(err as Error).message}\n`);
          return { exitCode: 255 };
        }
      },
    });
    this.sshServers.add(server);
    target.address = `${server.host}:${server.port}`;
    return server;
  }

  /** Stops the SSH servers startSshServer started. */
  async close(): Promise<void> {
    const servers = [...this.sshServers];
    this.sshServers.clear();
    await Promise.all(servers.map((s) => s.close()));
  }

  /** From now on, `ops` calls wait until released. */
  holdCloudOps(ops: readonly StubOp[] = DEFAULT_OPS_HELD): void {
    this.heldOps = new Set(ops);
  }

  /** Lets `n` waiting calls proceed (oldest first) and keeps holding; without `n`, stops holding altogether. */
  releaseCloudOps(n?: number): void {
    if (n === undefined) this.heldOps = new Set();
    const release = this.waiting.splice(0, n ?? this.waiting.length);
    for (const resume of release) resume();
  }

  /** Calls waiting because ops are held. */
  get pendingOps(): number {
    return this.waiting.length;
  }

  // --- StubExecHost ---

  runnerCrashes(): boolean {
    return this.rng.crash() < this.knobs.runnerCrashRate;
  }

  runnerStarted(vm: StubVm, uuid: string, doc: unknown): void {
    const hook = this.knobs.onRunnerStart;
    if (hook === null) return;
    try {
      const result = hook(vm, uuid, doc);
      if (result instanceof Promise) result.catch((err: unknown) => this.emit("hook:error", err));
    } catch (err) {
      this.emit("hook:error", err);
    }
  }

  sha256(data: Buffer): string {
    let hash = this.hashes.get(data);
    if (hash === undefined) {
      hash = createHash("sha256").update(data).digest("hex");
      this.hashes.set(data, hash);
    }
    return hash;
  }

  // --- Cloud operations (called by StubInstanceSet) ---

  async create(
    setId: string,
    type: InstanceType,
    imageId: string,
    tags: Tags,
    initCommand: string,
    publicKey: string,
  ): Promise<StubVm> {
    return this.call("create", setId, { instanceType: type.name }, () => {
      const fails = this.rng.create() < this.knobs.errorRateCreate;
      const now = this.clock.now();
      if (now < this.allowCreateAt) {
        throw new CloudRateLimitError("stub: create rate limit exceeded", {
          earliestRetry: this.allowCreateAt,
        });
      }
      this.allowCreateAt = now + this.knobs.minTimeBetweenCreateCalls;
      const capacity = this.capacityError(type);
      if (capacity !== undefined) throw capacity;
      const quota = this.knobs.quotaMaxInstances;
      if (quota > 0 && this.live >= quota) {
        throw new CloudQuotaError(`stub: instance quota of ${quota} reached`);
      }
      if (fails) throw new CloudError("stub: create failed (errorRateCreate)");
      const serial = ++this.serial;
      const vm = new StubVm({
        id: `stub-vm-${serial}`,
        serial,
        address: `stub-${serial}`,
        providerType: type.providerType,
        instanceType: type.name,
        imageId,
        tags,
        initCommand,
        publicKey,
        createdAt: now,
        clock: this.clock,
        forward: (event, v, args) =>
          (this.emit as (e: string, ...a: unknown[]) => boolean)(event, v, ...args),
      });
      const delay = this.knobs.bootDelay;
      vm.bootAt = now + (typeof delay === "function" ? delay(vm) : delay);
      vm.broken = this.select(this.knobs.broken, vm);
      vm.commandsFail = this.select(this.knobs.commandsFail, vm);
      vm.neverBoot = this.select(this.knobs.neverBoot, vm);
      vm.runnerMissing = this.select(this.knobs.runnerMissing, vm);
      const runnerFails = this.knobs.runnerFails;
      vm.runnerFails = runnerFails !== null && this.select(runnerFails.on, vm) ? runnerFails.message : null;
      this.vms.set(vm.id, vm);
      this.live++;
      this.emit("vm:create", vm);
      return vm;
    });
  }

  async list(setId: string, filter: Tags): Promise<Instance[]> {
    return this.call("list", setId, {}, () => {
      const now = this.clock.now();
      if (now < this.allowListAt) {
        throw new CloudRateLimitError("stub: list rate limit exceeded", { earliestRetry: this.allowListAt });
      }
      this.allowListAt = now + this.knobs.minTimeBetweenListCalls;
      const keys = Object.entries(filter);
      const out: Instance[] = [];
      for (const vm of this.vms.values()) {
        if (vm.destroyedAt !== null && now >= vm.destroyedAt + this.knobs.destroyedVmsLinger) {
          this.vms.delete(vm.id);
          continue;
        }
        const tags = this.visibleTags(vm, now);
        if (keys.every(([k, v]) => tags[k] === v)) out.push(new StubInstance(this, setId, vm, tags));
      }
      return out;
    });
  }

  async destroy(setId: string, id: string): Promise<void> {
    return this.call("destroy", setId, { instanceId: id }, () => {
      const fails = this.rng.destroy() < this.knobs.errorRateDestroy;
      const vm = this.vms.get(id);
      if (vm === undefined || vm.destroyed) return;
      if (fails) throw new CloudError(`stub: destroy of ${id} failed (errorRateDestroy)`);
      vm.destroyedAt = this.clock.now();
      this.live--;
      for (const runner of vm.runners.values()) {
        if (runner.state !== "exited") vm.endRunner(runner.uuid, null, "KILL");
      }
      if (this.knobs.destroyedVmsLinger <= 0) this.vms.delete(id);
      this.emit("vm:destroy", vm);
    });
  }

  async setTags(setId: string, id: string, tags: Tags): Promise<void> {
    return this.call("setTags", setId, { instanceId: id }, () => {
      const vm = this.vms.get(id);
      if (vm === undefined || vm.destroyed) {
        throw new DispatchCloudError("cloud.instance_gone", `stub: instance ${id} no longer exists`);
      }
      const now = this.clock.now();
      vm.previousTags = this.visibleTags(vm, now);
      vm.tagsSetAt = now;
      vm.tags = Object.freeze({ ...tags });
    });
  }

  /** The tags instances() shows for `vm` at `now` (stale for staleTagsFor after a setTags). */
  visibleTags(vm: StubVm, now = this.clock.now()): Readonly<Tags> {
    if (vm.previousTags !== null && now < vm.tagsSetAt + this.knobs.staleTagsFor) return vm.previousTags;
    return vm.tags;
  }

  private capacityError(type: InstanceType): CapacityError | undefined {
    const cap = this.knobs.capacityErrors;
    if (cap.all) return new CapacityError("stub: no capacity at all", { scope: "all" });
    if (cap.instanceTypes.has(type.name) || cap.instanceTypes.has(type.providerType)) {
      return new CapacityError(`stub: no capacity for instance type ${type.name}`, {
        scope: "instanceType",
        instanceType: type.name,
      });
    }
    const group = this.quotaGroup(type);
    if (cap.quotaGroups.has(group)) {
      return new CapacityError(`stub: no capacity in quota group ${group}`, {
        scope: "quotaGroup",
        quotaGroup: group,
        instanceType: type.name,
      });
    }
    return undefined;
  }

  private select(selector: VmSelector, vm: StubVm): boolean {
    if (typeof selector === "boolean") return selector;
    if (typeof selector === "function") return selector(vm);
    if ("everyNth" in selector) return selector.everyNth > 0 && vm.serial % selector.everyNth === 0;
    return this.rng.select() < selector.rate;
  }

  /** Waits while `op` is held, runs `body`, and logs the call with its outcome. */
  private async call<T>(
    op: StubOp,
    setId: string,
    detail: { instanceType?: string; instanceId?: string },
    body: () => T,
  ): Promise<T> {
    const at = this.clock.now();
    if (this.heldOps.has(op)) {
      const released = new Promise<void>((resolve) => this.waiting.push(resolve));
      this.emit("op:held", op);
      await released;
    }
    let outcome = "ok";
    try {
      return body();
    } catch (err) {
      outcome = err instanceof DispatchCloudError ? err.code : "error";
      throw err;
    } finally {
      const counts = this.counts[op];
      counts[outcome] = (counts[outcome] ?? 0) + 1;
      const entry: StubCall = {
        seq: ++this.seq,
        op,
        instanceSetId: setId,
        at,
        doneAt: this.clock.now(),
        ...detail,
        outcome,
      };
      if (this.calls.length >= this.knobs.callLogLimit) {
        this.calls = this.calls.slice(Math.floor(this.knobs.callLogLimit / 2));
      }
      this.calls.push(entry);
      this.emit("call", entry);
    }
  }
}

/** A listed or created instance: a snapshot of the VM's tags; operations go to the cloud. */
class StubInstance implements Instance {
  readonly id: string;
  readonly address: string;
  readonly remoteUser: string;
  readonly providerType: string;

  constructor(
    private readonly cloud: StubCloud,
    private readonly setId: string,
    private readonly vm: StubVm,
    readonly tags: Readonly<Tags>,
  ) {
    this.id = vm.id;
    this.address = vm.address;
    this.remoteUser = vm.remoteUser;
    this.providerType = vm.providerType;
  }

  setTags(tags: Tags): Promise<void> {
    return this.cloud.setTags(this.setId, this.id, tags);
  }

  destroy(): Promise<void> {
    return this.cloud.destroy(this.setId, this.id);
  }

  priceHistory(type: InstanceType): PricePoint[] {
    const market = this.cloud.knobs.priceHistory;
    if (market !== null) return market(this.vm, type);
    return [{ startTime: this.vm.createdAt, price: type.price }];
  }
}

class StubInstanceSet implements InstanceSet {
  private stopped = false;

  constructor(
    private readonly cloud: StubCloud,
    readonly id: string,
  ) {}

  async create(
    type: InstanceType,
    imageId: string,
    tags: Tags,
    initCommand: string,
    publicKey: string,
  ): Promise<Instance> {
    this.checkOpen();
    const vm = await this.cloud.create(this.id, type, imageId, tags, initCommand, publicKey);
    return new StubInstance(this.cloud, this.id, vm, vm.tags);
  }

  async instances(filter: Tags): Promise<Instance[]> {
    this.checkOpen();
    return this.cloud.list(this.id, filter);
  }

  quotaGroup(type: InstanceType): string {
    return this.cloud.quotaGroup(type);
  }

  async stop(): Promise<void> {
    this.stopped = true;
  }

  private checkOpen(): void {
    if (this.stopped) throw new CloudError(`stub: instance set ${this.id} is stopped`);
  }
}

/**
 * `cloud.driver: stub`. driverParameters is either `{ cloud: StubCloud }` (tests pass the object in, so they
 * can reach the knobs and VMs and share them across instance sets) or, from a config file,
 * `{ seed, ...knobs }` (see params.ts), which creates a new StubCloud on the dispatcher's clock.
 */
export const stubDriver: CloudDriver = {
  async instanceSet(params, instanceSetId, _sharedTags, deps) {
    if (typeof params === "object" && params !== null && "cloud" in params) {
      const { cloud, ...rest } = params as { cloud: unknown };
      if (!(cloud instanceof StubCloud)) {
        throw new DispatchCloudError("cloud.invalid_parameters", "must be a StubCloud object", {
          path: "cloud.driverParameters.cloud",
        });
      }
      const extra = Object.keys(rest);
      if (extra.length > 0) {
        throw new DispatchCloudError(
          "cloud.invalid_parameters",
          `with a cloud object, no other parameters are allowed (set its knobs instead); got ${extra.join(", ")}`,
          { path: `cloud.driverParameters.${extra[0]}` },
        );
      }
      return cloud.instanceSet(instanceSetId);
    }
    return new StubCloud({ clock: deps.clock, ...parseStubParameters(params) }).instanceSet(instanceSetId);
  },
};
