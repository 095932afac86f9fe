/**
 * Placement tests: one runOnce() pass over an in-memory queue and the stub pool (test/stub-pool.ts), asserting
 * on the creates, starts and shutdowns it recorded and on the status sentences. The Db is a real PGlite store
 * (the bundles here are not in it, so status writes touch no row).
 */
import { describe, expect, it } from "vitest";
import { testInstanceType } from "../../test/fixtures.ts";
import { useSchedulerHarness } from "../../test/scheduler-harness.ts";
import { testBundle } from "../../test/stub-pool.ts";
import { CLEANING_UP_MS } from "./scheduler.ts";

const small = testInstanceType("small", { vcpus: 4, ramGiB: 16, price: 0.1, providerType: "m5.xlarge" });
const medium = testInstanceType("medium", { vcpus: 8, ramGiB: 32, price: 0.2, providerType: "m5.2xlarge" });
const large = testInstanceType("large", { vcpus: 16, ramGiB: 64, price: 0.4, providerType: "c5.4xlarge" });
const gpu4 = testInstanceType("gpu4", {
  vcpus: 16,
  ramGiB: 64,
  price: 3,
  gpu: { stack: "cuda", driverVersion: "12.4", hardwareTarget: "8.0", deviceCount: 4, vram: 40 * 2 ** 30 },
});

const h = useSchedulerHarness([small, medium, large]);

