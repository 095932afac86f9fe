import { randomBytes } from "node:crypto";
import { pino } from "pino";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { parseConfig } from "../config/load.ts";
import type { Config } from "../config/schema.ts";
import type { Db } from "../store/db.ts";
import { getBundle, listEvents } from "../store/queries.ts";
import { killBundle, markRunning, stageBundle, startBundle } from "../store/transitions.ts";
import type { Bundle } from "../store/types.ts";
import { createTestBundle, createTestUser, openTestDb, type TestDb } from "../test/db.ts";
import { FakeClock } from "../test/fake-clock.ts";
import { testInstanceType } from "../test/fixtures.ts";
import { MemoryQueue } from "../test/stub-pool.ts";
import { createBundleTransitions } from "./queue/transitions.ts";
import { createSync, type SyncPool } from "./sync.ts";
import type { RunnerView, WorkerView } from "./types.ts";

const PROBE = 1000;
const STALE = 60_000;

function testConfig(): Config {
  const { config, problems } = parseConfig(
    `cloud:\n  probeInterval: ${PROBE}ms\ndispatcher:\n  staleLockTimeout: ${STALE}ms\n`,
  );
  if (config === undefined) throw new Error(JSON.stringify(problems));
  return config;
}

const TYPE = testInstanceType("t1", { vcpus: 2, ramGiB: 2, price: 0.1, scratchGiB: 0 });

type MutableWorker = { -readonly [K in keyof WorkerView]: WorkerView[K] } & {
  runners: Map<string, RunnerView>;
};

/** A pool that is only what sync reads: workers tests edit, and a record of kill requests. */
class FakePool implements SyncPool {
  readonly map = new Map<string, MutableWorker>();
  readonly kills: Array<{ workerId: string; uuid: string; reason: string }> = [];

  add(id: string, probedAt: number | null = null): MutableWorker {
    const w: MutableWorker = {
      id,
      instanceType: TYPE,
      state: probedAt === null ? "unknown" : "idle",
      idleBehavior: "run",
      placeholder: false,
      address: id,
      runners: new Map(),
      probedAt,
      stateSince: 0,
      lastBusy: 0,
      broken: false,
    };
    this.map.set(id, w);
    return w;
  }

  workers(): readonly WorkerView[] {
    return [...this.map.values()];
  }

  worker(id: string): WorkerView | undefined {
    return this.map.get(id);
  }

  killRunner(workerId: string, uuid: string, reason: string): void {
    this.kills.push({ workerId, uuid, reason });
  }
}

function runner(
  uuid: string,
  state: RunnerView["state"] = "running",
  detachedAt: number | null = 0,
): RunnerView {
  return { uuid, state, gpuDevices: [], since: 0, detachedAt };
}

