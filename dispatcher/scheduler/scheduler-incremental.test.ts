/**
 * The incremental pass against a full one: a scheduler that looks only at what the queue says changed, keeps
 * the workers' room until one of their runners or its row changes, and does not visit the tail of the queue
 * after the point where the pass stops placing, must make the same starts, plans, creates and shutdowns, and
 * give every staged bundle the same status sentence, as one with `fullPasses` (the whole queue read, every room
 * recomputed and every bundle visited, each pass). Two identical worlds (stub pool and in-memory queue, the same
 * rows) get the same changes; "incremental" and "full" each keep their scheduler across passes (plans on booting
 * instances are kept from pass to pass in both).
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { mulberry32 } from "../../cloud-drivers/stub/driver.ts";
import { defaultConfig } from "../../config/load.ts";
import type { Config } from "../../config/schema.ts";
import type { Bundle } from "../../store/types.ts";
import { openTestDb, type TestDb } from "../../test/db.ts";
import { FakeClock } from "../../test/fake-clock.ts";
import { silentLogger as logger, testInstanceType } from "../../test/fixtures.ts";
import { MemoryQueue, StubSchedulerPool, testBundle } from "../../test/stub-pool.ts";
import { createBundleTransitions } from "../queue/transitions.ts";
import { createScheduler, type PassResult, type Scheduler } from "./scheduler.ts";

const small = testInstanceType("small", { vcpus: 4, ramGiB: 16, price: 0.1, providerType: "m5.xlarge" });
const large = testInstanceType("large", { vcpus: 16, ramGiB: 64, price: 0.4, providerType: "c5.4xlarge" });
const gpu4 = testInstanceType("gpu4", {
  vcpus: 16,
  ramGiB: 64,
  price: 3,
  gpu: { stack: "cuda", driverVersion: "12.4", hardwareTarget: "8.0", deviceCount: 4, vram: 40 * 2 ** 30 },
});
const TYPES = [small, large, gpu4];

function testConfig(): Config {
  const c = defaultConfig();
  return {
    ...c,
    dispatcher: {
      ...c.dispatcher,
      reserveExtraRam: 0,
      maximumPriceFactor: 100,
      schedulingStatusInterval: 2000,
    },
    cloud: { ...c.cloud, maxRunningBundlesPerInstance: 0 },
  };
}

let db: TestDb;
beforeAll(async () => {
  db = await openTestDb("pglite");
});
afterAll(async () => {
  await db?.close();
});

interface World {
  clock: FakeClock;
  pool: StubSchedulerPool;
  queue: MemoryQueue;
  scheduler: Scheduler;
}

function world(fullPasses: boolean): World {
  const clock = new FakeClock();
  const w = { clock, pool: new StubSchedulerPool(clock), queue: new MemoryQueue(clock) };
  return { ...w, scheduler: newScheduler(w, fullPasses) };
}

function newScheduler(w: Omit<World, "scheduler">, fullPasses: boolean): Scheduler {
  return createScheduler({
    queue: w.queue,
    pool: w.pool,
    transitions: createBundleTransitions({ db, queue: w.queue, logger }),
    instanceTypes: TYPES,
    config: testConfig(),
    db,
    clock: w.clock,
    logger,
    fullPasses,
  });
}

/** Both worlds, and a pass in each that must agree. */
function twins() {
  const kept = world(false);
  const full = world(true);
  const both = (fn: (w: World) => void) => {
    fn(kept);
    fn(full);
  };
  /** What a pass did and what every staged bundle's sentence then is. */
  const passIn = async (w: World) => {
    const from = w.pool.calls.start.length;
    const r: PassResult = await w.scheduler.runOnce();
    const statuses: Record<string, string | undefined> = {};
    for (const b of w.queue.all()) if (b.state === "staged") statuses[b.uuid] = w.scheduler.statusOf(b.uuid);
    return {
      result: r,
      starts: w.pool.calls.start.slice(from),
      statuses,
      shutdown: [...w.pool.calls.shutdown],
    };
  };
  const pass = async () => {
    const a = await passIn(kept);
    const b = await passIn(full);
    expect(a).toEqual(b);
    return a;
  };
  return { kept, both, pass };
}

/** The pool refused the starts of the last pass (its claim lost): the runners are dropped again. */
function refuse(w: World, starts: readonly { workerId: string; uuid: string }[]): void {
  for (const s of starts) w.pool.removeRunner(s.workerId, s.uuid);
}

