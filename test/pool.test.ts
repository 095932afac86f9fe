/**
 * The WorkerPool over the stub cloud and its stub executor, on FakeClock (no sleeps: settled() and events),
 * with PGlite (and, for the start path, PostgreSQL too) as the store.
 */
import { createHash } from "node:crypto";
import { Registry } from "prom-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { CapacityError } from "../cloud-drivers/errors.ts";
import { StubCloud, type StubCloudOptions } from "../cloud-drivers/stub/driver.ts";
import type { StubVm } from "../cloud-drivers/stub/vm.ts";
import { type Instance, type InstanceSet, type InstanceType, TAG } from "../cloud-drivers/types.ts";
import { defaultConfig } from "../config/load.ts";
import type { Config } from "../config/schema.ts";
import {
  createWorkerPool,
  LIST_GRACE_MS,
  type PoolEvent,
  PROBE_COUNTS_FOR_MS,
  type WorkerPool,
} from "../dispatcher/pool/pool.ts";
import { CLAIM_TIMEOUT_MS } from "../dispatcher/pool/remote-runner.ts";
import { type BundleTransitions, createBundleTransitions } from "../dispatcher/queue/transitions.ts";
import type { QueueView } from "../dispatcher/types.ts";
import type { Executor } from "../lib/executor.ts";
import { LIST_REQUEST, manyAnswer, parseHandOffs, pidAnswer, refusedAnswer } from "../lib/runner-protocol.ts";
import { hashToken } from "../lib/tokens.ts";
import type { Db } from "../store/db.ts";
import { findBundleByRunnerTokenHash, getBundle, listEvents } from "../store/queries.ts";
import { markRunning, requeueStarting, stageBundle, startBundle } from "../store/transitions.ts";
import type { Bundle } from "../store/types.ts";
import { createTestBundle, createTestUser, describeEachDb, openTestDb, type TestDb } from "./db.ts";
import { FakeClock, flushMicrotasks } from "./fake-clock.ts";
import { GiB, instanceType, silentLogger } from "./fixtures.ts";

const SEC = 1000;
const MIN = 60 * SEC;

const type = (name: string, providerType: string, price: number): InstanceType =>
  instanceType(name, { providerType, ram: 8 * GiB, includedScratch: 50 * GiB, price });
const SMALL = type("small", "m5.large", 0.1);
const LARGE = type("large", "m5.xlarge", 0.2);
const GPU = type("gpu", "p3.2xlarge", 3);
const TYPES = [SMALL, LARGE, GPU];

const RUNNER_CONTENT = Buffer.from("#!/bin/sh\necho fake crunch-run\n");
const RUNNER = { content: RUNNER_CONTENT, sha256: createHash("sha256").update(RUNNER_CONTENT).digest("hex") };
const API_URL = "https://dispatch.example:8443";
const PREFIX = "DispatchCloud";

function configWith(
  cloud: Partial<Config["cloud"]> = {},
  more: Partial<Pick<Config, "dispatcher" | "containers">> = {},
): Config {
  const base = defaultConfig();
  return { ...base, ...more, cloud: { ...base.cloud, maxConcurrentInstanceCreateOps: 0, ...cloud } };
}

/** A QueueView that keeps what the pool applies (newer changeSeq wins). */
class AppliedRows implements QueueView {
  readonly rows = new Map<string, Bundle>();
  all() {
    return this.rows.values();
  }
  get(uuid: string) {
    return this.rows.get(uuid);
  }
  endedAt() {
    return undefined;
  }
  apply(bundle: Bundle) {
    const old = this.rows.get(bundle.uuid);
    if (old === undefined || old.changeSeq < bundle.changeSeq) this.rows.set(bundle.uuid, bundle);
  }
}

interface Harness {
  clock: FakeClock;
  cloud: StubCloud;
  pool: WorkerPool;
  config: Config;
  registry: Registry;
  queue: AppliedRows;
  events: PoolEvent[];
  commands: Array<{ vm: string; command: string }>;
  /** Creates instances of `t` and probes them until they are idle; returns their ids. */
  ready(t?: InstanceType, n?: number): Promise<string[]>;
  /** Advances the clock and runs one probe round. */
  tick(ms: number): Promise<void>;
  vmOf(workerId: string): StubVm;
}

function harness(
  db: Db,
  opts: {
    cloud?: Partial<Config["cloud"]>;
    /** Whole sections of the config besides cloud. */
    sections?: Partial<Pick<Config, "dispatcher" | "containers">>;
    stub?: Omit<StubCloudOptions, "clock">;
    reuse?: { clock: FakeClock; cloud: StubCloud };
    types?: readonly InstanceType[];
    instanceSet?: (set: InstanceSet) => InstanceSet;
    /** Wraps each executor the pool opens (to watch or delay what it does). */
    executor?: (exec: Executor, instance: Instance) => Executor;
    /** Wraps the pool's bundle transitions (to delay what they do). */
    transitions?: (t: BundleTransitions) => BundleTransitions;
    /** PoolOptions.handOffWithClaim (a REST server in the process waits for the claims in flight). */
    handOffWithClaim?: boolean;
  } = {},
): Harness {
  const clock = opts.reuse?.clock ?? new FakeClock();
  const cloud = opts.reuse?.cloud ?? new StubCloud({ clock, ...opts.stub });
  const config = configWith(opts.cloud, opts.sections);
  const registry = new Registry();
  const queue = new AppliedRows();
  const set = cloud.instanceSet("zzzzz");
  const pool = createWorkerPool({
    config,
    instanceSet: opts.instanceSet ? opts.instanceSet(set) : set,
    instanceTypes: opts.types ?? TYPES,
    db,
    clock,
    logger: silentLogger,
    registry,
    queue,
    connect: (instance: Instance, secret: string) => {
      const exec = cloud.executorFor(instance, { expectedSecret: secret });
      return opts.executor ? opts.executor(exec, instance) : exec;
    },
    runner: RUNNER,
    runnerApiUrl: API_URL,
    ...(opts.handOffWithClaim === undefined ? {} : { handOffWithClaim: opts.handOffWithClaim }),
    dispatcherPublicKey: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPoolTestKey pool@test",
    ...(opts.transitions
      ? { transitions: opts.transitions(createBundleTransitions({ db, queue, logger: silentLogger })) }
      : {}),
  });
  const events: PoolEvent[] = [];
  pool.subscribe((e) => events.push(e));
  const commands: Array<{ vm: string; command: string }> = [];
  cloud.on("command", (vm, command) => commands.push({ vm: vm.id, command }));
  // Destroyed VMs leave cloud.vms; keep them to look at.
  const vms = new Map(cloud.vms);
  cloud.on("vm:create", (vm) => vms.set(vm.id, vm));
  const h: Harness = {
    clock,
    cloud,
    pool,
    config,
    registry,
    queue,
    events,
    commands,
    async ready(t = SMALL, n = 1) {
      const ids: string[] = [];
      for (let i = 0; i < n; i++) {
        const res = pool.create(t);
        if (!res.ok) throw new Error(`create refused: ${res.refusal.message}`);
        await pool.settled();
        const w = pool.worker(res.worker.id);
        if (w === undefined || w.placeholder) throw new Error("create did not complete");
        ids.push(w.id);
      }
      // Listed once, as the sync loop soon does (a created instance no list has shown yet gets a grace period).
      await pool.syncOnce();
      await pool.probeOnce();
      await pool.settled();
      for (const id of ids) expect(pool.worker(id)?.state).toBe("idle");
      return ids;
    },
    async tick(ms) {
      await clock.advance(ms);
      await pool.probeOnce();
      await pool.settled();
    },
    vmOf(workerId) {
      const vm = vms.get(workerId);
      if (vm === undefined) throw new Error(`no VM ${workerId}`);
      return vm;
    },
  };
  return h;
}

const commandsTo = (h: Harness, vm: string) => h.commands.filter((c) => c.vm === vm).map((c) => c.command);
const isDeploy = (c: string) => c.startsWith("mkdir -p");
const metricValue = async (registry: Registry, name: string, labels: Record<string, string>) => {
  const m = (await registry.getMetricsAsJSON()).find((x) => x.name === name);
  const v = (m?.values as Array<{ labels: Record<string, unknown>; value: number }> | undefined)?.find((x) =>
    Object.entries(labels).every(([k, val]) => x.labels[k] === val),
  );
  return v?.value;
};