describe("placement", () => {
  it("reuses an idle instance instead of creating one", async () => {
    const w = h.pool.addWorker({ type: small });
    const [b] = h.staged(testBundle());
    const s = h.scheduler();
    const r = await s.runOnce();
    expect(r.started).toEqual([b!.uuid]);
    expect(h.startedOn()).toEqual([[b!.uuid, w.id]]);
    expect(h.pool.calls.create).toEqual([]);
    expect(s.statusOf(b!.uuid)).toBe(`starting on ${w.id}`);
    expect(r.waiting).toBe(0);
  });

  it("packs new bundles onto one new instance of the cheapest eligible type", async () => {
    const bs = h.staged(testBundle(), testBundle(), testBundle(), testBundle(), testBundle());
    const s = h.scheduler();
    const r = await s.runOnce();
    // 4 vCPUs per small instance: two creates for five 1-vCPU bundles.
    expect(h.pool.calls.create).toEqual(["small", "small"]);
    expect(r.created).toEqual(["creating-1", "creating-2"]);
    expect(r.planned).toBe(5);
    expect(h.pool.calls.start).toEqual([]);
    expect(s.statusOf(bs[0]!.uuid)).toBe(
      "waiting in queue at position 1: waiting for a new small instance to boot",
    );
    expect(s.statusOf(bs[4]!.uuid)).toBe(
      "waiting in queue at position 5: waiting for a new small instance to boot",
    );
  });

  it("packs several bundles onto one idle instance", async () => {
    const w = h.pool.addWorker({ type: medium });
    const bs = h.staged(testBundle({ vcpus: 2 }), testBundle({ vcpus: 2 }), testBundle({ vcpus: 4 }));
    const r = await h.scheduler().runOnce();
    expect(h.startedOn()).toEqual(bs.map((b) => [b.uuid, w.id]));
    expect(r.started).toHaveLength(3);
    expect(h.pool.calls.create).toEqual([]);
  });

  it("counts no room for a runner whose bundle ended, but all of it for a runner it knows nothing of", async () => {
    const done = testBundle({ vcpus: 4, state: "running" });
    h.queue.set(done);
    h.queue.apply({ ...done, state: "ready", changeSeq: done.changeSeq + 1 });
    const finished = h.pool.addWorker({ id: "i-finished", type: small, runners: [done.uuid] });
    h.pool.addWorker({ id: "i-stranger", type: small, runners: ["zzzzz-bndl-notinthequeue01"] });
    const [b] = h.staged(testBundle({ vcpus: 4 }));
    await h.scheduler().runOnce();
    expect(h.startedOn()).toEqual([[b!.uuid, finished.id]]);
    expect(h.pool.calls.create).toEqual([]);
  });

  it("creates a bigger type for a bundle too big for the idle instance, and leaves the idle one alone", async () => {
    h.pool.addWorker({ type: small });
    h.staged(testBundle({ vcpus: 6 }));
    const r = await h.scheduler().runOnce();
    expect(h.pool.calls.create).toEqual(["medium"]);
    expect(h.pool.calls.start).toEqual([]);
    expect(r.planned).toBe(1);
  });

  it("prefers an instance already running bundles that has spare room", async () => {
    const running = testBundle({ vcpus: 2, state: "running" });
    h.queue.set(running);
    const idle = h.pool.addWorker({ id: "i-idle", type: small });
    const busy = h.pool.addWorker({ id: "i-busy", type: small, runners: [running.uuid] });
    const [one, three] = h.staged(testBundle({ vcpus: 1 }), testBundle({ vcpus: 3 }));
    await h.scheduler().runOnce();
    // 1 vCPU fits the busy one (2 of 4 used); 3 vCPUs no longer fit there, so the idle one takes it.
    expect(h.startedOn()).toEqual([
      [one!.uuid, busy.id],
      [three!.uuid, idle.id],
    ]);
  });

  it("prefers booted instances over booting ones, then cheaper ones", async () => {
    h.pool.addWorker({ id: "i-boot", type: small, state: "booting" });
    h.pool.addWorker({ id: "i-medium", type: medium });
    h.pool.addWorker({ id: "i-small", type: small });
    const [b] = h.staged(testBundle());
    await h.scheduler().runOnce();
    expect(h.startedOn()).toEqual([[b!.uuid, "i-small"]]);
  });

  it("gives nothing to held, draining, broken or shut-down instances", async () => {
    h.pool.addWorker({ type: small, idleBehavior: "hold" });
    h.pool.addWorker({ type: small, idleBehavior: "drain" });
    h.pool.addWorker({ type: small, broken: true });
    h.pool.addWorker({ type: small, state: "shutdown" });
    h.staged(testBundle());
    const r = await h.scheduler().runOnce();
    expect(h.pool.calls.start).toEqual([]);
    expect(h.pool.calls.create).toEqual(["small"]);
    expect(r.planned).toBe(1);
  });

  it("respects maxRunningBundlesPerInstance", async () => {
    const running = testBundle({ state: "running" });
    h.queue.set(running);
    const w = h.pool.addWorker({ type: large, runners: [running.uuid] });
    const bs = h.staged(testBundle(), testBundle(), testBundle());
    await h.scheduler([small, medium, large], { maxRunningBundlesPerInstance: 3 }).runOnce();
    expect(h.startedOn()).toEqual([
      [bs[0]!.uuid, w.id],
      [bs[1]!.uuid, w.id],
    ]);
    // The third goes to a new instance (which itself takes up to 3).
    expect(h.pool.calls.create).toEqual(["small"]);
  });

  it("counts no bundle slot for a runner whose bundle ended, before a probe sees it gone", async () => {
    const running = testBundle({ state: "running" });
    const done = testBundle({ state: "running" });
    h.queue.set(running);
    h.queue.set(done);
    h.queue.apply({ ...done, state: "ready", changeSeq: done.changeSeq + 1 });
    const w = h.pool.addWorker({ type: large, runners: [running.uuid, done.uuid] });
    const bs = h.staged(testBundle(), testBundle());
    const s = h.scheduler([small, medium, large], { maxRunningBundlesPerInstance: 2 });
    await s.runOnce();
    // Two slots: the running bundle's and one more; the ended one's runner only cleans up.
    expect(h.startedOn()).toEqual([[bs[0]!.uuid, w.id]]);
    expect(h.pool.calls.create).toEqual(["small"]);
  });

  /** Two idle instances: "i-a" (first by id) with a runner whose bundle ends now, and "i-b". */
  const oneEndedOnA = (): void => {
    const done = testBundle({ state: "running" });
    h.queue.set(done);
    h.queue.apply({ ...done, state: "ready", changeSeq: done.changeSeq + 1 });
    h.pool.addWorker({ id: "i-a", type: small, runners: [done.uuid] });
    h.pool.addWorker({ id: "i-b", type: small });
  };

  it("prefers, between instances equally loaded, one where no bundle ended within CLEANING_UP_MS", async () => {
    oneEndedOnA();
    // "i-a" is cleaning up, so "i-b" takes the bundle.
    const [b] = h.staged(testBundle());
    await h.clock.advance(CLEANING_UP_MS - 1);
    await h.scheduler().runOnce();
    expect(h.startedOn()).toEqual([[b!.uuid, "i-b"]]);
  });

  it("packs by the usual order once the last bundle ended CLEANING_UP_MS ago, its runner still listed", async () => {
    oneEndedOnA();
    // A probe would forget the runner up to probeInterval later; until then "i-a" is not held back for it.
    await h.clock.advance(CLEANING_UP_MS);
    const [b] = h.staged(testBundle());
    await h.scheduler().runOnce();
    expect(h.startedOn()).toEqual([[b!.uuid, "i-a"]]);
  });

  it("plans bundles onto an unknown (not yet probed) instance without starting or creating", async () => {
    h.pool.addWorker({ id: "i-unknown", type: small, state: "unknown" });
    const [b] = h.staged(testBundle());
    const s = h.scheduler();
    const r = await s.runOnce();
    expect(h.pool.calls.start).toEqual([]);
    expect(h.pool.calls.create).toEqual([]);
    expect(r.planned).toBe(1);
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-unknown (small) to boot",
    );
  });

  it("packs tiny-vCPU bundles by RAM", async () => {
    const w = h.pool.addWorker({ type: small }); // 4 vCPUs, 16 GiB
    // 4 GiB x 100/95 = 4.21 GiB each: three fit in 16 GiB, whatever the vCPU count.
    const bs = h.staged(...Array.from({ length: 5 }, () => testBundle({ vcpus: 0.001, ramGiB: 4 })));
    await h.scheduler([small]).runOnce();
    expect(h.startedOn()).toEqual(bs.slice(0, 3).map((b) => [b.uuid, w.id]));
    expect(h.pool.calls.create).toEqual(["small"]);
  });

  it("assigns GPU devices lowest first and never shares one between bundles", async () => {
    const running = testBundle({ vcpus: 1, gpu: { deviceCount: 1 }, state: "running" });
    h.queue.set(running);
    const w = h.pool.addWorker({ type: gpu4, runners: [{ uuid: running.uuid, gpuDevices: [1] }] });
    const [two, one, other] = h.staged(
      testBundle({ gpu: { deviceCount: 2 } }),
      testBundle({ gpu: { deviceCount: 1 } }),
      testBundle({ gpu: { deviceCount: 1 } }),
    );
    await h.scheduler([small, gpu4]).runOnce();
    expect(h.pool.calls.start).toEqual([
      { workerId: w.id, uuid: two!.uuid, gpuDevices: [0, 2] },
      { workerId: w.id, uuid: one!.uuid, gpuDevices: [3] },
    ]);
    // No device left: the third gets a new instance.
    expect(h.pool.calls.create).toEqual(["gpu4"]);
    const used = [[1], ...h.pool.calls.start.map((s) => s.gpuDevices)].flat();
    expect(new Set(used).size).toBe(used.length);
    expect(other).toBeDefined();
  });

  it("takes a rediscovered runner's GPU devices from its bundle row when the pool does not know them", async () => {
    const running = { ...testBundle({ gpu: { deviceCount: 1 }, state: "running" }), gpuDevices: [0] };
    h.queue.set(running);
    const w = h.pool.addWorker({ type: gpu4, runners: [running.uuid] });
    h.staged(testBundle({ gpu: { deviceCount: 2 } }));
    await h.scheduler([gpu4]).runOnce();
    expect(h.pool.calls.start.map((c) => [c.workerId, c.gpuDevices])).toEqual([[w.id, [1, 2]]]);
  });

  it("keeps a bundle planned on the same booting instance from pass to pass", async () => {
    h.pool.addWorker({ id: "i-b", type: small, state: "booting" });
    const [b] = h.staged(testBundle());
    const s = h.scheduler();
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-b (small) to boot",
    );
    // i-a would sort first (same load, state and price; smaller id), but the plan stays where it was.
    h.pool.addWorker({ id: "i-a", type: small, state: "booting" });
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-b (small) to boot",
    );
  });

  it("counts a runner whose bundle is not in the queue as filling its instance", async () => {
    h.pool.addWorker({ type: large, runners: ["zzzzz-bndl-notinthequeue01"] });
    h.staged(testBundle());
    await h.scheduler().runOnce();
    expect(h.pool.calls.start).toEqual([]);
    expect(h.pool.calls.create).toEqual(["small"]);
  });

  it("does not start again a bundle the pool already runs while the queue still says staged", async () => {
    const [b] = h.staged(testBundle());
    const w = h.pool.addWorker({ type: small, runners: [{ uuid: b!.uuid, state: "starting" }] });
    const s = h.scheduler();
    const r = await s.runOnce();
    expect(h.pool.calls.start).toEqual([]);
    expect(h.pool.calls.create).toEqual([]);
    expect(r.waiting).toBe(0);
    expect(s.statusOf(b!.uuid)).toBe(`starting on ${w.id}`);
  });

  it("starts equal-priority bundles oldest first, and higher priority before older", async () => {
    h.pool.addWorker({ type: small });
    const t0 = Date.UTC(2025, 0, 1);
    const newer = testBundle({ vcpus: 4, priority: 5, createdAt: new Date(t0 + 2000) });
    const older = testBundle({ vcpus: 4, priority: 5, createdAt: new Date(t0 + 1000) });
    h.staged(newer, older);
    h.pool.maxInstances = 1;
    await h.scheduler([small]).runOnce();
    expect(h.startedOn().map(([u]) => u)).toEqual([older.uuid]);

    h.pool.calls.start.length = 0;
    h.queue.delete(older.uuid);
    const urgent = testBundle({ vcpus: 4, priority: 9, createdAt: new Date(t0 + 3000) });
    h.staged(urgent);
    h.pool.addWorker({ type: small });
    h.pool.maxInstances = null;
    await h.scheduler([small]).runOnce();
    expect(h.startedOn().map(([u]) => u)).toEqual([urgent.uuid]);
  });

  it("keeps a bundle planned on its placeholder while the create is in flight, then starts it", async () => {
    const [b] = h.staged(testBundle());
    const s = h.scheduler();
    const r1 = await s.runOnce();
    expect(r1.created).toEqual(["creating-1"]);
    const r2 = await s.runOnce();
    expect(r2.created).toEqual([]);
    expect(r2.planned).toBe(1);
    expect(h.pool.calls.create).toEqual(["small"]);
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for a new small instance to boot",
    );

    h.pool.boot("creating-1", { newId: "i-new", state: "booting" });
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-new (small) to boot",
    );
    h.pool.update("i-new", { state: "idle" });
    const r4 = await s.runOnce();
    expect(r4.started).toEqual([b!.uuid]);
    expect(h.startedOn()).toEqual([[b!.uuid, "i-new"]]);
    expect(h.pool.calls.create).toEqual(["small"]);
  });

  it("re-sorts a bundle whose priority changed between passes", async () => {
    const t0 = Date.UTC(2025, 0, 1);
    const a = testBundle({ vcpus: 4, priority: 5, createdAt: new Date(t0) });
    const b = testBundle({ vcpus: 4, priority: 5, createdAt: new Date(t0 + 1000) });
    h.staged(a, b);
    h.pool.maxInstances = 0;
    const s = h.scheduler([small]);
    await s.runOnce();
    expect(s.statusOf(a.uuid)).toMatch(/^waiting in queue at position 1: /);
    h.queue.set({ ...b, priority: 6, changeSeq: b.changeSeq + 1000 });
    await s.runOnce();
    expect(s.statusOf(b.uuid)).toMatch(/^waiting in queue at position 1: /);
    expect(s.statusOf(a.uuid)).toMatch(/^waiting in queue at position 2: /);
  });
});