describe("sync", () => {
  let db: TestDb;
  let owner: string;
  beforeAll(async () => {
    db = await openTestDb("pglite");
    owner = (await createTestUser(db)).uuid;
  });
  afterAll(async () => {
    await db?.close();
  });

  /** A bundle moved to `state` on instance `instanceId`. */
  async function bundleIn(
    state: "staged" | "starting" | "running" | "killed",
    instanceId = "i-1",
    maxAttempts = 3,
  ): Promise<Bundle> {
    const b = await createTestBundle(db, owner, { maxAttempts });
    let r = await stageBundle(db, b.uuid, { actor: "test" });
    if (state !== "staged" && state !== "killed") {
      r = await startBundle(db, b.uuid, {
        instanceId,
        instanceType: "t1",
        runnerTokenHash: randomBytes(32).toString("hex"),
        gpuDevices: [],
        actor: "test",
      });
      if (state === "running") r = await markRunning(db, b.uuid, 1, { actor: "test" });
    }
    if (state === "killed") r = await killBundle(db, b.uuid, { actor: "test", reason: "by test" });
    if (!r.ok) throw new Error(`fixture transition failed: ${r.reason}`);
    return r.bundle;
  }

  function setup(startedAt?: number) {
    const clock = new FakeClock();
    const pool = new FakePool();
    const queue = new MemoryQueue(clock);
    const sync = createSync({
      queue,
      pool,
      transitions: createBundleTransitions({ db, queue, logger: pino({ enabled: false }) }),
      clock,
      logger: pino({ enabled: false }),
      config: testConfig(),
      startedAt: startedAt ?? clock.now(),
    });
    return { clock, pool, queue, sync };
  }

  it("leaves a starting bundle whose runner is listed, and requeues one whose runner never appears", async () => {
    const { clock, pool, queue, sync } = setup();
    const w = pool.add("i-1", clock.now());
    const listed = await bundleIn("starting");
    const missing = await bundleIn("starting");
    queue.apply(listed);
    queue.apply(missing);
    w.runners.set(listed.uuid, runner(listed.uuid));
    // Started by the pool but never listed: the same as not there.
    w.runners.set(missing.uuid, runner(missing.uuid, "starting"));

    await sync.syncOnce();
    // Within the grace, and before a probe after the start: nothing.
    for (let i = 0; i < 2; i++) {
      await clock.advance(PROBE);
      w.probedAt = clock.now();
      await sync.syncOnce();
    }
    expect((await getBundle(db, missing.uuid))?.state).toBe("starting");
    await clock.advance(PROBE);
    w.probedAt = clock.now();
    await sync.syncOnce();

    const after = await getBundle(db, missing.uuid);
    expect(after?.state).toBe("staged");
    expect(after?.stateReason).toContain("did not appear on instance i-1");
    expect(queue.get(missing.uuid)?.state).toBe("staged");
    expect((await getBundle(db, listed.uuid))?.state).toBe("starting");
    expect(pool.kills).toEqual([]);
  });

  it("does not requeue a starting bundle while the pool's start of it is under way, nor on lists sent before it returned", async () => {
    const { clock, pool, queue, sync } = setup();
    const w = pool.add("i-1", clock.now());
    const b = await bundleIn("starting");
    queue.apply(b);
    // A slow hand-off or --detach: the claim is made, the start has not returned, probes go on.
    const r = runner(b.uuid, "starting", null);
    w.runners.set(b.uuid, r);
    for (let i = 0; i < 5; i++) {
      await sync.syncOnce();
      await clock.advance(PROBE);
      w.probedAt = clock.now();
    }
    expect((await getBundle(db, b.uuid))?.state).toBe("starting");
    // The start returns: from then on, as for any start (the grace, then two lists that miss it).
    w.runners.set(b.uuid, { ...r, detachedAt: clock.now() });
    await sync.syncOnce();
    for (let i = 0; i < 2; i++) {
      await clock.advance(PROBE);
      w.probedAt = clock.now();
      await sync.syncOnce();
    }
    expect((await getBundle(db, b.uuid))?.state).toBe("starting");
    await clock.advance(PROBE);
    w.probedAt = clock.now();
    await sync.syncOnce();
    expect((await getBundle(db, b.uuid))?.state).toBe("staged");
  });

  it("does not requeue a starting bundle while its worker is not probed again", async () => {
    const { clock, pool, queue, sync } = setup();
    pool.add("i-1", clock.now());
    const b = await bundleIn("starting");
    queue.apply(b);
    for (let i = 0; i < 5; i++) {
      await sync.syncOnce();
      await clock.advance(PROBE);
    }
    expect((await getBundle(db, b.uuid))?.state).toBe("starting");
  });

  it("requeues a starting bundle on an instance the pool does not know only staleLockTimeout after start-up", async () => {
    const { clock, queue, sync } = setup();
    const b = await bundleIn("starting", "i-unknown");
    queue.apply(b);
    await sync.syncOnce();
    await clock.advance(STALE - 1);
    await sync.syncOnce();
    expect((await getBundle(db, b.uuid))?.state).toBe("starting");
    await clock.advance(1);
    await sync.syncOnce();
    expect((await getBundle(db, b.uuid))?.state).toBe("staged");
  });

  it("loses a running bundle whose runner is gone (two probes agree): staged while attempts remain, else failed", async () => {
    const { clock, pool, queue, sync } = setup();
    const w = pool.add("i-1", clock.now());
    const again = await bundleIn("running");
    const last = await bundleIn("running", "i-1", 1);
    queue.apply(again);
    queue.apply(last);
    await sync.syncOnce(); // first probe without them: not yet
    expect((await getBundle(db, again.uuid))?.state).toBe("running");
    await clock.advance(PROBE);
    w.probedAt = clock.now();
    await sync.syncOnce();

    expect((await getBundle(db, again.uuid))?.state).toBe("staged");
    const failed = await getBundle(db, last.uuid);
    expect(failed?.state).toBe("failed");
    expect(failed?.stateReason).toBe("instance lost (attempts exhausted: 1 of 1)");
    const events = await listEvents(db, again.uuid);
    expect(events.at(-1)).toMatchObject({ fromState: "running", toState: "staged", actor: "dispatcher" });
    expect(queue.get(last.uuid)).toBeUndefined();
  });

  it("waits for an unprobed (unknown) instance, then keeps a bundle its first probe lists", async () => {
    const { clock, pool, queue, sync } = setup();
    const w = pool.add("i-1", null);
    const b = await bundleIn("running");
    queue.apply(b);
    for (let i = 0; i < 3; i++) {
      await sync.syncOnce();
      await clock.advance(PROBE);
    }
    w.probedAt = clock.now();
    w.runners.set(b.uuid, runner(b.uuid));
    await sync.syncOnce();
    expect((await getBundle(db, b.uuid))?.state).toBe("running");
  });

  it("loses a running bundle at once when its instance disappears", async () => {
    const { clock, pool, queue, sync } = setup();
    const w = pool.add("i-1", clock.now());
    const b = await bundleIn("running");
    queue.apply(b);
    w.runners.set(b.uuid, runner(b.uuid));
    await sync.syncOnce();
    pool.map.delete("i-1");
    await sync.syncOnce();
    expect((await getBundle(db, b.uuid))?.state).toBe("staged");
  });

  it("kills runners of killed, final, staged, unknown and elsewhere-running bundles, once each", async () => {
    const { clock, pool, queue, sync } = setup();
    const w = pool.add("i-1", clock.now());
    const killed = await bundleIn("killed");
    const staged = await bundleIn("staged");
    const elsewhere = await bundleIn("running", "i-2");
    const starting = await bundleIn("starting");
    queue.apply(staged);
    queue.apply(elsewhere);
    pool.add("i-2", clock.now()).runners.set(elsewhere.uuid, runner(elsewhere.uuid));
    const stranger = "zzzzz-bndl-000000000000000";
    for (const uuid of [killed.uuid, staged.uuid, elsewhere.uuid, stranger])
      w.runners.set(uuid, runner(uuid));
    // The pool is still starting this one; the queue has not seen it starting yet: leave it.
    w.runners.set(starting.uuid, runner(starting.uuid, "starting"));

    await sync.syncOnce();
    await sync.syncOnce();
    // Not before a later probe still lists them (a runner that just finished is gone by then).
    expect(pool.kills).toEqual([]);
    w.probedAt = clock.now() + 1;
    await sync.syncOnce();
    await sync.syncOnce();
    const killedOn1 = pool.kills.filter((k) => k.workerId === "i-1").map((k) => k.uuid);
    expect(killedOn1.sort()).toEqual([killed.uuid, staged.uuid, elsewhere.uuid, stranger].sort());
    expect(pool.kills.find((k) => k.uuid === staged.uuid)?.reason).toContain("staged");
    expect(pool.kills.some((k) => k.workerId === "i-2")).toBe(false);

    // Gone and back again: asked again.
    w.runners.delete(stranger);
    await sync.syncOnce();
    w.runners.set(stranger, runner(stranger));
    await sync.syncOnce();
    w.probedAt = clock.now() + 2;
    await sync.syncOnce();
    expect(pool.kills.filter((k) => k.uuid === stranger)).toHaveLength(2);
  });

  it("runs one operation at a time per bundle", async () => {
    const { clock, queue } = setup();
    let updates = 0;
    const counting: Db = {
      ...db,
      query: (sql, params) => {
        if (sql.includes("UPDATE bundles b SET")) updates++;
        return db.query(sql, params);
      },
    };
    const sync = createSync({
      queue,
      pool: new FakePool(),
      transitions: createBundleTransitions({ db: counting, queue, logger: pino({ enabled: false }) }),
      clock,
      logger: pino({ enabled: false }),
      config: testConfig(),
      startedAt: clock.now() - STALE,
    });
    const b = await bundleIn("running", "i-gone");
    queue.apply(b);
    await Promise.all([sync.syncOnce(), sync.syncOnce(), sync.syncOnce()]);
    expect(updates).toBe(1);
    expect((await getBundle(db, b.uuid))?.state).toBe("staged");
  });
});
