/**
 * The set-up of the placement tests (dispatcher/scheduler/*.test.ts): one runOnce() pass over an in-memory queue
 * and the stub pool (test/stub-pool.ts), on a fake clock, with a real PGlite store for status writes (the
 * bundles are not in it, so those writes touch no row). Call useSchedulerHarness() at a test file's top level:
 * it registers the hooks, and its fields are fresh for every test.
 */
import { afterAll, beforeAll, beforeEach } from "vitest";
import type { InstanceType } from "../cloud-drivers/types.ts";
import { defaultConfig } from "../config/load.ts";
import type { Config } from "../config/schema.ts";
import { createBundleTransitions } from "../dispatcher/queue/transitions.ts";
import { createScheduler, type Scheduler } from "../dispatcher/scheduler/scheduler.ts";
import type { Bundle } from "../store/types.ts";
import { openTestDb, type TestDb } from "./db.ts";
import { FakeClock } from "./fake-clock.ts";
import { silentLogger as logger } from "./fixtures.ts";
import { MemoryQueue, StubSchedulerPool } from "./stub-pool.ts";

export interface SchedulerConfigOver {
  maxRunningBundlesPerInstance?: number;
  maximumPriceFactor?: number;
  statusInterval?: number;
}

/** The default config with no RAM reserve, a loose price factor and a 2 s status interval, unless said. */
export function schedulerTestConfig(over: SchedulerConfigOver = {}): Config {
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

export interface SchedulerHarness {
  readonly db: TestDb;
  readonly clock: FakeClock;
  readonly pool: StubSchedulerPool;
  readonly queue: MemoryQueue;
  /** A scheduler over this test's queue and pool. */
  scheduler(types?: readonly InstanceType[], over?: SchedulerConfigOver): Scheduler;
  /** Puts bundles in the queue (staged) and returns them. */
  staged(...bundles: Bundle[]): Bundle[];
  /** [bundle uuid, worker id] of every start the pool was asked for, in order. */
  startedOn(): [string, string][];
}

export function useSchedulerHarness(defaultTypes: readonly InstanceType[]): SchedulerHarness {
  let db: TestDb | undefined;
  let clock = new FakeClock();
  let pool = new StubSchedulerPool(clock);
  let queue = new MemoryQueue(clock);
  beforeAll(async () => {
    db = await openTestDb("pglite");
  });
  afterAll(async () => {
    await db?.close();
  });
  beforeEach(() => {
    clock = new FakeClock(); // 2026-01-01T00:00:00Z
    pool = new StubSchedulerPool(clock);
    queue = new MemoryQueue(clock);
  });
  const opened = (): TestDb => {
    if (db === undefined) throw new Error("the scheduler harness's database is opened in beforeAll");
    return db;
  };
  return {
    get db() {
      return opened();
    },
    get clock() {
      return clock;
    },
    get pool() {
      return pool;
    },
    get queue() {
      return queue;
    },
    scheduler(types = defaultTypes, over = {}) {
      const d = opened();
      return createScheduler({
        queue,
        pool,
        transitions: createBundleTransitions({ db: d, queue, logger }),
        instanceTypes: types,
        config: schedulerTestConfig(over),
        db: d,
        clock,
        logger,
      });
    },
    staged(...bundles) {
      queue.set(...bundles);
      return bundles;
    },
    startedOn: () => pool.calls.start.map((s): [string, string] => [s.uuid, s.workerId]),
  };
}
