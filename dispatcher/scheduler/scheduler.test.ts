/**
 * Placement tests: one runOnce() pass over an in-memory queue and the stub pool (test/stub-pool.ts), asserting
 * on the creates, starts and shutdowns it recorded and on the status sentences. The Db is a real PGlite store
 * (the bundles here are not in it, so status writes touch no row).
 */
import { afterAll, beforeAll, beforeEach, describe, expect, it } from "vitest";
import type { InstanceType } from "../../cloud-drivers/types.ts";
import { defaultConfig } from "../../config/load.ts";
import type { Config } from "../../config/schema.ts";
import type { Bundle } from "../../store/types.ts";
import { openTestDb, type TestDb } from "../../test/db.ts";
import { FakeClock } from "../../test/fake-clock.ts";
import { silentLogger as logger, testInstanceType } from "../../test/fixtures.ts";
import { MemoryQueue, StubSchedulerPool, testBundle } from "../../test/stub-pool.ts";
import { createBundleTransitions } from "../queue/transitions.ts";
import { createScheduler, type Scheduler } from "./scheduler.ts";

const small = testInstanceType("small", { vcpus: 4, ramGiB: 16, price: 0.1, providerType: "m5.xlarge" });
const medium = testInstanceType("medium", { vcpus: 8, ramGiB: 32, price: 0.2, providerType: "m5.2xlarge" });
const large = testInstanceType("large", { vcpus: 16, ramGiB: 64, price: 0.4, providerType: "c5.4xlarge" });
const gpu4 = testInstanceType("gpu4", {
  vcpus: 16,
  ramGiB: 64,
  price: 3,
  gpu: { stack: "cuda", driverVersion: "12.4", hardwareTarget: "8.0", deviceCount: 4, vram: 40 * 2 ** 30 },
});

function testConfig(
  over: { maxRunningBundlesPerInstance?: number; maximumPriceFactor?: number; statusInterval?: number } = {},
): Config {
  const c = defaultConfig();
  return {
    ...c,
    dispatcher: {
      ...c.dispatcher,
      reserveExtraRam: 0,
      maximumPriceFactor: over.maximumPriceFactor ?? 100,
      schedulingStatusInterval: over.statusInterval ?? 2000,
    },
    cloud: { ...c.cloud, maxRunningBundlesPerInstance: over.maxRunningBundlesPerInstance ?? 0 },
  };
}

let db: TestDb;
beforeAll(async () => {
  db = await openTestDb("pglite");
});
afterAll(async () => {
  await db?.close();
});

let clock: FakeClock;
let pool: StubSchedulerPool;
let queue: MemoryQueue;
beforeEach(() => {
  clock = new FakeClock(); // 2026-01-01T00:00:00Z
  pool = new StubSchedulerPool(clock);
  queue = new MemoryQueue();
});

function scheduler(
  types: readonly InstanceType[] = [small, medium, large],
  over: Parameters<typeof testConfig>[0] = {},
): Scheduler {
  return createScheduler({
    queue,
    pool,
    transitions: createBundleTransitions({ db, queue, logger }),
    instanceTypes: types,
    config: testConfig(over),
    db,
    clock,
    logger,
  });
}

function staged(...bundles: Bundle[]): Bundle[] {
  queue.set(...bundles);
  return bundles;
}

const startedOn = () => pool.calls.start.map((s) => [s.uuid, s.workerId]);