async function stagedBundle(db: Db, overrides: Parameters<typeof createTestBundle>[2] = {}): Promise<Bundle> {
  const user = await createTestUser(db);
  const b = await createTestBundle(db, user.uuid, overrides);
  const res = await stageBundle(db, b.uuid, { actor: "test" });
  if (!res.ok) throw new Error("stage failed");
  return res.bundle;
}

let db: TestDb;
beforeAll(async () => {
  db = await openTestDb("pglite");
});
afterAll(async () => {
  await db?.close();
});

describe("pool: create, boot, deploy", () => {
  it("creates a placeholder at once, replaces it with the instance, probes it to idle, deploying once", async () => {
    const h = harness(db);
    const res = h.pool.create(SMALL);
    expect(res.ok).toBe(true);
    if (!res.ok) return;
    expect(res.worker).toMatchObject({
      id: "creating-1",
      state: "booting",
      placeholder: true,
      idleBehavior: "run",
    });
    expect(h.pool.workers()).toHaveLength(1);
    await h.pool.settled();

    const [vm] = h.cloud.liveVms();
    if (vm === undefined) throw new Error("no VM");
    const w = h.pool.worker(vm.id);
    expect(w).toMatchObject({ state: "booting", placeholder: false, address: vm.address });
    expect(h.pool.worker("creating-1")).toBe(w);
    expect(h.events.slice(0, 3)).toEqual([
      { type: "worker:created", workerId: "creating-1", state: "booting" },
      { type: "worker:created", workerId: vm.id, state: "booting" },
      { type: "worker:gone", workerId: "creating-1", reason: `created as ${vm.id}`, replacedBy: vm.id },
    ]);
    // Tags: type, behaviour run, and a 40-hex secret the init script writes; the public key goes along.
    const secret = vm.tags[PREFIX + TAG.instanceSecret] ?? "";
    expect(secret).toMatch(/^[0-9a-f]{40}$/);
    expect(vm.tags).toMatchObject({
      [PREFIX + TAG.instanceType]: "small",
      [PREFIX + TAG.idleBehavior]: "run",
    });
    expect(vm.secret).toBe(secret);
    expect(vm.publicKey).toContain("pool@test");

    await h.pool.probeOnce();
    await h.pool.settled();
    expect(h.pool.worker(vm.id)).toMatchObject({ state: "idle", broken: false, probedAt: h.clock.now() });
    const first = commandsTo(h, vm.id);
    expect(first[0]).toBe("true");
    expect(first.filter(isDeploy)).toHaveLength(1);
    expect(first.at(-1)).toMatch(/crunch-run~[0-9a-f]{64}" --list$/);
    expect(vm.files.get(`/tmp/dispatch-cloud/crunch-run~${RUNNER.sha256}`)).toEqual(RUNNER_CONTENT);

    // The next probe of a booted instance is a --list only; nothing is copied again.
    await h.tick(11 * SEC);
    expect(commandsTo(h, vm.id).slice(first.length)).toEqual([first.at(-1)]);
    expect(await metricValue(h.registry, "dispatchcloud_boot_outcomes_total", { outcome: "success" })).toBe(
      1,
    );
    expect(
      await metricValue(h.registry, "dispatchcloud_instances", { state: "idle", instance_type: "small" }),
    ).toBe(1);
  });

  it("has every metric label combination at zero from the start", async () => {
    const h = harness(db);
    for (const state of ["unknown", "booting", "idle", "running", "shutdown"]) {
      for (const t of TYPES) {
        expect(
          await metricValue(h.registry, "dispatchcloud_instances", { state, instance_type: t.name }),
        ).toBe(0);
      }
      expect(await metricValue(h.registry, "dispatchcloud_instances_disappeared_total", { state })).toBe(0);
    }
    for (const outcome of ["success", "failure", "aborted", "disappeared"]) {
      expect(await metricValue(h.registry, "dispatchcloud_boot_outcomes_total", { outcome })).toBe(0);
    }
    const names = (await h.registry.getMetricsAsJSON()).map((m) => m.name);
    expect(names).toEqual(
      expect.arrayContaining([
        "dispatchcloud_instance_time_to_ssh_seconds",
        "dispatchcloud_instance_time_to_ready_seconds",
      ]),
    );
  });

  it("probes with a deterministic jitter, at most maxProbesPerSecond across the pool", async () => {
    const h = harness(db, { cloud: { maxProbesPerSecond: 1 } });
    for (let i = 0; i < 3; i++) {
      expect(h.pool.create(SMALL).ok).toBe(true);
      await h.pool.settled();
    }
    const lists = () => h.commands.filter((c) => c.command.endsWith("--list")).length;
    await h.pool.probeOnce();
    expect(lists()).toBe(1);
    await h.tick(SEC);
    expect(lists()).toBe(2);
    await h.tick(SEC);
    expect(lists()).toBe(3);
    expect(h.pool.workers().every((w) => w.state === "idle")).toBe(true);
    // Not due again before probeInterval; due by probeInterval + 10 %.
    await h.tick(5 * SEC);
    expect(lists()).toBe(3);
    await h.tick(10 * SEC);
    expect(lists()).toBeGreaterThan(3);
  });

  it("starts every due probe at once when maxProbesPerSecond is 0 (the default)", async () => {
    const h = harness(db);
    expect(h.config.cloud.maxProbesPerSecond).toBe(0);
    for (let i = 0; i < 5; i++) {
      expect(h.pool.create(SMALL).ok).toBe(true);
      await h.pool.settled();
    }
    await h.pool.probeOnce();
    expect(h.commands.filter((c) => c.command.endsWith("--list"))).toHaveLength(5);
  });

  it("runs at most maxConcurrentProbes at once; a hung instance holds its slot for PROBE_COUNTS_FOR_MS only", async () => {
    let running = 0;
    let peak = 0;
    const started: string[] = [];
    const h = harness(db, {
      cloud: { maxConcurrentProbes: 2 },
      executor: (exec, instance) => ({
        async execute(command, opts) {
          started.push(`${instance.id} ${command.endsWith("--list") ? "--list" : command}`);
          running++;
          peak = Math.max(peak, running);
          try {
            return await exec.execute(command, opts);
          } finally {
            running--;
          }
        },
        close: () => exec.close(),
      }),
    });
    const ids = await h.ready(SMALL, 5);
    expect(peak).toBeLessThanOrEqual(2);
    const [hung1, hung2, ...others] = ids as [string, string, ...string[]];
    h.vmOf(hung1).commandDelay = Number.POSITIVE_INFINITY;
    h.vmOf(hung2).commandDelay = Number.POSITIVE_INFINITY;
    await h.clock.advance(11 * SEC);
    const hungSince = h.pool.worker(hung1)?.probedAt;
    started.length = 0;
    peak = 0;
    const round = h.pool.probeOnce();
    await flushMicrotasks();
    // The two hung instances hold both slots: nobody else has started.
    expect(started.sort()).toEqual([`${hung1} --list`, `${hung2} --list`].sort());
    expect(running).toBe(2);
    // Past PROBE_COUNTS_FOR_MS they stop counting: the others are probed while the hung ones still hang.
    await h.clock.advance(PROBE_COUNTS_FOR_MS);
    for (const id of others) expect(started).toContain(`${id} --list`);
    for (const id of others) expect(h.pool.worker(id)?.probedAt).toBe(h.clock.now());
    expect(running).toBe(2);
    // The hung probes end with their command's timeout, as failures.
    await h.clock.advance(60 * SEC);
    await round;
    expect(h.pool.worker(hung1)?.probedAt).toBe(hungSince);
    expect(peak).toBe(4);
  });

  it("takes a probe slot only once the instance's connection is up: a slow handshake holds up nobody", async () => {
    const handshakes = new Map<string, () => void>();
    const h = harness(db, {
      cloud: { maxConcurrentProbes: 1 },
      executor: (exec, instance) => ({
        execute: (command, opts) => exec.execute(command, opts),
        // A connection that is set up only when the test says so (the stub executor has nothing to set up).
        connect: () =>
          handshakes.has(instance.id)
            ? new Promise<void>((resolve) => handshakes.set(instance.id, resolve))
            : Promise.resolve(),
        close: () => exec.close(),
      }),
    });
    const ids = await h.ready(SMALL, 3);
    const [slow, ...others] = ids as [string, ...string[]];
    // The slow one's connection dropped: its next probe waits for a new handshake.
    handshakes.set(slow, () => {});
    await h.clock.advance(11 * SEC);
    const before = new Map(ids.map((id) => [id, h.pool.worker(id)?.probedAt]));
    const round = h.pool.probeOnce();
    await flushMicrotasks();
    for (const id of others) expect(h.pool.worker(id)?.probedAt).not.toBe(before.get(id));
    expect(h.pool.worker(slow)?.probedAt).toBe(before.get(slow));
    handshakes.get(slow)?.();
    await round;
    expect(h.pool.worker(slow)?.probedAt).not.toBe(before.get(slow));
  });

  it("keeps an instance booting while it does not answer, has no secret yet, or fails the boot probe", async () => {
    const h = harness(db, { stub: { bootDelay: 30 * SEC } });
    const [id] = await (async () => {
      h.pool.create(SMALL);
      await h.pool.settled();
      return h.pool.workers().map((w) => w.id);
    })();
    if (id === undefined) throw new Error("no worker");
    const vm = h.vmOf(id);
    await h.pool.probeOnce();
    expect(h.pool.worker(id)?.state).toBe("booting");
    await h.clock.advance(30 * SEC);
    vm.secret = undefined;
    vm.neverBoot = true;
    await h.pool.probeOnce();
    expect(h.pool.worker(id)?.state).toBe("booting");
    vm.secret = vm.tags[PREFIX + TAG.instanceSecret];
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.state).toBe("booting");
    expect(commandsTo(h, id)).toEqual(["true"]);
    vm.neverBoot = false;
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.state).toBe("idle");
  });

  it("shuts down an instance whose runner cannot run after three tries, quoting the runner, and then waits before creating", async () => {
    const message = "ReferenceError: require is not defined in ES module scope";
    const h = harness(db, { stub: { runnerFails: { message, on: true } } });
    const res = h.pool.create(SMALL);
    if (!res.ok) throw new Error("create refused");
    await h.pool.settled();
    const [id] = h.pool.workers().map((w) => w.id);
    if (id === undefined) throw new Error("no worker");

    await h.pool.probeOnce();
    await h.pool.settled();
    // Booting still, but no longer silent: the runner's own line, and --version was what showed it.
    expect(h.pool.worker(id)).toMatchObject({ state: "booting", broken: false });
    expect(h.pool.worker(id)?.problem).toBe(
      `the runner cannot run: crunch-run --version exited 1: "${message}"`,
    );
    expect(commandsTo(h, id).at(-1)).toMatch(/crunch-run~[0-9a-f]{64}" --version$/);
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.state).toBe("booting");
    expect(h.pool.createsBlocked()).toBeNull();
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)).toMatchObject({ state: "shutdown" });
    expect(h.pool.worker(id)?.problem).toBe(
      `the runner cannot run: crunch-run --version exited 1: "${message}"`,
    );
    expect(await metricValue(h.registry, "dispatchcloud_boot_outcomes_total", { outcome: "failure" })).toBe(
      1,
    );

    // Creates wait a minute, then twice as long after the next instance fails the same way.
    const refused = h.pool.create(SMALL);
    expect(refused.ok).toBe(false);
    if (refused.ok) return;
    expect(refused.refusal).toMatchObject({
      kind: "runner_failed",
      instances: 1,
      until: h.clock.now() + MIN,
    });
    expect(refused.refusal.message).toContain(message);
    await h.clock.advance(MIN);
    const again = h.pool.create(SMALL);
    expect(again.ok).toBe(true);
    await h.pool.settled();
    for (let i = 0; i < 3; i++) await h.tick(11 * SEC);
    expect(h.pool.createsBlocked()).toMatchObject({
      kind: "runner_failed",
      instances: 2,
      until: h.clock.now() + 2 * MIN,
    });

    // A runner that runs again on a new instance lifts the wait.
    h.cloud.knobs.runnerFails = null;
    await h.clock.advance(2 * MIN);
    const [ok] = await h.ready(SMALL);
    expect(h.pool.worker(ok!)?.problem).toBeNull();
    expect(h.pool.createsBlocked()).toBeNull();
  });

  it("takes a --list that prints what is not its grammar as a runner that cannot run", async () => {
    const h = harness(db);
    const res = h.pool.create(SMALL);
    if (!res.ok) throw new Error("create refused");
    await h.pool.settled();
    const [id] = h.pool.workers().map((w) => w.id);
    if (id === undefined) throw new Error("no worker");
    const vm = h.vmOf(id);
    vm.runners.set("x", { uuid: "not a uuid", state: "running" } as never);
    await h.pool.probeOnce();
    await h.pool.settled();
    expect(h.pool.worker(id)?.state).toBe("booting");
    expect(h.pool.worker(id)?.problem).toBe(
      'the runner cannot run: crunch-run --list printed "not a uuid", which is not its grammar',
    );
  });
});