describe("the incremental pass makes the same starts and says the same as a full pass", () => {
  it("after starts refused, an instance freed, quota, cancels, priority changes and new bundles", async () => {
    const { both, pass } = twins();
    const running = [testBundle({ vcpus: 4, state: "running" }), testBundle({ vcpus: 2, state: "running" })];
    const waiting = Array.from({ length: 40 }, (_, i) =>
      testBundle({
        vcpus: [1, 2, 4, 12][i % 4]!,
        priority: 100 * (i % 3),
        ...(i % 7 === 0 ? { gpu: { deviceCount: 1 } } : {}),
      }),
    );
    both((w) => {
      w.queue.set(...running, ...waiting);
      w.pool.maxInstances = 6;
      w.pool.addWorker({ id: "i-busy", type: small, runners: [running[0]!.uuid] });
      w.pool.addWorker({ id: "i-half", type: large, runners: [running[1]!.uuid] });
      w.pool.addWorker({ id: "i-idle", type: small });
      w.pool.addWorker({ id: "i-boot", type: large, state: "booting" });
      w.pool.addWorker({ id: "i-held", type: gpu4, idleBehavior: "hold" });
    });

    const first = await pass();
    expect(first.starts.length).toBeGreaterThan(0);
    expect(first.result.waiting).toBeGreaterThan(20);
    expect(Object.values(first.statuses).some((s) => s?.includes("at quota: 6 of 6 instances"))).toBe(true);

    // Every start refused: the runners are dropped, nothing else changes; the same bundles start again.
    both((w) => refuse(w, first.starts));
    const again = await pass();
    expect(again.starts).toEqual(first.starts);
    both((w) => refuse(w, again.starts));
    await pass();

    // An instance freed: its running bundle finished.
    both((w) => {
      w.queue.apply({ ...running[0]!, state: "ready", changeSeq: running[0]!.changeSeq + 1 });
      w.pool.removeRunner("i-busy", running[0]!.uuid);
    });
    await pass();

    // A bundle finished whose runner is still listed (cleaning up): its instance has room once the queue says so.
    both((w) => w.queue.apply({ ...running[1]!, state: "ready", changeSeq: running[1]!.changeSeq + 1 }));
    const cleaning = await pass();

    // The booting instance with bundles planned on it disappears.
    expect(Object.values(cleaning.statuses).some((s) => s?.includes("i-boot"))).toBe(true);
    both((w) => w.pool.removeWorker("i-boot"));
    const gone = await pass();
    expect(Object.values(gone.statuses).some((s) => s?.includes("i-boot"))).toBe(false);

    // Quota raised: the pass creates again.
    both((w) => {
      w.pool.maxInstances = 9;
    });
    const raised = await pass();
    expect(raised.result.created.length).toBeGreaterThan(0);

    // A bundle cancelled at the head and one deep in the tail.
    const tailOne = waiting[39]!;
    const head = Object.keys(raised.statuses)[0]!;
    both((w) => {
      w.queue.apply({ ...w.queue.get(head)!, state: "killed", changeSeq: 10_000 });
      w.queue.apply({ ...tailOne, state: "killed", changeSeq: tailOne.changeSeq + 1 });
    });
    const cancelled = await pass();
    expect(cancelled.statuses[tailOne.uuid]).toBeUndefined();

    // Priorities changed: a tail bundle to the front, a front one to the back.
    const up = waiting[38]!;
    const down = waiting[1]!;
    both((w) => {
      w.queue.apply({ ...up, priority: 1000, changeSeq: up.changeSeq + 1 });
      w.queue.apply({ ...down, priority: 0, changeSeq: down.changeSeq + 1 });
    });
    await pass();

    // New bundles: one ahead of everything, some at the back, one no type can fit, one with attempts used up.
    const newcomers = [
      testBundle({ vcpus: 1, priority: 999 }),
      testBundle({ vcpus: 2, priority: 0 }),
      testBundle({ vcpus: 2, priority: 0 }),
      testBundle({ vcpus: 1000, priority: 0 }),
      { ...testBundle({ vcpus: 1, priority: 0 }), attempt: 3 },
    ];
    both((w) => w.queue.set(...newcomers));
    const arrived = await pass();
    expect(arrived.statuses[newcomers[0]!.uuid]).not.toMatch(/position [1-9]\d+:/);

    // The quota reached again, then a held instance put to work and the rest refused once more.
    both((w) => {
      w.pool.maxInstances = 0;
    });
    const stopped = await pass();
    both((w) => {
      refuse(w, stopped.starts);
      w.pool.update("i-held", { idleBehavior: "run" });
    });
    await pass();
  });

  it("with locality: caches that change between passes, bundles with and without inputs", async () => {
    const { both, pass } = twins();
    const d = (c: string) => `${c.repeat(64)}/1`;
    const GiB = 2 ** 30;
    const bundles = Array.from({ length: 24 }, (_, i) =>
      testBundle({
        vcpus: [1, 2, 4][i % 3]!,
        priority: 100 * (i % 2),
        ...(i % 4 === 3 ? {} : { inputs: [{ digest: d("abc"[i % 3]!), bytes: (1 + (i % 5)) * GiB }] }),
      }),
    );
    both((w) => {
      w.queue.set(...bundles);
      w.pool.maxInstances = 5;
      w.pool.addWorker({ id: "i-1", type: small });
      w.pool.addWorker({ id: "i-2", type: small, cached: [d("a")] });
      w.pool.addWorker({ id: "i-3", type: large, cached: [d("b"), d("c")] });
      w.pool.addWorker({ id: "i-4", type: small, cached: [d("c")] });
    });
    const first = await pass();
    expect(first.starts.some((s) => s.placement !== undefined)).toBe(true);
    both((w) => refuse(w, first.starts));
    both((w) => {
      w.pool.setCached("i-1", [d("b"), d("a")]);
      w.pool.setCached("i-2", []);
    });
    const second = await pass();
    expect(second.starts.length).toBeGreaterThan(0);
    both((w) => refuse(w, second.starts));
    both((w) => w.pool.removeWorker("i-4"));
    await pass();
  });

  it("over a seeded random run of changes", async () => {
    const { kept, both, pass } = twins();
    const r = mulberry32(21);
    const pick = <T>(xs: readonly T[]): T => xs[Math.floor(r() * xs.length)]!;
    const shapes = [
      { vcpus: 1 },
      { vcpus: 2 },
      { vcpus: 4, ramGiB: 12 },
      { vcpus: 12 },
      { vcpus: 2, gpu: { deviceCount: 1 } },
      { vcpus: 500 },
    ];
    const newBundle = () => testBundle({ ...pick(shapes), priority: Math.floor(r() * 5) * 100 });
    both((w) => {
      w.pool.maxInstances = 5;
      w.pool.addWorker({ id: "i-a", type: small });
      w.pool.addWorker({ id: "i-b", type: large });
      w.pool.addWorker({ id: "i-g", type: gpu4, idleBehavior: "hold" });
    });
    const initial = Array.from({ length: 60 }, newBundle);
    both((w) => w.queue.set(...initial));
    let last = await pass();
    let seq = 1_000_000;
    for (let step = 0; step < 60; step++) {
      const staged = [...kept.queue.all()].filter((b) => b.state === "staged");
      const roll = r();
      let change: (w: World) => void;
      if (roll < 0.3) {
        // The starts of the last pass refused (or, half the time, accepted: the bundle runs).
        const accept = r() < 0.5;
        const starts = last.starts;
        change = (w) => {
          for (const s of starts) {
            const b = w.queue.get(s.uuid)!;
            if (accept) w.queue.apply({ ...b, state: "running", changeSeq: b.changeSeq + 1 });
            else w.pool.removeRunner(s.workerId, s.uuid);
          }
        };
      } else if (roll < 0.45) {
        // A running bundle finishes: its instance has room again (its runner gone, or still cleaning up).
        const done = [...kept.queue.all()].find((b) => b.state === "running");
        if (done === undefined) continue;
        const on = kept.pool.workers().find((w) => w.runners.has(done.uuid))!.id;
        const cleaning = r() < 0.5;
        change = (w) => {
          w.queue.apply({ ...done, state: "ready", changeSeq: ++seq });
          if (!cleaning) w.pool.removeRunner(on, done.uuid);
        };
      } else if (roll < 0.55) {
        const max = Math.floor(r() * 8);
        change = (w) => {
          w.pool.maxInstances = max;
        };
      } else if (roll < 0.65 && staged.length > 0) {
        const gone = pick(staged);
        change = (w) => w.queue.apply({ ...gone, state: "killed", changeSeq: ++seq });
      } else if (roll < 0.8 && staged.length > 0) {
        const moved = pick(staged);
        const priority = Math.floor(r() * 5) * 100 + 50;
        change = (w) => w.queue.apply({ ...moved, priority, changeSeq: ++seq });
      } else if (roll < 0.9) {
        const placeholder = kept.pool.workers().find((w) => w.placeholder);
        if (placeholder === undefined) continue;
        const id = placeholder.id;
        const state = r() < 0.5 ? "idle" : "booting";
        change = (w) => void w.pool.boot(id, { newId: `i-${id}`, state });
      } else {
        const more: Bundle[] = Array.from({ length: 1 + Math.floor(r() * 6) }, newBundle);
        change = (w) => w.queue.set(...more);
      }
      both(change);
      last = await pass();
    }
  });
});