describe("quota, capacity and create refusals", () => {
  it("at quota: stops placing, and shuts down instances with nothing to run", async () => {
    h.pool.maxInstances = 4;
    const running = testBundle({ state: "running" });
    h.queue.set(running);
    h.pool.addWorker({ id: "i-idle", type: small });
    h.pool.addWorker({ id: "i-booting", type: small, state: "booting" });
    h.pool.addWorker({ id: "i-busy", type: small, runners: [running.uuid] });
    h.pool.addWorker({ id: "i-held", type: small, idleBehavior: "hold" });
    const [big, little] = h.staged(
      testBundle({ vcpus: 12, priority: 9 }),
      testBundle({ vcpus: 1, priority: 1 }),
    );
    const s = h.scheduler();
    const r = await s.runOnce();
    expect(h.pool.calls.create).toEqual([]);
    expect(h.pool.calls.shutdown).toEqual([
      { workerId: "i-idle", reason: "at quota: making room" },
      { workerId: "i-booting", reason: "at quota: making room" },
    ]);
    expect(r.shutdown).toEqual(["i-idle", "i-booting"]);
    // The small bundle behind the big one is not started (it would starve it).
    expect(h.pool.calls.start).toEqual([]);
    expect(s.statusOf(big!.uuid)).toBe("waiting in queue at position 1: at quota: 4 of 4 instances");
    expect(s.statusOf(little!.uuid)).toBe(
      "waiting in queue at position 2: at quota: 4 of 4 instances; waiting for an idle instance of type small",
    );

    // Next pass, with room made: the big one gets its instance.
    const r2 = await s.runOnce();
    expect(h.pool.calls.create).toEqual(["large"]);
    expect(r2.planned).toBeGreaterThanOrEqual(1);
  });

  it("keeps instances that have bundles planned on them at quota", async () => {
    h.pool.maxInstances = 1;
    h.pool.addWorker({ id: "i-booting", type: small, state: "booting" });
    const [planned, big] = h.staged(testBundle({ priority: 9 }), testBundle({ vcpus: 12, priority: 1 }));
    const s = h.scheduler();
    const r = await s.runOnce();
    expect(h.pool.calls.shutdown).toEqual([]);
    expect(r.planned).toBe(1);
    expect(s.statusOf(planned!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-booting (small) to boot",
    );
    expect(s.statusOf(big!.uuid)).toBe("waiting in queue at position 2: at quota: 1 of 1 instances");
  });

  it("treats a quota refusal from create like being at quota", async () => {
    h.pool.cloudQuota = true;
    const [b] = h.staged(testBundle());
    const s = h.scheduler();
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: at quota: the cloud refuses more instances (0 now)",
    );
  });

  it("skips a type at capacity and creates the next cheapest", async () => {
    h.pool.capacityErrors.set("small", "type");
    h.staged(testBundle(), testBundle({ vcpus: 6 }));
    const r = await h.scheduler().runOnce();
    // small is refused (capacity) -> medium; the second bundle packs onto the new medium instance.
    expect(h.pool.calls.create).toEqual(["medium"]);
    expect(h.pool.capacityBlocked(small)).not.toBeNull();
    expect(h.pool.capacityBlocked(medium)).toBeNull();
    expect(r.planned).toBe(2);
  });

  it("skips every type of a quota group at capacity", async () => {
    // small and medium are both m5 (quota group "m5"); large is c5.
    h.pool.capacityErrors.set("small", "group");
    h.staged(testBundle());
    const s = h.scheduler();
    await s.runOnce();
    expect(h.pool.capacityBlocked(medium)).not.toBeNull();
    expect(h.pool.calls.create).toEqual(["large"]);
  });

  it("says no type is available when every eligible type is at capacity", async () => {
    const until = h.clock.now() + 42 * 60_000;
    h.pool.blockType("small", until);
    h.pool.blockQuotaGroup("m5", until);
    h.pool.blockType("large", until + 60_000);
    const [b] = h.staged(testBundle());
    const s = h.scheduler();
    const r = await s.runOnce();
    expect(h.pool.calls.create).toEqual([]);
    expect(r.waiting).toBe(1);
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: no instance type is available: small at capacity until 00:42, " +
        "medium at capacity until 00:42, large at capacity until 00:43",
    );
  });

  it("stops creating while rate-limited, but still starts bundles on idle instances", async () => {
    h.pool.rateLimitedUntil = h.clock.now() + 5 * 60_000;
    const w = h.pool.addWorker({ type: small });
    const [big, fits] = h.staged(testBundle({ vcpus: 12, priority: 9 }), testBundle({ priority: 1 }));
    const s = h.scheduler();
    await s.runOnce();
    expect(h.pool.calls.create).toEqual([]);
    expect(h.startedOn()).toEqual([[fits!.uuid, w.id]]);
    expect(s.statusOf(big!.uuid)).toBe(
      "waiting in queue at position 1: waiting to create an instance: the cloud API is rate-limited until 00:05",
    );
  });

  it("stops creating for the pass when too many creates are in flight", async () => {
    h.pool.maxConcurrentCreates = 1;
    const [a, b] = h.staged(testBundle({ vcpus: 12 }), testBundle({ vcpus: 12 }));
    const s = h.scheduler();
    await s.runOnce();
    expect(h.pool.calls.create).toEqual(["large"]);
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
    h.pool.addWorker({ id: "i-123", type: small, state: "booting" });
    const [b] = h.staged(testBundle());
    const s = h.scheduler();
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-123 (small) to boot",
    );
  });

  it("says an instance of a fitting type exists but is busy", async () => {
    h.pool.maxInstances = 1;
    const running = testBundle({ vcpus: 4, state: "running" });
    h.queue.set(running);
    h.pool.addWorker({ type: small, runners: [running.uuid] });
    const [b] = h.staged(testBundle({ vcpus: 2 }));
    const s = h.scheduler();
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: at quota: 1 of 1 instances; waiting for an idle instance of type small",
    );
  });

  it("says only held instances could run it", async () => {
    h.pool.maxInstances = 1;
    h.pool.addWorker({ id: "i-held", type: medium, idleBehavior: "hold" });
    const [b] = h.staged(testBundle({ vcpus: 6 }));
    const s = h.scheduler();
    const r = await s.runOnce();
    expect(r.shutdown).toEqual([]);
    expect(s.statusOf(b!.uuid)).toBe(
      "waiting in queue at position 1: at quota: 1 of 1 instances; only held instances of type medium could run it",
    );
  });

  it("has no status for bundles it never saw, and forgets those no longer staged", async () => {
    const [b] = h.staged(testBundle());
    const s = h.scheduler();
    expect(s.statusOf(b!.uuid)).toBeUndefined();
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBeDefined();
    h.queue.delete(b!.uuid);
    await s.runOnce();
    expect(s.statusOf(b!.uuid)).toBeUndefined();
  });
});