describe("pool: shutdown rules", () => {
  it("shuts an idle instance down after timeoutIdle, destroys it, and forgets it once unlisted", async () => {
    const h = harness(db);
    const [id = ""] = await h.ready();
    await h.tick(59 * SEC);
    expect(h.pool.worker(id)?.state).toBe("idle");
    await h.tick(1 * SEC);
    expect(h.pool.worker(id)?.state).toBe("shutdown");
    expect(h.vmOf(id).destroyed).toBe(true);
    await h.pool.syncOnce();
    expect(h.pool.worker(id)).toBeUndefined();
    expect(h.events.at(-1)).toEqual({ type: "worker:gone", workerId: id, reason: "shut down" });
    expect(
      await metricValue(h.registry, "dispatchcloud_instances_disappeared_total", { state: "idle" }),
    ).toBe(0);
  });

  it("never shuts down a held instance, and keeps the secret when rewriting the tags", async () => {
    const h = harness(db);
    const [id = ""] = await h.ready();
    const vm = h.vmOf(id);
    const secret = vm.tags[PREFIX + TAG.instanceSecret];
    await h.pool.setIdleBehavior(id, "hold");
    expect(vm.tags).toEqual({
      [PREFIX + TAG.instanceType]: "small",
      [PREFIX + TAG.idleBehavior]: "hold",
      [PREFIX + TAG.instanceSecret]: secret,
    });
    for (let i = 0; i < 15; i++) await h.tick(10 * SEC);
    expect(h.pool.worker(id)).toMatchObject({ state: "idle", idleBehavior: "hold" });
    // Back to run: a whole timeoutIdle (1 min) from the release to take work, then the usual shutdown.
    await h.pool.setIdleBehavior(id, "run");
    expect(h.pool.worker(id)).toMatchObject({ state: "idle", idleBehavior: "run" });
    for (let i = 0; i < 5; i++) await h.tick(10 * SEC);
    expect(h.pool.worker(id)?.state).toBe("idle");
    for (let i = 0; i < 2; i++) await h.tick(10 * SEC);
    expect(h.pool.worker(id)?.state).toBe("shutdown");
  });

  it("drains: an idle instance shuts down at once", async () => {
    const h = harness(db);
    const [id = ""] = await h.ready();
    await h.pool.setIdleBehavior(id, "drain");
    expect(h.pool.worker(id)?.state).toBe("shutdown");
    await h.pool.settled();
    expect(h.vmOf(id).destroyed).toBe(true);
  });

  it("drains a booting instance at once (placeholders once their create returns)", async () => {
    const h = harness(db, { stub: { bootDelay: 5 * MIN } });
    const res = h.pool.create(SMALL);
    if (!res.ok) throw new Error("refused");
    await h.pool.setIdleBehavior(res.worker.id, "drain");
    expect(h.pool.worker(res.worker.id)?.state).toBe("booting");
    await h.pool.settled();
    const [vm] = [...h.cloud.vms.values()];
    expect(vm?.tags[PREFIX + TAG.idleBehavior]).toBe("drain");
    await h.pool.probeOnce();
    await h.pool.settled();
    expect(vm?.destroyed).toBe(true);
    expect(await metricValue(h.registry, "dispatchcloud_boot_outcomes_total", { outcome: "aborted" })).toBe(
      1,
    );
  });

  it("shuts down an instance that never answers within timeoutBooting", async () => {
    const h = harness(db, { stub: { bootDelay: Number.POSITIVE_INFINITY } });
    h.pool.create(SMALL);
    await h.pool.settled();
    const [w] = h.pool.workers();
    if (w === undefined) throw new Error("no worker");
    for (let t = 0; t < 10 * MIN - 10 * SEC; t += 10 * SEC) await h.tick(10 * SEC);
    expect(h.pool.worker(w.id)?.state).toBe("booting");
    await h.tick(10 * SEC);
    expect(h.pool.worker(w.id)?.state).toBe("shutdown");
    expect(h.vmOf(w.id).destroyed).toBe(true);
    expect(await metricValue(h.registry, "dispatchcloud_boot_outcomes_total", { outcome: "failure" })).toBe(
      1,
    );
  });

  it("shuts down an instance that answers but never passes the boot probe", async () => {
    const h = harness(db, { stub: { neverBoot: true }, cloud: { timeoutBooting: 2 * MIN } });
    h.pool.create(SMALL);
    await h.pool.settled();
    const [w] = h.pool.workers();
    if (w === undefined) throw new Error("no worker");
    for (let i = 0; i < 11; i++) await h.tick(10 * SEC);
    expect(h.pool.worker(w.id)?.state).toBe("booting");
    await h.tick(10 * SEC);
    expect(h.pool.worker(w.id)?.state).toBe("shutdown");
    expect(commandsTo(h, w.id).every((c) => c === "true")).toBe(true);
  });

  it("shuts down a booted instance with no successful probe for timeoutProbe", async () => {
    const h = harness(db, { cloud: { timeoutIdle: 1000 * MIN, timeoutProbe: 2 * MIN } });
    const [id = ""] = await h.ready();
    h.vmOf(id).commandsFail = true;
    for (let i = 0; i < 11; i++) await h.tick(10 * SEC);
    expect(h.pool.worker(id)?.state).toBe("idle");
    await h.tick(10 * SEC);
    expect(h.pool.worker(id)?.state).toBe("shutdown");
  });

  it("drains a VM whose --list says broken, and shuts it down when idle", async () => {
    const h = harness(db, { stub: { broken: { everyNth: 2 } } });
    h.pool.create(SMALL);
    await h.pool.settled();
    h.pool.create(SMALL);
    await h.pool.settled();
    const [good, bad] = h.pool.workers().map((w) => w.id);
    await h.pool.probeOnce();
    await h.pool.settled();
    expect(h.pool.worker(good ?? "")).toMatchObject({ state: "idle", broken: false, idleBehavior: "run" });
    expect(h.pool.worker(bad ?? "")).toMatchObject({
      state: "shutdown",
      broken: true,
      idleBehavior: "drain",
    });
    expect(h.vmOf(bad ?? "").destroyed).toBe(true);
  });

  it("keeps the cache keys of the last --list (same array while unchanged); an odd cache line is only logged", async () => {
    const h = harness(db);
    const [id = ""] = await h.ready();
    const w = () => h.pool.worker(id)!;
    expect(w().cachedManifests).toEqual([]);
    const d1 = `${"1".repeat(64)}/10`;
    const d2 = `${"2".repeat(64)}/20`;
    h.vmOf(id).cachedManifests = [d2, d1];
    await h.tick(11 * SEC);
    const first = w().cachedManifests;
    expect(first).toEqual(["2".repeat(16), "1".repeat(16)]);
    await h.tick(11 * SEC);
    expect(w().cachedManifests).toBe(first);
    // Garbage in the line: the good keys count, the instance stays usable (not a runner that cannot run).
    h.vmOf(id).cacheLine = `cache ${"3".repeat(16)} nonsense`;
    await h.tick(11 * SEC);
    expect(w()).toMatchObject({ state: "idle", broken: false, cachedManifests: ["3".repeat(16)] });
    expect(w().problem ?? null).toBeNull();
    // An older runner prints no cache line: nothing cached.
    h.vmOf(id).cacheLine = null;
    h.vmOf(id).cachedManifests = [];
    await h.tick(11 * SEC);
    expect(w().cachedManifests).toEqual([]);
  });

  it("shuts down a host that fails the identity check and never sends it anything", async () => {
    const h = harness(db);
    h.pool.create(SMALL);
    await h.pool.settled();
    const [w] = h.pool.workers();
    if (w === undefined) throw new Error("no worker");
    h.vmOf(w.id).secret = "0".repeat(40);
    await h.pool.probeOnce();
    await h.pool.settled();
    expect(h.pool.worker(w.id)).toMatchObject({ state: "shutdown", broken: true });
    expect(h.vmOf(w.id).destroyed).toBe(true);
    expect(commandsTo(h, w.id)).toEqual([]);
    expect(() => h.pool.startBundle(w.id, {} as Bundle, [])).toThrow(/cannot take bundles/);
    expect(await metricValue(h.registry, "dispatchcloud_boot_outcomes_total", { outcome: "failure" })).toBe(
      1,
    );
  });

  it("forgets an instance that disappears, reporting its runners gone", async () => {
    const h = harness(db, { cloud: { timeoutIdle: 1000 * MIN } });
    const [id = ""] = await h.ready();
    const uuid = (await stagedBundle(db)).uuid;
    h.vmOf(id).startRunner(uuid, {});
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.state).toBe("running");
    const inst = (await h.cloud.instanceSet("zzzzz").instances({})).find((i) => i.id === id);
    await inst?.destroy();
    await h.pool.syncOnce();
    expect(h.pool.worker(id)).toBeUndefined();
    expect(h.events.slice(-2)).toEqual([
      { type: "runner:gone", workerId: id, uuid, reason: "instance disappeared" },
      { type: "worker:gone", workerId: id, reason: "disappeared" },
    ]);
    expect(
      await metricValue(h.registry, "dispatchcloud_instances_disappeared_total", { state: "running" }),
    ).toBe(1);
  });

  it("keeps a created instance the cloud does not list yet for a grace period, then forgets it", async () => {
    const hidden = new Set<string>();
    const h = harness(db, {
      cloud: { timeoutIdle: 1000 * MIN, timeoutBooting: 1000 * MIN },
      instanceSet: (set) => ({
        ...set,
        create: (...args) => set.create(...args),
        // Eventual consistency: the list does not show instances in `hidden`.
        instances: async (f) => (await set.instances(f)).filter((i) => !hidden.has(i.id)),
        quotaGroup: (t) => set.quotaGroup(t),
        stop: () => set.stop(),
      }),
    });
    h.cloud.on("vm:create", (vm) => hidden.add(vm.id));
    const res = h.pool.create(SMALL);
    if (!res.ok) throw new Error("create refused");
    await h.pool.settled();
    const [id] = h.pool.workers().map((w) => w.id);
    if (id === undefined) throw new Error("no worker");
    await h.pool.syncOnce();
    await h.clock.advance(MIN);
    await h.pool.syncOnce();
    expect(h.pool.worker(id)).toBeDefined();
    expect(h.cloud.counts.create["ok"]).toBe(1);
    // Listed at last: an ordinary instance from then on.
    hidden.delete(id);
    await h.pool.syncOnce();
    await h.pool.probeOnce();
    await h.pool.settled();
    expect(h.pool.worker(id)?.state).toBe("idle");

    // Another one that never shows up is forgotten once the grace period is over.
    const again = h.pool.create(SMALL);
    if (!again.ok) throw new Error("create refused");
    await h.pool.settled();
    const other = h.pool.workers().find((w) => w.id !== id && !w.placeholder)?.id ?? "";
    await h.clock.advance(LIST_GRACE_MS - SEC);
    await h.pool.syncOnce();
    expect(h.pool.worker(other)).toBeDefined();
    await h.clock.advance(2 * SEC);
    await h.pool.syncOnce();
    expect(h.pool.worker(other)).toBeUndefined();
    expect(h.events.at(-1)).toEqual({ type: "worker:gone", workerId: other, reason: "disappeared" });
  });

  it("destroys a shutdown instance again while it is still listed after timeoutShutdown", async () => {
    const h = harness(db, { stub: { errorRateDestroy: 1 } });
    const [id = ""] = await h.ready();
    h.pool.shutdown(id, "test");
    await h.pool.settled();
    expect(h.cloud.counts.destroy["cloud.error"]).toBe(1);
    await h.pool.syncOnce();
    await h.pool.settled();
    expect(h.cloud.counts.destroy["cloud.error"]).toBe(1);
    h.cloud.knobs.errorRateDestroy = 0;
    await h.clock.advance(10 * SEC);
    await h.pool.syncOnce();
    await h.pool.settled();
    expect(h.vmOf(id).destroyed).toBe(true);
    await h.pool.syncOnce();
    expect(h.pool.worker(id)).toBeUndefined();
  });
});