describe("placement", () => {
  it("reuses an idle instance instead of creating one", async () => {
    const w = pool.addWorker({ type: small });
    const [b] = staged(testBundle());
    const s = scheduler();
    const r = await s.runOnce();
    expect(r.started).toEqual([b!.uuid]);
    expect(startedOn()).toEqual([[b!.uuid, w.id]]);
    expect(pool.calls.create).toEqual([]);
    expect(s.statusOf(b!.uuid)).toBe(`starting on ${w.id}`);
    expect(r.waiting).toBe(0);
  });

  it("packs new bundles onto one new instance of the cheapest eligible type", async () => {
    const bs = staged(testBundle(), testBundle(), testBundle(), testBundle(), testBundle());
    const s = scheduler();
    const r = await s.runOnce();
    // 4 vCPUs per small instance: two creates for five 1-vCPU bundles.
    expect(pool.calls.create).toEqual(["small", "small"]);
    expect(r.created).toEqual(["creating-1", "creating-2"]);
    expect(r.planned).toBe(5);
    expect(pool.calls.start).toEqual([]);
    expect(s.statusOf(bs[0]!.uuid)).toBe(
      "waiting in queue at position 1: waiting for a new small instance to boot",
    );
    expect(s.statusOf(bs[4]!.uuid)).toBe(
      "waiting in queue at position 5: waiting for a new small instance to boot",
    );
  });

  it("packs several bundles onto one idle instance", async () => {
    const w = pool.addWorker({ type: medium });
    const bs = staged(testBundle({ vcpus: 2 }), testBundle({ vcpus: 2 }), testBundle({ vcpus: 4 }));
    const r = await scheduler().runOnce();
    expect(startedOn()).toEqual(bs.map((b) => [b.uuid, w.id]));
    expect(r.started).toHaveLength(3);
    expect(pool.calls.create).toEqual([]);
  });

  it("counts no room for a runner whose bundle ended, but all of it for a runner it knows nothing of", async () => {
    const done = testBundle({ vcpus: 4, state: "running" });
    queue.set(done);
    queue.apply({ ...done, state: "ready", changeSeq: done.changeSeq + 1 });
    const finished = pool.addWorker({ id: "i-finished", type: small, runners: [done.uuid] });
    pool.addWorker({ id: "i-stranger", type: small, runners: ["zzzzz-bndl-notinthequeue01"] });
    const [b] = staged(testBundle({ vcpus: 4 }));
    await scheduler().runOnce();
    expect(startedOn()).toEqual([[b!.uuid, finished.id]]);
    expect(pool.calls.create).toEqual([]);
  });

  it("creates a bigger type for a bundle too big for the idle instance, and leaves the idle one alone", async () => {
    pool.addWorker({ type: small });
    staged(testBundle({ vcpus: 6 }));
    const r = await scheduler().runOnce();
    expect(pool.calls.create).toEqual(["medium"]);
    expect(pool.calls.start).toEqual([]);
    expect(r.planned).toBe(1);
  });

  it("prefers an instance already running bundles that has spare room", async () => {
    const running = testBundle({ vcpus: 2, state: "running" });
    queue.set(running);
    const idle = pool.addWorker({ id: "i-idle", type: small });
    const busy = pool.addWorker({ id: "i-busy", type: small, runners: [running.uuid] });
    const [one, three] = staged(testBundle({ vcpus: 1 }), testBundle({ vcpus: 3 }));
    await scheduler().runOnce();
    // 1 vCPU fits the busy one (2 of 4 used); 3 vCPUs no longer fit there, so the idle one takes it.
    expect(startedOn()).toEqual([
      [one!.uuid, busy.id],
      [three!.uuid, idle.id],
    ]);
  });

  it("prefers booted instances over booting ones, then cheaper ones", async () => {
    pool.addWorker({ id: "i-boot", type: small, state: "booting" });
    pool.addWorker({ id: "i-medium", type: medium });
    pool.addWorker({ id: "i-small", type: small });
    const [b] = staged(testBundle());
    await scheduler().runOnce();
    expect(startedOn()).toEqual([[b!.uuid, "i-small"]]);
  });

  it("gives nothing to held, draining, broken or shut-down instances", async () => {
    pool.addWorker({ type: small, idleBehavior: "hold" });
    pool.addWorker({ type: small, idleBehavior: "drain" });
    pool.addWorker({ type: small, broken: true });
    pool.addWorker({ type: small, state: "shutdown" });
    staged(testBundle());
    const r = await scheduler().runOnce();
    expect(pool.calls.start).toEqual([]);
    expect(pool.calls.create).toEqual(["small"]);
    expect(r.planned).toBe(1);
  });

  it("respects maxRunningBundlesPerInstance", async () => {
    const running = testBundle({ state: "running" });
    queue.set(running);
    const w = pool.addWorker({ type: large, runners: [running.uuid] });
    const bs = staged(testBundle(), testBundle(), testBundle());
    await scheduler([small, medium, large], { maxRunningBundlesPerInstance: 3 }).runOnce();
    expect(startedOn()).toEqual([
      [bs[0]!.uuid, w.id],
      [bs[1]!.uuid, w.id],
    ]);
    // The third goes to a new instance (which itself takes up to 3).
    expect(pool.calls.create).toEqual(["small"]);
  });

  it("plans bundles onto an unknown (not yet probed) instance without starting or creating", async () => {
    pool.addWorker({ id: "i-unknown", type: small, state: "unknown" });
    const [b] = staged(testBundle());
    const s = scheduler();
    const r = await s.runOnce();
    expect(pool.calls.start).toEqual([]);
    expect(pool.calls.create).toEqual([]);
    expect(r.planned).toBe(1);
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-unknown (small) to boot",
    );
  });

  it("packs tiny-vCPU bundles by RAM", async () => {
    const w = pool.addWorker({ type: small }); // 4 vCPUs, 16 GiB
    // 4 GiB x 100/95 = 4.21 GiB each: three fit in 16 GiB, whatever the vCPU count.
    const bs = staged(...Array.from({ length: 5 }, () => testBundle({ vcpus: 0.001, ramGiB: 4 })));
    await scheduler([small]).runOnce();
    expect(startedOn()).toEqual(bs.slice(0, 3).map((b) => [b.uuid, w.id]));
    expect(pool.calls.create).toEqual(["small"]);
  });

  it("assigns GPU devices lowest first and never shares one between bundles", async () => {
    const running = testBundle({ vcpus: 1, gpu: { deviceCount: 1 }, state: "running" });
    queue.set(running);
    const w = pool.addWorker({ type: gpu4, runners: [{ uuid: running.uuid, gpuDevices: [1] }] });
    const [two, one, other] = staged(
      testBundle({ gpu: { deviceCount: 2 } }),
      testBundle({ gpu: { deviceCount: 1 } }),
      testBundle({ gpu: { deviceCount: 1 } }),
    );
    await scheduler([small, gpu4]).runOnce();
    expect(pool.calls.start).toEqual([
      { workerId: w.id, uuid: two!.uuid, gpuDevices: [0, 2] },
      { workerId: w.id, uuid: one!.uuid, gpuDevices: [3] },
    ]);
    // No device left: the third gets a new instance.
    expect(pool.calls.create).toEqual(["gpu4"]);
    const used = [[1], ...pool.calls.start.map((s) => s.gpuDevices)].flat();
    expect(new Set(used).size).toBe(used.length);
    expect(other).toBeDefined();
  });

  it("takes a rediscovered runner's GPU devices from its bundle row when the pool does not know them", async () => {
    const running = { ...testBundle({ gpu: { deviceCount: 1 }, state: "running" }), gpuDevices: [0] };
    queue.set(running);
    const w = pool.addWorker({ type: gpu4, runners: [running.uuid] });
    staged(testBundle({ gpu: { deviceCount: 2 } }));
    await scheduler([gpu4]).runOnce();
    expect(pool.calls.start.map((c) => [c.workerId, c.gpuDevices])).toEqual([[w.id, [1, 2]]]);
  });

  it("keeps a bundle planned on the same booting instance from pass to pass", async () => {
    pool.addWorker({ id: "i-b", type: small, state: "booting" });
    const [b] = staged(testBundle());
    const s = scheduler();
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-b (small) to boot",
    );
    // i-a would sort first (same load, state and price; smaller id), but the plan stays where it was.
    pool.addWorker({ id: "i-a", type: small, state: "booting" });
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-b (small) to boot",
    );
  });

  it("counts a runner whose bundle is not in the queue as filling its instance", async () => {
    pool.addWorker({ type: large, runners: ["zzzzz-bndl-notinthequeue01"] });
    staged(testBundle());
    await scheduler().runOnce();
    expect(pool.calls.start).toEqual([]);
    expect(pool.calls.create).toEqual(["small"]);
  });

  it("does not start again a bundle the pool already runs while the queue still says staged", async () => {
    const [b] = staged(testBundle());
    const w = pool.addWorker({ type: small, runners: [{ uuid: b!.uuid, state: "starting" }] });
    const s = scheduler();
    const r = await s.runOnce();
    expect(pool.calls.start).toEqual([]);
    expect(pool.calls.create).toEqual([]);
    expect(r.waiting).toBe(0);
    expect(s.statusOf(b!.uuid)).toBe(`starting on ${w.id}`);
  });

  it("starts equal-priority bundles oldest first, and higher priority before older", async () => {
    pool.addWorker({ type: small });
    const t0 = Date.UTC(2025, 0, 1);
    const newer = testBundle({ vcpus: 4, priority: 5, createdAt: new Date(t0 + 2000) });
    const older = testBundle({ vcpus: 4, priority: 5, createdAt: new Date(t0 + 1000) });
    staged(newer, older);
    pool.maxInstances = 1;
    await scheduler([small]).runOnce();
    expect(startedOn().map(([u]) => u)).toEqual([older.uuid]);

    pool.calls.start.length = 0;
    queue.delete(older.uuid);
    const urgent = testBundle({ vcpus: 4, priority: 9, createdAt: new Date(t0 + 3000) });
    staged(urgent);
    pool.addWorker({ type: small });
    pool.maxInstances = null;
    await scheduler([small]).runOnce();
    expect(startedOn().map(([u]) => u)).toEqual([urgent.uuid]);
  });

  it("keeps a bundle planned on its placeholder while the create is in flight, then starts it", async () => {
    const [b] = staged(testBundle());
    const s = scheduler();
    const r1 = await s.runOnce();
    expect(r1.created).toEqual(["creating-1"]);
    const r2 = await s.runOnce();
    expect(r2.created).toEqual([]);
    expect(r2.planned).toBe(1);
    expect(pool.calls.create).toEqual(["small"]);
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for a new small instance to boot",
    );

    pool.boot("creating-1", { newId: "i-new", state: "booting" });
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-new (small) to boot",
    );
    pool.update("i-new", { state: "idle" });
    const r4 = await s.runOnce();
    expect(r4.started).toEqual([b!.uuid]);
    expect(startedOn()).toEqual([[b!.uuid, "i-new"]]);
    expect(pool.calls.create).toEqual(["small"]);
  });

  it("re-sorts a bundle whose priority changed between passes", async () => {
    const t0 = Date.UTC(2025, 0, 1);
    const a = testBundle({ vcpus: 4, priority: 5, createdAt: new Date(t0) });
    const b = testBundle({ vcpus: 4, priority: 5, createdAt: new Date(t0 + 1000) });
    staged(a, b);
    pool.maxInstances = 0;
    const s = scheduler([small]);
    await s.runOnce();
    expect(s.statusOf(a.uuid)).toMatch(/^waiting in queue at position 1: /);
    queue.set({ ...b, priority: 6, changeSeq: b.changeSeq + 1000 });
    await s.runOnce();
    expect(s.statusOf(b.uuid)).toMatch(/^waiting in queue at position 1: /);
    expect(s.statusOf(a.uuid)).toMatch(/^waiting in queue at position 2: /);
  });
});

