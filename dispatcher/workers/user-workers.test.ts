/**
 * Users' workers in the dispatcher (docs/workers.md): the real queue, transitions, scheduler and user-workers over
 * a real store (PostgreSQL and PGlite), the stub pool for instances, a fake clock. Workers are rows with recorded
 * check-ins, as the REST server writes them.
 */
import { afterEach, expect, it } from "vitest";
import { newWorkerId } from "../../lib/tokens.ts";
import { getBundle, insertBundle, listEvents } from "../../store/queries.ts";
import { stageBundle } from "../../store/transitions.ts";
import type { Bundle, NewBundle, WorkerResources } from "../../store/types.ts";
import { createWorker, getWorker, recordCheckin } from "../../store/worker-queries.ts";
import { createTestUser, describeEachDb, testBundleUuid, testNewBundle } from "../../test/db.ts";
import { until } from "../../test/e2e-harness.ts";
import { FakeClock } from "../../test/fake-clock.ts";
import { GiB, silentLogger as logger, testInstanceType } from "../../test/fixtures.ts";
import { schedulerTestConfig } from "../../test/scheduler-harness.ts";
import { StubSchedulerPool } from "../../test/stub-pool.ts";
import { createBundleQueue } from "../queue/queue.ts";
import { createBundleTransitions } from "../queue/transitions.ts";
import { createScheduler } from "../scheduler/scheduler.ts";
import { createUserWorkers } from "./user-workers.ts";

const small = testInstanceType("small", { vcpus: 2, ramGiB: 4, price: 0.1 });
const resources = (over: Partial<WorkerResources> = {}): WorkerResources => ({
  vcpus: 4,
  ram: 8 * GiB,
  freeDisk: 100 * GiB,
  gpu: null,
  ...over,
});

