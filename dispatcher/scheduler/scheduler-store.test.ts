/**
 * The scheduler's writes to a real store (PostgreSQL and PGlite): bundles no type can ever fit are failed with
 * a reason, and schedulingStatus sentences are written when they change, at most every
 * dispatcher.schedulingStatusInterval (flushStatuses() forces it).
 */
import { beforeEach, expect, it } from "vitest";
import { defaultConfig } from "../../config/load.ts";
import type { Config } from "../../config/schema.ts";
import { getBundle, listEvents } from "../../store/queries.ts";
import { requeueStarting, stageBundle, startBundle } from "../../store/transitions.ts";
import type { Bundle, NewBundle } from "../../store/types.ts";
import { createTestBundle, createTestUser, describeEachDb, type TestDb } from "../../test/db.ts";
import { FakeClock } from "../../test/fake-clock.ts";
import { silentLogger as logger, testInstanceType } from "../../test/fixtures.ts";
import { MemoryQueue, StubSchedulerPool } from "../../test/stub-pool.ts";
import { createBundleTransitions } from "../queue/transitions.ts";
import { createScheduler } from "./scheduler.ts";

const GiB = 2 ** 30;
const small = testInstanceType("small", { vcpus: 4, ramGiB: 16, price: 0.1 });
const gpu2 = testInstanceType("gpu2", {
  vcpus: 8,
  ramGiB: 32,
  price: 2,
  gpu: { stack: "cuda", driverVersion: "12.4", hardwareTarget: "8.0", deviceCount: 2, vram: 24 * GiB },
});

function testConfig(): Config {
  const c = defaultConfig();
  return { ...c, dispatcher: { ...c.dispatcher, schedulingStatusInterval: 2000 } };
}