describe("quota, capacity and create refusals", () => {
  it("at quota: stops placing, and shuts down instances with nothing to run", async () => {
    pool.maxInstances = 4;
    const running = testBundle({ state: "running" });
    queue.set(running);
    pool.addWorker({ id: "i-idle", type: small });
    pool.addWorker({ id: "i-booting", type: small, state: "booting" });
    pool.addWorker({ id: "i-busy", type: small, runners: [running.uuid] });
    pool.addWorker({ id: "i-held", type: small, idleBehavior: "hold" });
    const [big, little] = staged(
      testBundle({ vcpus: 12, priority: 9 }),
      testBundle({ vcpus: 1, priority: 1 }),
    );
    const s = scheduler();
    const r = await s.runOnce();
    expect(pool.calls.create).toEqual([]);
    expect(pool.calls.shutdown).toEqual([
      { workerId: "i-idle", reason: "at quota: making room" },
      { workerId: "i-booting", reason: "at quota: making room" },
    ]);
    expect(r.shutdown).toEqual(["i-idle", "i-booting"]);
    // The small bundle behind the big one is not started (it would starve it).
    expect(pool.calls.start).toEqual([]);
    expect(s.statusOf(big!.uuid)).toBe("waiting in queue at position 1: at quota: 4 of 4 instances");
    expect(s.statusOf(little!.uuid)).toBe(
      "waiting in queue at position 2: at quota: 4 of 4 instances; waiting for an idle instance of type small",
    );

    // Next pass, with room made: the big one gets its instance.
    const r2 = await s.runOnce();
    expect(pool.calls.create).toEqual(["large"]);
    expect(r2.planned).toBeGreaterThanOrEqual(1);
  });

  it("keeps instances that have bundles planned on them at quota", async () => {
    pool.maxInstances = 1;
    pool.addWorker({ id: "i-booting", type: small, state: "booting" });
    const [planned, big] = staged(testBundle({ priority: 9 }), testBundle({ vcpus: 12, priority: 1 }));
    const s = scheduler();
    const r = await s.runOnce();
    expect(pool.calls.shutdown).toEqual([]);
    expect(r.planned).toBe(1);
    expect(s.statusOf(planned!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-booting (small) to boot",
    );
    expect(s.statusOf(big!.uuid)).toBe("waiting in queue at position 2: at quota: 1 of 1 instances");
  });

  it("treats a quota refusal from create like being at quota", async () => {
    pool.cloudQuota = true;
    const [b] = staged(testBundle());
    const s = scheduler();
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: at quota: the cloud refuses more instances (0 now)",
    );
  });

  it("skips a type at capacity and creates the next cheapest", async () => {
    pool.capacityErrors.set("small", "type");
    staged(testBundle(), testBundle({ vcpus: 6 }));
    const r = await scheduler().runOnce();
    // small is refused (capacity) -> medium; the second bundle packs onto the new medium instance.
    expect(pool.calls.create).toEqual(["medium"]);
    expect(pool.capacityBlocked(small)).not.toBeNull();
    expect(pool.capacityBlocked(medium)).toBeNull();
    expect(r.planned).toBe(2);
  });

  it("skips every type of a quota group at capacity", async () => {
    // small and medium are both m5 (quota group "m5"); large is c5.
    pool.capacityErrors.set("small", "group");
    staged(testBundle());
    const s = scheduler();
    await s.runOnce();
    expect(pool.capacityBlocked(medium)).not.toBeNull();
    expect(pool.calls.create).toEqual(["large"]);
  });

  it("says no type is available when every eligible type is at capacity", async () => {
    const until = clock.now() + 42 * 60_000;
    pool.blockType("small", until);
    pool.blockQuotaGroup("m5", until);
    pool.blockType("large", until + 60_000);
    const [b] = staged(testBundle());
    const s = scheduler();
    const r = await s.runOnce();
    expect(pool.calls.create).toEqual([]);
    expect(r.waiting).toBe(1);
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: no instance type is available: small at capacity until 00:42, " +
        "medium at capacity until 00:42, large at capacity until 00:43",
    );
  });

  it("stops creating while rate-limited, but still starts bundles on idle instances", async () => {
    pool.rateLimitedUntil = clock.now() + 5 * 60_000;
    const w = pool.addWorker({ type: small });
    const [big, fits] = staged(testBundle({ vcpus: 12, priority: 9 }), testBundle({ priority: 1 }));
    const s = scheduler();
    await s.runOnce();
    expect(pool.calls.create).toEqual([]);
    expect(startedOn()).toEqual([[fits!.uuid, w.id]]);
    expect(s.statusOf(big!.uuid)).toBe(
      "waiting in queue at position 1: waiting to create an instance: the cloud API is rate-limited until 00:05",
    );
  });

  it("stops creating for the pass when too many creates are in flight", async () => {
    pool.maxConcurrentCreates = 1;
    const [a, b] = staged(testBundle({ vcpus: 12 }), testBundle({ vcpus: 12 }));
    const s = scheduler();
    await s.runOnce();
    expect(pool.calls.create).toEqual(["large"]);
    expect(s.statusOf(a!.uuid)).toBe(
      "waiting in queue at position 1: waiting for a new large instance to boot",
    );
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 2: waiting to create an instance: 1 instance create is in flight",
    );
  });
});