describe("pool: cloud errors and limits", () => {
  it("CloudQuotaError: at quota until fewer instances are listed", async () => {
    const h = harness(db, { stub: { quotaMaxInstances: 1 } });
    const [id = ""] = await h.ready();
    expect(h.pool.create(SMALL).ok).toBe(true);
    await h.pool.settled();
    expect(h.events.filter((e) => e.type === "create:error")).toEqual([
      {
        type: "create:error",
        instanceType: "small",
        code: "cloud.quota",
        message: "stub: instance quota of 1 reached",
      },
    ]);
    expect(h.pool.quota()).toEqual({ atQuota: true, instances: 1, max: 1, until: null });
    const refused = h.pool.create(LARGE);
    expect(refused).toMatchObject({
      ok: false,
      refusal: { kind: "quota", message: "at quota: 1 of 1 instances" },
    });
    await h.clock.advance(10 * MIN);
    expect(h.pool.quota().atQuota).toBe(true);
    h.pool.shutdown(id, "test");
    await h.pool.settled();
    await h.pool.syncOnce();
    expect(h.pool.quota()).toEqual({ atQuota: false, instances: 0, max: 64, until: null });
    expect(h.pool.create(SMALL).ok).toBe(true);
  });

  it("CloudQuotaError with no instances: at quota for one minute", async () => {
    const h = harness(db, { stub: { quotaMaxInstances: 1 } });
    await h.cloud.instanceSet("someone-else").create(SMALL, "", {}, "", "");
    const start = h.clock.now();
    h.pool.create(SMALL);
    await h.pool.settled();
    expect(h.pool.quota()).toEqual({ atQuota: true, instances: 0, max: 64, until: start + MIN });
    await h.clock.advance(MIN - 1);
    expect(h.pool.create(SMALL)).toMatchObject({ ok: false, refusal: { kind: "quota", until: start + MIN } });
    await h.clock.advance(1);
    expect(h.pool.quota().atQuota).toBe(false);
  });

  it("counts placeholders toward cloud.maxInstances", async () => {
    const h = harness(db, { cloud: { maxInstances: 2 } });
    h.cloud.holdCloudOps(["create"]);
    expect(h.pool.create(SMALL).ok).toBe(true);
    expect(h.pool.create(SMALL).ok).toBe(true);
    expect(h.pool.quota()).toEqual({ atQuota: true, instances: 2, max: 2, until: null });
    expect(h.pool.create(SMALL)).toMatchObject({
      ok: false,
      refusal: { kind: "quota", message: "at quota: 2 of 2 instances", instances: 2, max: 2 },
    });
    h.cloud.releaseCloudOps();
    await h.pool.settled();
    expect(h.pool.workers().filter((w) => !w.placeholder)).toHaveLength(2);
  });

  it("CapacityError for a type blocks that type for one minute", async () => {
    const h = harness(db, { stub: { capacityErrors: { instanceTypes: new Set(["small"]) } } });
    const start = h.clock.now();
    h.pool.create(SMALL);
    await h.pool.settled();
    expect(h.pool.workers()).toEqual([]);
    expect(h.pool.capacityBlocked(SMALL)).toMatchObject({ until: start + MIN });
    expect(h.pool.capacityBlocked(SMALL)?.message).toMatch(/^small at capacity until /);
    expect(h.pool.capacityBlocked(LARGE)).toBeNull();
    expect(h.pool.create(SMALL)).toMatchObject({
      ok: false,
      refusal: { kind: "capacity", until: start + MIN },
    });
    expect(h.pool.create(LARGE).ok).toBe(true);
    await h.pool.settled();
    await h.clock.advance(MIN);
    expect(h.pool.capacityBlocked(SMALL)).toBeNull();
  });

  it("CapacityError for a quota group blocks every type of that group", async () => {
    const h = harness(db, { stub: { capacityErrors: { quotaGroups: new Set(["m"]) } } });
    h.pool.create(LARGE);
    await h.pool.settled();
    expect(h.pool.capacityBlocked(SMALL)?.message).toMatch(/quota group m/);
    expect(h.pool.capacityBlocked(LARGE)).not.toBeNull();
    expect(h.pool.capacityBlocked(GPU)).toBeNull();
    expect(h.pool.create(GPU).ok).toBe(true);
  });

  it("CapacityError for everything blocks every type", async () => {
    const h = harness(db, { stub: { capacityErrors: { all: true } } });
    h.pool.create(GPU);
    await h.pool.settled();
    for (const t of TYPES) expect(h.pool.capacityBlocked(t)).not.toBeNull();
  });

  it("CloudRateLimitError blocks creates until earliestRetry", async () => {
    const h = harness(db, { stub: { minTimeBetweenCreateCalls: 30 * SEC } });
    const start = h.clock.now();
    h.pool.create(SMALL);
    await h.pool.settled();
    h.pool.create(SMALL);
    await h.pool.settled();
    expect(h.pool.workers()).toHaveLength(1);
    expect(h.pool.createsBlocked()).toMatchObject({ kind: "rate_limit", until: start + 30 * SEC });
    expect(h.pool.create(SMALL)).toMatchObject({ ok: false, refusal: { kind: "rate_limit" } });
    await h.clock.advance(30 * SEC);
    expect(h.pool.createsBlocked()).toBeNull();
    expect(h.pool.create(SMALL).ok).toBe(true);
    await h.pool.settled();
    expect(h.pool.workers()).toHaveLength(2);
  });

  it("refuses creates past maxConcurrentInstanceCreateOps until one returns", async () => {
    const h = harness(db, { cloud: { maxConcurrentInstanceCreateOps: 2 } });
    h.cloud.holdCloudOps(["create"]);
    expect(h.pool.create(SMALL).ok).toBe(true);
    expect(h.pool.create(SMALL).ok).toBe(true);
    expect(h.pool.createsBlocked()).toMatchObject({ kind: "max_concurrent", inFlight: 2 });
    expect(h.pool.create(SMALL)).toMatchObject({ ok: false, refusal: { kind: "max_concurrent" } });
    h.cloud.releaseCloudOps(1);
    await h.clock.advance(0);
    expect(h.pool.createsBlocked()).toBeNull();
    h.cloud.releaseCloudOps();
    await h.pool.settled();
  });

  it("adopts a listed instance whose create call has not returned yet", async () => {
    let open: () => void = () => {};
    const gate = new Promise<void>((resolve) => {
      open = resolve;
    });
    const h = harness(db, {
      instanceSet: (set) => ({
        ...set,
        create: async (...args) => {
          const inst = await set.create(...args);
          await gate;
          return inst;
        },
        instances: (f) => set.instances(f),
        quotaGroup: (t) => set.quotaGroup(t),
        stop: () => set.stop(),
      }),
    });
    const res = h.pool.create(SMALL);
    if (!res.ok) throw new Error("refused");
    await h.clock.advance(0);
    const [vm] = h.cloud.liveVms();
    if (vm === undefined) throw new Error("no VM");
    await h.pool.syncOnce();
    expect(h.pool.workers()).toHaveLength(1);
    expect(h.pool.worker(vm.id)).toMatchObject({ state: "booting", placeholder: false });
    open();
    await h.pool.settled();
    expect(h.pool.workers()).toHaveLength(1);
    await h.pool.probeOnce();
    expect(h.pool.worker(vm.id)?.state).toBe("idle");
  });

  it("shuts down an instance a list matched to its create when that create then fails", async () => {
    let open: () => void = () => {};
    const gate = new Promise<void>((resolve) => {
      open = resolve;
    });
    const h = harness(db, {
      instanceSet: (set) => ({
        ...set,
        // The VM exists and is listed; then the driver's create fails (as an allocation failure would).
        create: async (...args) => {
          await set.create(...args);
          await gate;
          throw new CapacityError("small: allocation failed after the VM was listed", {
            scope: "instanceType",
            instanceType: "small",
          });
        },
        instances: (f) => set.instances(f),
        quotaGroup: (t) => set.quotaGroup(t),
        stop: () => set.stop(),
      }),
    });
    const res = h.pool.create(SMALL);
    if (!res.ok) throw new Error("refused");
    await h.clock.advance(0);
    const [vm] = h.cloud.liveVms();
    if (vm === undefined) throw new Error("no VM");
    await h.pool.syncOnce();
    expect(h.pool.worker(vm.id)).toMatchObject({ state: "booting", placeholder: false });
    open();
    await h.pool.settled();
    // Not dropped (a later list would adopt it again as unknown) but shut down and destroyed.
    expect(h.pool.worker(vm.id)?.state).toBe("shutdown");
    expect(h.cloud.liveVms()).toEqual([]);
    expect(h.pool.capacityBlocked(SMALL)).not.toBeNull();
    await h.pool.syncOnce();
    expect(h.pool.workers()).toEqual([]);
    expect(h.events.some((e) => e.type === "create:error")).toBe(true);
  });
});