describeEachDb("users' workers in the scheduler", (getDb) => {
  const stops: (() => Promise<void>)[] = [];
  afterEach(async () => {
    for (const s of stops.splice(0).reverse()) await s();
  });

  async function setup(over: { checkinTimeout?: number; deliveryTimeout?: number } = {}) {
    const db = getDb();
    // Each test sees only its own bundles in the queue.
    await db.query(
      "UPDATE bundles SET state = 'killed', worker_id = NULL WHERE state IN ('created', 'staged', 'starting', 'running')",
    );
    const clock = new FakeClock();
    const base = schedulerTestConfig();
    const config = {
      ...base,
      workers: {
        longPoll: 2000,
        checkinTimeout: over.checkinTimeout ?? 60_000,
        deliveryTimeout: over.deliveryTimeout ?? 60_000,
      },
    };
    const queue = createBundleQueue({ db, clock, logger, pollInterval: 3_600_000 });
    const transitions = createBundleTransitions({ db, queue, logger });
    const userWorkers = createUserWorkers({ db, queue, transitions, clock, logger, config });
    const pool = new StubSchedulerPool(clock);
    const scheduler = createScheduler({
      queue,
      pool,
      userWorkers,
      transitions,
      instanceTypes: [small],
      config,
      db,
      clock,
      logger,
    });
    await queue.start();
    await userWorkers.start();
    stops.push(
      () => userWorkers.stop(),
      () => queue.stop(),
    );
    const worker = async (
      ownerUuid: string,
      opts: { slots?: number; tags?: string[]; cache?: string[]; res?: Partial<WorkerResources> } = {},
    ) => {
      const w = await createWorker(db, {
        id: newWorkerId("zzzzz"),
        ownerUuid,
        name: `w-${Math.random().toString(36).slice(2, 8)}`,
        tokenHash: Math.random().toString(36),
      });
      await recordCheckin(db, w.id, {
        state: "active",
        tags: opts.tags ?? [],
        resources: resources(opts.res),
        slots: opts.slots ?? 1,
        version: "0.1.0",
        artifactSha256: null,
        cache: opts.cache ?? [],
        running: [],
      });
      return w;
    };
    const staged = async (ownerUuid: string, over: Partial<NewBundle> = {}): Promise<Bundle> => {
      const b = await insertBundle(db, testBundleUuid(), testNewBundle(ownerUuid, over), "created");
      const r = await stageBundle(db, b.uuid, { actor: "test" });
      if (!r.ok) throw new Error("cannot stage");
      return r.bundle;
    };
    /** One pass over what the store holds now; waits for the claims it made. */
    const pass = async () => {
      await userWorkers.refresh();
      await queue.refresh();
      const r = await scheduler.runOnce();
      for (const uuid of r.started) {
        if (pool.calls.start.some((s) => s.uuid === uuid)) continue;
        await until(`${uuid} given to a worker`, async () =>
          (await getBundle(db, uuid))?.state === "starting" ? true : undefined,
        );
      }
      await queue.refresh();
      return r;
    };
    return { db, clock, queue, pool, scheduler, userWorkers, worker, staged, pass };
  }

  it("puts the owner's bundles on the owner's worker first, then on instances when it is full; never another user's", async () => {
    const h = await setup();
    const a = await createTestUser(h.db);
    const b = await createTestUser(h.db);
    const wa = await h.worker(a.uuid, { slots: 1 });
    const a1 = await h.staged(a.uuid, { priority: 600 });
    const a2 = await h.staged(a.uuid);
    const b1 = await h.staged(b.uuid);
    await h.pass();
    const row = await getBundle(h.db, a1.uuid);
    expect(row).toMatchObject({ state: "starting", workerId: wa.id, instanceId: null, attempt: 1 });
    expect(h.scheduler.statusOf(a1.uuid)).toBe(`starting on your worker ${wa.name}`);
    // The worker's one slot is taken: a2 and B's bundle go to the cloud (a new instance is created for them).
    expect((await getBundle(h.db, a2.uuid))?.state).toBe("staged");
    expect((await getBundle(h.db, b1.uuid))?.workerId).toBeUndefined();
    expect(h.pool.calls.create.length).toBeGreaterThan(0);
    // Another pass does not give the full worker anything more.
    await h.pass();
    expect((await getBundle(h.db, a2.uuid))?.workerId).toBeUndefined();
    expect(h.userWorkers.views().find((v) => v.id === wa.id)?.bundles).toEqual([a1.uuid]);
  });

  it("a tagged bundle no instance type has waits for a worker with the tag and says so, then runs there", async () => {
    const h = await setup();
    const a = await createTestUser(h.db);
    await h.worker(a.uuid, { slots: 4 }); // no tag
    const tagged = await h.staged(a.uuid, {
      resources: { vcpus: 1, ram: GiB, scratch: 0, gpu: null, tag: "gpu" },
    });
    const r = await h.pass();
    expect(r.failed).toEqual([]);
    expect(h.pool.calls.create).toEqual([]);
    expect(h.scheduler.statusOf(tagged.uuid)).toBe(
      "waiting in queue at position 1: waiting for one of your workers with tag gpu: none is checked in",
    );
    const wg = await h.worker(a.uuid, { tags: ["gpu"] });
    await h.pass();
    expect(await getBundle(h.db, tagged.uuid)).toMatchObject({ state: "starting", workerId: wg.id });
  });

  it("workersOnly bundles never go to the cloud; a worker too small leaves them waiting", async () => {
    const h = await setup();
    const a = await createTestUser(h.db);
    await h.worker(a.uuid, { res: { vcpus: 1 } });
    const big = await h.staged(a.uuid, {
      resources: { vcpus: 2, ram: GiB, scratch: 0, gpu: null, workersOnly: true },
    });
    await h.pass();
    expect(h.pool.calls.create).toEqual([]);
    expect(h.scheduler.statusOf(big.uuid)).toBe(
      "waiting in queue at position 1: waiting for one of your workers (it runs only on your own machines): the one checked in is busy or too small",
    );
  });

  it("prefers the worker whose cache holds the inputs, then the one with most free slots", async () => {
    const h = await setup();
    const a = await createTestUser(h.db);
    const digest = `${"ab".repeat(32)}/100`;
    const roomy = await h.worker(a.uuid, { slots: 8 });
    const holder = await h.worker(a.uuid, { slots: 2, cache: ["abababababababab"] });
    const withInputs = await h.staged(a.uuid, { priority: 700 });
    await h.db.query("UPDATE bundles SET input_manifests = $2::jsonb WHERE uuid = $1", [
      withInputs.uuid,
      JSON.stringify([{ digest, bytes: 5 * GiB }]),
    ]);
    const plain = await h.staged(a.uuid);
    await h.pass();
    expect((await getBundle(h.db, withInputs.uuid))?.workerId).toBe(holder.id);
    expect((await getBundle(h.db, plain.uuid))?.workerId).toBe(roomy.id);
    // "Why is my bundle there" says the cache, as for an instance chosen for its cache.
    expect(h.scheduler.statusOf(withInputs.uuid)).toBe(
      `starting on your worker ${holder.name} (placed for its cache: 5.0 GiB of 5.0 GiB of inputs held there)`,
    );
    expect(h.scheduler.statusOf(plain.uuid)).toBe(`starting on your worker ${roomy.name}`);
  });

  it("a worker that stops checking in is lost once and its bundle goes back to the queue once", async () => {
    const h = await setup({ checkinTimeout: 1000 });
    const a = await createTestUser(h.db);
    const w = await h.worker(a.uuid);
    const bundle = await h.staged(a.uuid);
    await h.pass();
    expect((await getBundle(h.db, bundle.uuid))?.workerId).toBe(w.id);
    // The database's clock decides: make the last check-in old.
    await h.db.query("UPDATE workers SET checked_in_at = now() - interval '10 seconds' WHERE id = $1", [
      w.id,
    ]);
    await h.userWorkers.refresh();
    await Promise.all([h.userWorkers.sweepOnce(), h.userWorkers.sweepOnce()]);
    await h.userWorkers.sweepOnce();
    expect((await getWorker(h.db, w.id))?.state).toBe("lost");
    const row = await getBundle(h.db, bundle.uuid);
    expect(row).toMatchObject({ state: "staged", attempt: 1 });
    expect(row?.workerId).toBeUndefined();
    const requeues = (await listEvents(h.db, bundle.uuid)).filter(
      (e) => e.fromState === "starting" && e.toState === "staged",
    );
    expect(requeues).toHaveLength(1);
    expect(requeues[0]?.reason).toMatch(/its worker .* stopped checking in/);
  });

  it("a bundle its worker never reports is given back after deliveryTimeout", async () => {
    const h = await setup({ deliveryTimeout: 5000 });
    const a = await createTestUser(h.db);
    await h.worker(a.uuid);
    const bundle = await h.staged(a.uuid);
    await h.pass();
    await h.userWorkers.sweepOnce(); // first seen starting
    await h.clock.advance(4000);
    await h.userWorkers.sweepOnce();
    expect((await getBundle(h.db, bundle.uuid))?.state).toBe("starting");
    await h.clock.advance(2000);
    await h.userWorkers.sweepOnce();
    expect((await getBundle(h.db, bundle.uuid))?.state).toBe("staged");
  });
});