describeEachDb("scheduler and the store", (getDb) => {
  let db: TestDb;
  let clock: FakeClock;
  let pool: StubSchedulerPool;
  let queue: MemoryQueue;
  beforeEach(() => {
    db = getDb();
    clock = new FakeClock();
    pool = new StubSchedulerPool(clock);
    queue = new MemoryQueue(clock);
  });

  const scheduler = () =>
    createScheduler({
      queue,
      pool,
      transitions: createBundleTransitions({ db, queue, logger }),
      instanceTypes: [small, gpu2],
      config: testConfig(),
      db,
      clock,
      logger,
    });

  async function stagedBundle(overrides: Partial<NewBundle> = {}): Promise<Bundle> {
    const user = await createTestUser(db);
    const created = await createTestBundle(db, user.uuid, overrides);
    const r = await stageBundle(db, created.uuid, { actor: "test" });
    if (!r.ok) throw new Error(`cannot stage ${created.uuid}: ${r.reason}`);
    queue.set(r.bundle);
    return r.bundle;
  }

  const stored = async (uuid: string) => (await getBundle(db, uuid))!;

  it("fails a bundle requeued after its last attempt instead of leaving it staged forever", async () => {
    const b = await stagedBundle({ maxAttempts: 1 });
    const started = await startBundle(db, b.uuid, {
      instanceId: "i-1",
      instanceType: "small",
      runnerTokenHash: "h".repeat(64),
      gpuDevices: [],
      actor: "test",
    });
    expect(started.ok).toBe(true);
    const requeued = await requeueStarting(db, b.uuid, 1, {
      actor: "test",
      reason: "crunch-run --detach failed",
    });
    if (!requeued.ok) throw new Error("requeue failed");
    queue.set(requeued.bundle);
    const r = await scheduler().runOnce();
    expect(r.failed).toEqual([b.uuid]);
    expect(r.created).toEqual([]);
    const row = await stored(b.uuid);
    expect(row.state).toBe("failed");
    expect(row.stateReason).toBe("attempts exhausted (1 of 1); last: crunch-run --detach failed");
  });

  it("fails at once a bundle no instance type can ever fit, naming the need and the closest type", async () => {
    const tooBig = await stagedBundle({ resources: { vcpus: 64, ram: GiB, scratch: 0, gpu: null } });
    const gpus = await stagedBundle({
      resources: {
        vcpus: 1,
        ram: GiB,
        scratch: 0,
        gpu: { stack: "cuda", deviceCount: 4, vram: 0, driverVersion: null, hardwareTarget: [] },
      },
    });
    const fine = await stagedBundle();
    const s = scheduler();
    const r = await s.runOnce();
    expect(r.failed.sort()).toEqual([tooBig.uuid, gpus.uuid].sort());
    expect(r.created).toEqual(["creating-1"]);

    const a = await stored(tooBig.uuid);
    expect(a.state).toBe("failed");
    expect(a.stateReason).toMatch(/^no instance type fits: needs 64 vCPUs; the largest type, gpu2, has 8/);
    const b = await stored(gpus.uuid);
    expect(b.state).toBe("failed");
    expect(b.stateReason).toContain("4 cuda GPUs");
    expect(b.stateReason).toContain("gpu2");
    const events = await listEvents(db, tooBig.uuid);
    expect(events.at(-1)).toMatchObject({ toState: "failed", actor: "dispatcher" });

    // The queue got the rows, so they are gone from it; the bundle that fits is untouched.
    expect(queue.get(tooBig.uuid)).toBeUndefined();
    expect(queue.get(gpus.uuid)).toBeUndefined();
    expect((await stored(fine.uuid)).state).toBe("staged");
    expect((await s.runOnce()).failed).toEqual([]);
  });

  it("writes changed statuses at most every schedulingStatusInterval, and at once on flushStatuses", async () => {
    pool.maxConcurrentCreates = 1;
    const a = await stagedBundle({ priority: 9, resources: { vcpus: 4, ram: GiB, scratch: 0, gpu: null } });
    const b = await stagedBundle({ priority: 1, resources: { vcpus: 4, ram: GiB, scratch: 0, gpu: null } });
    const s = scheduler();
    const statusOf = async (uuid: string) => (await stored(uuid)).schedulingStatus;

    await s.runOnce(); // the first pass writes
    const a1 = "waiting in queue at position 1: waiting for a new small instance to boot";
    const b1 =
      "waiting in queue at position 2: waiting to create an instance: 1 instance create is in flight";
    expect(s.statusOf(a.uuid)).toBe(a1);
    expect(s.statusOf(b.uuid)).toBe(b1);
    expect(await statusOf(a.uuid)).toBe(a1);
    expect(await statusOf(b.uuid)).toBe(b1);

    pool.boot("creating-1", { newId: "i-9", state: "booting" });
    await clock.advance(1000);
    await s.runOnce(); // 1 s later: kept in memory only
    const a2 = "waiting in queue at position 1: waiting for instance i-9 (small) to boot";
    const b2 = "waiting in queue at position 2: waiting for a new small instance to boot";
    expect(s.statusOf(a.uuid)).toBe(a2);
    expect(s.statusOf(b.uuid)).toBe(b2);
    expect(await statusOf(a.uuid)).toBe(a1);
    expect(await statusOf(b.uuid)).toBe(b1);

    await s.flushStatuses();
    expect(await statusOf(a.uuid)).toBe(a2);
    expect(await statusOf(b.uuid)).toBe(b2);

    pool.boot("creating-2", { newId: "i-10", state: "booting" });
    await clock.advance(1000);
    await s.runOnce();
    const b3 = "waiting in queue at position 2: waiting for instance i-10 (small) to boot";
    expect(s.statusOf(b.uuid)).toBe(b3);
    expect(await statusOf(b.uuid)).toBe(b2);
    await clock.advance(1000);
    await s.runOnce(); // 2 s after the last flush
    expect(await statusOf(b.uuid)).toBe(b3);

    // A started bundle's "starting on" stays in memory (its start transition clears the stored status).
    pool.update("i-9", { state: "idle" });
    const r = await s.runOnce();
    expect(r.started).toEqual([a.uuid]);
    expect(s.statusOf(a.uuid)).toBe("starting on i-9");
    expect(s.statusOf(b.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-10 (small) to boot",
    );
    await s.flushStatuses();
    expect(await statusOf(a.uuid)).toBe(a2);
    expect(await statusOf(b.uuid)).toBe(
      "waiting in queue at position 1: waiting for instance i-10 (small) to boot",
    );
  });
});