describeEachDb("pool: starting and killing runners", (getDb) => {
  it("sends a container log cap and a pull retry time in the start document only when they are not the defaults", async () => {
    const base = defaultConfig();
    const h = harness(getDb(), {
      sections: {
        dispatcher: { ...base.dispatcher, containerLogMaxSize: 8 * 2 ** 20 },
        containers: { ...base.containers, pullRetryTimeout: 5000 },
      },
    });
    const [id = ""] = await h.ready();
    const bundle = await stagedBundle(getDb());
    h.pool.startBundle(id, bundle, []);
    await h.pool.settled();
    expect(h.vmOf(id).runners.get(bundle.uuid)?.doc).toMatchObject({
      containerLogMaxBytes: 8 * 2 ** 20,
      imagePullRetryMs: 5000,
    });
  });

  it("starts a bundle: starting at once, store transition, start document with the token on stdin", async () => {
    const h = harness(getDb());
    const [id = ""] = await h.ready();
    const bundle = await stagedBundle(getDb());
    h.pool.startBundle(id, bundle, [0, 1]);
    const w = h.pool.worker(id);
    expect(w?.state).toBe("running");
    expect(w?.runners.get(bundle.uuid)).toEqual(
      expect.objectContaining({
        uuid: bundle.uuid,
        state: "starting",
        gpuDevices: [0, 1],
        since: h.clock.now(),
      }),
    );
    await h.pool.settled();
    const row = await getBundle(getDb(), bundle.uuid);
    expect(row).toMatchObject({
      state: "starting",
      attempt: 1,
      instanceId: id,
      instanceType: "small",
      gpuDevices: [0, 1],
    });
    expect(h.queue.get(bundle.uuid)?.state).toBe("starting");
    const events = await listEvents(getDb(), bundle.uuid);
    expect(events.at(-1)).toMatchObject({ fromState: "staged", toState: "starting", actor: "dispatcher" });

    const runner = h.vmOf(id).runners.get(bundle.uuid);
    const doc = runner?.doc as Record<string, unknown>;
    expect(doc).toEqual({
      uuid: bundle.uuid,
      attempt: 1,
      apiUrl: API_URL,
      token: expect.stringMatching(/^dcr_[A-Za-z0-9_-]{43}$/),
      instanceType: "small",
      gpuDevices: [0, 1],
      runtimeEngine: "docker",
      // dispatcher.warmSupervisors (2), at most by the instance's slots (its 2 vCPUs).
      warmSupervisors: 2,
    });
    expect((await findBundleByRunnerTokenHash(getDb(), hashToken(doc["token"] as string)))?.uuid).toBe(
      bundle.uuid,
    );
    const detach = commandsTo(h, id).filter((c) => c.includes("--detach"));
    expect(detach).toEqual([expect.stringMatching(new RegExp(`--detach ${bundle.uuid}$`))]);
    expect(h.commands.some((c) => c.command.includes(doc["token"] as string))).toBe(false);
    expect(h.events.at(-1)).toEqual({ type: "runner:started", workerId: id, uuid: bundle.uuid });

    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.runners.get(bundle.uuid)?.state).toBe("running");
    // The runner finishes: the instance is idle again, and its idle clock starts then.
    h.vmOf(id).finishRunner(bundle.uuid);
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.state).toBe("idle");
    expect(h.events.at(-2)).toEqual({
      type: "runner:gone",
      workerId: id,
      uuid: bundle.uuid,
      reason: "no longer listed",
    });
    await h.tick(50 * SEC);
    expect(h.pool.worker(id)?.state).toBe("idle");
    await h.tick(10 * SEC);
    expect(h.pool.worker(id)?.state).toBe("shutdown");
  });

  it("requeues the bundle when --detach fails", async () => {
    const h = harness(getDb());
    const [id = ""] = await h.ready();
    const bundle = await stagedBundle(getDb());
    h.vmOf(id).commandsFail = true;
    h.pool.startBundle(id, bundle, []);
    await h.pool.settled();
    const row = await getBundle(getDb(), bundle.uuid);
    expect(row).toMatchObject({ state: "staged", attempt: 1, instanceId: null });
    expect(row?.stateReason).toMatch(/crunch-run --detach exited 2/);
    expect(h.queue.get(bundle.uuid)?.state).toBe("staged");
    expect(h.pool.worker(id)).toMatchObject({ state: "idle" });
    expect(h.pool.worker(id)?.runners.size).toBe(0);
    expect(h.events.at(-1)).toMatchObject({ type: "runner:start_failed", workerId: id, uuid: bundle.uuid });
  });

  it("hands the starts of one turn on an instance to its warm pool in one exchange; a refused one uses --detach", async () => {
    const SOCKET = "/run/dc/cr-spare-test.sock";
    const exchanges: string[] = [];
    let refuse = "";
    const h = harness(getDb(), {
      executor: (exec) =>
        Object.assign(Object.create(exec) as Executor, {
          // The listing names a warm pool (the stub runner has none: it answers only hand-offs here).
          execute: async (command: string, opts?: Parameters<Executor["execute"]>[1]) => {
            const res = await exec.execute(command, opts);
            if (!command.endsWith("--list")) return res;
            return { ...res, stdout: Buffer.concat([res.stdout, Buffer.from(`spare ${SOCKET}\n`)]) };
          },
          exchange: async (socket: string, payload: string | Promise<string | null>) => {
            const text = await payload;
            if (socket !== SOCKET || text === null || text === LIST_REQUEST)
              throw new Error("no pool listing");
            exchanges.push(text);
            const hs = parseHandOffs(text) ?? [];
            return Buffer.from(
              hs
                .map((x, i) =>
                  manyAnswer(x.uuid, x.uuid === refuse ? refusedAnswer("busy") : pidAnswer(4000 + i)),
                )
                .join(""),
            );
          },
        }),
    });
    const [id = ""] = await h.ready();
    const bundles = [await stagedBundle(getDb()), await stagedBundle(getDb()), await stagedBundle(getDb())];
    const user = await createTestUser(getDb());
    const lost = await createTestBundle(getDb(), user.uuid); // not staged: its claim is lost
    refuse = bundles[1]!.uuid;
    for (const b of [...bundles, lost]) h.pool.startBundle(id, b, []);
    await h.pool.settled();
    // One exchange for the three claimed (the lost one's document is left out), each with its own document.
    expect(exchanges).toHaveLength(1);
    const sent = parseHandOffs(exchanges[0]!) ?? [];
    expect(sent.map((x) => x.uuid).sort()).toEqual(bundles.map((b) => b.uuid).sort());
    for (const x of sent) {
      expect(x.mode).toBe("start");
      expect(JSON.parse(x.doc)).toMatchObject({ uuid: x.uuid, attempt: 1, apiUrl: API_URL });
      expect(JSON.parse(x.doc).claimInFlight).toBeUndefined();
    }
    // The refused one was started by --detach; the others by the pool, with no command.
    const detached = commandsTo(h, id).filter((c) => c.includes("--detach"));
    expect(detached).toHaveLength(1);
    expect(detached[0]).toContain(refuse);
    for (const b of bundles) {
      expect(h.events).toContainEqual(expect.objectContaining({ type: "runner:started", uuid: b.uuid }));
    }
    expect(h.events).toContainEqual(
      expect.objectContaining({ type: "runner:start_failed", uuid: lost.uuid }),
    );
  });

  /** An executor whose listing names a warm pool, and whose pool answers each hand-off with a pid. */
  const withPool =
    (onExchange: (text: string) => void) =>
    (exec: Executor): Executor =>
      Object.assign(Object.create(exec) as Executor, {
        execute: async (command: string, opts?: Parameters<Executor["execute"]>[1]) => {
          const res = await exec.execute(command, opts);
          if (!command.endsWith("--list")) return res;
          return {
            ...res,
            stdout: Buffer.concat([res.stdout, Buffer.from("spare /run/dc/cr-spare-test.sock\n")]),
          };
        },
        exchange: async (_socket: string, payload: string | Promise<string | null>) => {
          const text = await payload;
          if (text === null || text === LIST_REQUEST) throw new Error("no pool listing");
          onExchange(text);
          const hs = parseHandOffs(text) ?? [];
          return Buffer.from(hs.map((x, i) => manyAnswer(x.uuid, pidAnswer(4000 + i))).join(""));
        },
      });

  it("with handOffWithClaim, hands a warm pool the start document while the claim is in flight; without, once it is back", async () => {
    for (const handOffWithClaim of [true, false]) {
      const sent: string[] = [];
      let release: () => void = () => {};
      const held = new Promise<void>((r) => {
        release = r;
      });
      let claimed = false;
      const h = harness(getDb(), {
        handOffWithClaim,
        executor: withPool((text) => sent.push(text)),
        transitions: (t) => ({
          ...t,
          claim: async (uuid, on) => {
            await held;
            const result = await t.claim(uuid, on);
            claimed = true;
            return result;
          },
        }),
      });
      const [id = ""] = await h.ready();
      const bundle = await stagedBundle(getDb());
      h.pool.startBundle(id, bundle, []);
      for (let i = 0; i < 20 && sent.length === 0; i++) await flushMicrotasks();
      expect(claimed).toBe(false);
      expect((await getBundle(getDb(), bundle.uuid))?.state).toBe("staged");
      // With it, the pool has the document before the claim is even made; without, nothing has left yet.
      expect(sent).toHaveLength(handOffWithClaim ? 1 : 0);
      release();
      await h.pool.settled();
      expect(sent).toHaveLength(1);
      const doc = JSON.parse(parseHandOffs(sent[0]!)?.[0]?.doc ?? "{}") as { token: string; attempt: number };
      expect(doc).toMatchObject({ uuid: bundle.uuid, attempt: 1 });
      expect((doc as { claimInFlight?: boolean }).claimInFlight).toBe(handOffWithClaim ? true : undefined);
      // The claim stored the hash of the token the pool has, at the attempt the document named.
      const row = await findBundleByRunnerTokenHash(getDb(), hashToken(doc.token));
      expect(row).toMatchObject({ uuid: bundle.uuid, state: "starting", attempt: 1, instanceId: id });
      expect(h.events).toContainEqual(expect.objectContaining({ type: "runner:started", uuid: bundle.uuid }));
    }
  });

  it("a claim made for a warm pool asks for the attempt its document named: a bundle that moved on is not claimed", async () => {
    const sent: string[] = [];
    const h = harness(getDb(), { handOffWithClaim: true, executor: withPool((text) => sent.push(text)) });
    const [id = ""] = await h.ready();
    const bundle = await stagedBundle(getDb());
    // Another attempt was made and given back since the dispatcher read the bundle (attempt 0 in its view).
    const other = {
      instanceId: "i-other",
      instanceType: "t",
      runnerTokenHash: "h",
      gpuDevices: [],
      actor: "test",
    };
    expect((await startBundle(getDb(), bundle.uuid, other)).ok).toBe(true);
    expect((await requeueStarting(getDb(), bundle.uuid, 1, { actor: "test", reason: "given back" })).ok).toBe(
      true,
    );
    h.pool.startBundle(id, bundle, []);
    await h.pool.settled();
    expect(JSON.parse(parseHandOffs(sent[0]!)?.[0]?.doc ?? "{}")).toMatchObject({ attempt: 1 });
    expect(await getBundle(getDb(), bundle.uuid)).toMatchObject({ state: "staged", attempt: 1 });
    expect(h.pool.worker(id)?.runners.size).toBe(0);
    expect(h.events.at(-1)).toMatchObject({ type: "runner:start_failed", uuid: bundle.uuid });
    expect((h.events.at(-1) as { reason: string }).reason).toMatch(/wrong_attempt/);
  });

  it("drops the runner when the start transition is lost, sending nothing", async () => {
    const h = harness(getDb());
    const [id = ""] = await h.ready();
    const user = await createTestUser(getDb());
    const notStaged = await createTestBundle(getDb(), user.uuid);
    h.pool.startBundle(id, notStaged, []);
    await h.pool.settled();
    expect(h.pool.worker(id)?.runners.size).toBe(0);
    expect(h.pool.worker(id)?.state).toBe("idle");
    expect(commandsTo(h, id).some((c) => c.includes("--detach"))).toBe(false);
    expect(h.events.at(-1)).toMatchObject({ type: "runner:start_failed", uuid: notStaged.uuid });
    expect((await getBundle(getDb(), notStaged.uuid))?.state).toBe("created");
  });

  it("gives a start up when its claim does not return in CLAIM_TIMEOUT_MS, sending nothing", async () => {
    let claims = 0;
    const h = harness(getDb(), {
      transitions: (t) => ({
        ...t,
        claim: () => {
          claims++;
          return new Promise<never>(() => {}); // a claim that never comes back
        },
      }),
    });
    const [id = ""] = await h.ready();
    const bundle = await stagedBundle(getDb());
    h.pool.startBundle(id, bundle, []);
    await h.clock.advance(CLAIM_TIMEOUT_MS - 1);
    // Still under way: sync leaves such a bundle alone (detachedAt null).
    expect(claims).toBe(1);
    expect(h.pool.worker(id)?.runners.get(bundle.uuid)).toMatchObject({
      state: "starting",
      detachedAt: null,
    });
    await h.clock.advance(1);
    await h.pool.settled();
    expect(h.pool.worker(id)?.runners.size).toBe(0);
    expect(h.pool.worker(id)?.state).toBe("idle");
    expect(commandsTo(h, id).some((c) => c.includes("--detach"))).toBe(false);
    expect(h.events.at(-1)).toEqual({
      type: "runner:start_failed",
      workerId: id,
      uuid: bundle.uuid,
      reason: "the start transition failed",
    });
    expect((await getBundle(getDb(), bundle.uuid))?.state).toBe("staged");
  });

  it("keeps a started runner `starting` (same since) while --list does not show it", async () => {
    const h = harness(getDb(), { stub: { runnerCrashRate: 1 } });
    const [id = ""] = await h.ready();
    const bundle = await stagedBundle(getDb());
    h.pool.startBundle(id, bundle, []);
    const since = h.clock.now();
    await h.pool.settled();
    await h.tick(11 * SEC);
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.runners.get(bundle.uuid)).toMatchObject({ state: "starting", since });
    expect(h.pool.worker(id)?.probedAt).toBeGreaterThan(since);
    expect(h.pool.worker(id)?.state).toBe("running");
    // Sync decides (requeues the bundle); the next probe lets go of the runner.
    const starting = h.queue.get(bundle.uuid);
    const requeued = await requeueStarting(getDb(), bundle.uuid, starting?.attempt ?? 0, {
      actor: "dispatcher",
      reason: "runner not found",
    });
    if (!requeued.ok) throw new Error("requeue failed");
    h.queue.apply(requeued.bundle);
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.runners.size).toBe(0);
    expect(h.pool.worker(id)?.state).toBe("idle");
    expect(h.events.at(-2)).toEqual({
      type: "runner:gone",
      workerId: id,
      uuid: bundle.uuid,
      reason: "no longer listed",
    });
  });

  it("keeps a runner that a --list sent before its start returned did not show, though its bundle runs", async () => {
    // Starts run beside probes: hold one probe's --list answer (taken before the start) until the start is done.
    let hold: Promise<void> | null = null;
    let held = false;
    let release = () => {};
    const h = harness(getDb(), {
      executor: (exec) =>
        Object.assign(Object.create(exec) as Executor, {
          execute: async (command: string, opts?: Parameters<Executor["execute"]>[1]) => {
            const res = await exec.execute(command, opts);
            if (hold !== null && command.endsWith("--list")) {
              held = true;
              await hold;
            }
            return res;
          },
        }),
    });
    const [id = ""] = await h.ready();
    const bundle = await stagedBundle(getDb());
    hold = new Promise<void>((resolve) => {
      release = resolve;
    });
    await h.clock.advance(11 * SEC);
    const probe = h.pool.probeOnce();
    await waitUntil(() => held);
    await h.clock.advance(SEC);
    h.pool.startBundle(id, bundle, []);
    await waitUntil(() => h.events.some((e) => e.type === "runner:started" && e.uuid === bundle.uuid));
    // The runner called start: the queue has the bundle running (no longer `starting`).
    const started = h.queue.get(bundle.uuid);
    const running = await markRunning(getDb(), bundle.uuid, started?.attempt ?? 0, { actor: "runner" });
    if (!running.ok) throw new Error("markRunning failed");
    h.queue.apply(running.bundle);
    hold = null;
    release();
    await probe;
    await h.pool.settled();
    expect(h.pool.worker(id)?.runners.get(bundle.uuid)?.state).toBe("starting");
    expect(h.events.some((e) => e.type === "runner:gone")).toBe(false);
    // The next list (sent after the start returned) shows it.
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.runners.get(bundle.uuid)?.state).toBe("running");
  });

  it("refuses bundles on workers that cannot take them", async () => {
    const h = harness(getDb(), { stub: { bootDelay: MIN } });
    const [id = ""] = await h.ready(SMALL, 0).then(async () => {
      h.pool.create(SMALL);
      await h.pool.settled();
      return h.pool.workers().map((w) => w.id);
    });
    const bundle = await stagedBundle(getDb());
    expect(() => h.pool.startBundle(id, bundle, [])).toThrow(/state booting/);
    expect(() => h.pool.startBundle("nope", bundle, [])).toThrow(/no worker nope/);
    await h.clock.advance(MIN);
    await h.pool.probeOnce();
    await h.pool.setIdleBehavior(id, "hold");
    expect(() => h.pool.startBundle(id, bundle, [])).toThrow(/idle behaviour hold/);
  });

  it("kills with TERM every timeoutSignal until timeoutTerm, then drains; never KILL", async () => {
    const h = harness(getDb(), { stub: { runnersIgnoreTerm: true } });
    const [id = ""] = await h.ready();
    const bundle = await stagedBundle(getDb());
    h.pool.startBundle(id, bundle, []);
    await h.pool.settled();
    h.pool.killRunner(id, bundle.uuid, "killed by the user");
    await h.pool.settled();
    const kills = () => commandsTo(h, id).filter((c) => c.includes("--kill"));
    expect(kills()).toEqual([expect.stringMatching(new RegExp(`--kill 15 ${bundle.uuid}$`))]);
    await h.tick(4 * SEC);
    expect(kills()).toHaveLength(1);
    await h.tick(1 * SEC);
    expect(kills()).toHaveLength(2);
    for (let t = 5 * SEC; t < 2 * MIN; t += 5 * SEC) await h.tick(5 * SEC);
    expect(h.pool.worker(id)?.idleBehavior).toBe("drain");
    const sent = kills().length;
    expect(sent).toBe(24);
    expect(kills().every((c) => c.includes("--kill 15 "))).toBe(true);
    expect(h.vmOf(id).tags[PREFIX + TAG.idleBehavior]).toBe("drain");
    await h.tick(30 * SEC);
    expect(kills()).toHaveLength(sent);
    // Running + drain: shut down once the runner is gone.
    expect(h.pool.worker(id)?.state).toBe("running");
    h.vmOf(id).finishRunner(bundle.uuid);
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.state).toBe("shutdown");
  });

  it("stops repeating TERM once the runner is gone", async () => {
    const h = harness(getDb());
    const [id = ""] = await h.ready();
    const bundle = await stagedBundle(getDb());
    h.pool.startBundle(id, bundle, []);
    await h.pool.settled();
    h.pool.killRunner(id, bundle.uuid, "test");
    await h.pool.settled();
    expect(h.vmOf(id).runners.get(bundle.uuid)).toMatchObject({ state: "exited", signal: "TERM" });
    await h.tick(11 * SEC);
    await h.tick(11 * SEC);
    expect(commandsTo(h, id).filter((c) => c.includes("--kill"))).toHaveLength(1);
    expect(h.pool.worker(id)).toMatchObject({ state: "idle", idleBehavior: "run" });
  });

  it("drains an instance whose runner holds a stale lock past timeoutStaleRunLock", async () => {
    const h = harness(getDb(), { cloud: { timeoutIdle: 1000 * MIN } });
    const [id = ""] = await h.ready();
    const bundle = await stagedBundle(getDb());
    h.pool.startBundle(id, bundle, []);
    await h.pool.settled();
    h.vmOf(id).markStale(bundle.uuid);
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.runners.get(bundle.uuid)?.state).toBe("stale");
    expect(h.pool.worker(id)?.idleBehavior).toBe("run");
    await h.tick(11 * SEC);
    expect(h.pool.worker(id)?.idleBehavior).toBe("drain");
  });
});