describe("status sentences", () => {
  it("says which booting instance a bundle waits for", async () => {
    pool.addWorker({ id: "i-123", type: small, state: "booting" });
    const [b] = staged(testBundle());
    const s = scheduler();
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-123 (small) to boot",
    );
  });

  it("says an instance of a fitting type exists but is busy", async () => {
    pool.maxInstances = 1;
    const running = testBundle({ vcpus: 4, state: "running" });
    queue.set(running);
    pool.addWorker({ type: small, runners: [running.uuid] });
    const [b] = staged(testBundle({ vcpus: 2 }));
    const s = scheduler();
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: at quota: 1 of 1 instances; waiting for an idle instance of type small",
    );
  });

  it("says only held instances could run it", async () => {
    pool.maxInstances = 1;
    pool.addWorker({ id: "i-held", type: medium, idleBehavior: "hold" });
    const [b] = staged(testBundle({ vcpus: 6 }));
    const s = scheduler();
    const r = await s.runOnce();
    expect(r.shutdown).toEqual([]);
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: at quota: 1 of 1 instances; only held instances of type medium could run it",
    );
  });

  it("has no status for bundles it never saw, and forgets those no longer staged", async () => {
    const [b] = staged(testBundle());
    const s = scheduler();
    expect(s.statusOf(b!.uuid)).toBeUndefined();
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBeDefined();
    queue.delete(b!.uuid);
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBeUndefined();
  });
});