describe("pool: restart", () => {
  it("sees existing instances as unknown, keeps hold/drain, rediscovers runners without touching them", async () => {
    const first = harness(db, { cloud: { timeoutIdle: 1000 * MIN } });
    const [busy = "", held = "", other = ""] = [
      ...(await first.ready(SMALL, 2)),
      ...(await first.ready(GPU, 1)),
    ];
    const bundle = await stagedBundle(db);
    first.pool.startBundle(busy, bundle, []);
    await first.pool.settled();
    await first.pool.setIdleBehavior(busy, "drain");
    await first.pool.setIdleBehavior(held, "hold");
    await first.pool.stop();
    // A busy instance may fail its boot probe; its listed runners still make it running.
    first.vmOf(busy).neverBoot = true;

    // A new dispatcher, over the same cloud; GPU is no longer configured.
    const second = harness(db, {
      reuse: { clock: first.clock, cloud: first.cloud },
      types: [SMALL, LARGE],
      cloud: { timeoutIdle: 1000 * MIN },
    });
    await second.clock.advance(5 * SEC);
    await second.pool.start();
    try {
      expect(second.pool.workers().map((w) => [w.id, w.state, w.idleBehavior])).toEqual([
        [busy, "unknown", "drain"],
        [held, "unknown", "hold"],
        [other, "unknown", "drain"],
      ]);
      expect(second.pool.worker(other)?.instanceType.name).toBe("gpu");
      await second.pool.settled();
      expect(second.vmOf(other).tags[PREFIX + TAG.idleBehavior]).toBe("drain");
      expect(second.vmOf(other).tags[PREFIX + TAG.instanceSecret]).toMatch(/^[0-9a-f]{40}$/);

      await second.pool.probeOnce();
      await second.pool.settled();
      const w = second.pool.worker(busy);
      expect(w?.state).toBe("running");
      expect(w?.runners.get(bundle.uuid)).toMatchObject({ state: "running" });
      expect(second.pool.worker(held)).toMatchObject({ state: "idle", idleBehavior: "hold" });
      expect(second.pool.worker(other)?.state).toBe("shutdown");
      expect(second.events).toContainEqual({
        type: "runner:started",
        workerId: busy,
        uuid: bundle.uuid,
        reason: "listed",
      });
      // The runner found in place (same hash): checked, not copied; the bundle's runner untouched.
      const sent = second.commands.map((c) => c.command);
      expect(sent.filter((c) => c.startsWith("sha256sum"))).toHaveLength(2);
      expect(sent.filter(isDeploy)).toEqual([]);
      expect(sent.filter((c) => /--detach|--kill/.test(c))).toEqual([]);
      expect(second.vmOf(busy).runners.get(bundle.uuid)?.state).toBe("running");
      expect((await getBundle(db, bundle.uuid))?.state).toBe("starting");
    } finally {
      await second.pool.stop();
    }
  });

  it("start() runs the loops on the clock: probes, shutdowns and syncs happen as time passes", async () => {
    const h = harness(db);
    h.pool.create(SMALL);
    await h.pool.settled();
    await h.pool.start();
    try {
      const [w] = h.pool.workers();
      if (w === undefined) throw new Error("no worker");
      await h.clock.advance(SEC);
      await h.pool.settled();
      expect(h.pool.worker(w.id)?.state).toBe("idle");
      await h.clock.advance(MIN + 2 * SEC);
      await h.pool.settled();
      expect(h.vmOf(w.id).destroyed).toBe(true);
      await h.clock.advance(MIN);
      await h.pool.settled();
      expect(h.pool.workers()).toEqual([]);
    } finally {
      await h.pool.stop();
    }
  });
});

/** Polls (real time, briefly) until cond holds: for work that runs beside the fake clock. */
async function waitUntil(cond: () => boolean, timeoutMs = 10_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error("condition not met in time");
    await new Promise((r) => setTimeout(r, 5));
  }
}
