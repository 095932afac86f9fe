/**
 * The metric families of dispatcher/metrics.ts, pool/metrics.ts (instances, cost) and sshexec/metrics.ts:
 * every series at zero from start-up, and the values each family reads from the pool, the queue and the store.
 * (What each bundle is charged: test/bundle-cost.test.ts.)
 */
import { Registry } from "prom-client";
import { describe, expect, it } from "vitest";
import { getBundle } from "../store/queries.ts";
import { finishBundle, markRunning, stageBundle } from "../store/transitions.ts";
import type { Bundle, BundleState } from "../store/types.ts";
import { createTestBundle, createTestUser, startWithRunnerToken } from "../test/db.ts";
import { stubConfig, useTestDb } from "../test/dispatcher-harness.ts";
import { FakeClock, flushMicrotasks } from "../test/fake-clock.ts";
import { silentLogger as logger } from "../test/fixtures.ts";
import { MemoryQueue, testBundle } from "../test/stub-pool.ts";
import { instanceTypesFromConfig } from "./instance-types.ts";
import { createDispatcherMetrics, DISPATCHER_METRIC, type MetricParts } from "./metrics.ts";
import { categoryOf, createInstanceMetrics, INSTANCE_METRIC } from "./pool/metrics.ts";
import type { QueueChange } from "./queue/queue.ts";
import { createSshMetrics, SSH_METRIC } from "./sshexec/metrics.ts";
import type { RunnerView, WorkerState, WorkerView } from "./types.ts";

const HOUR = 3_600_000;

/** name -> (sorted label pairs -> value) of every series in the registry. */
async function series(registry: Registry): Promise<Map<string, Map<string, number>>> {
  const out = new Map<string, Map<string, number>>();
  for (const m of await registry.getMetricsAsJSON()) {
    for (const v of m.values as Array<{
      labels: Record<string, string | number>;
      value: number;
      metricName?: string;
    }>) {
      const name = v.metricName ?? m.name;
      const key = Object.entries(v.labels)
        .sort(([a], [b]) => a.localeCompare(b))
        .map(([k, x]) => `${k}=${x}`)
        .join(",");
      const map = out.get(name) ?? new Map<string, number>();
      map.set(key, v.value);
      out.set(name, map);
    }
  }
  return out;
}

function worker(init: {
  id: string;
  type: string;
  state: WorkerState;
  idleBehavior?: WorkerView["idleBehavior"];
  placeholder?: boolean;
  runners?: number;
  probedAt?: number | null;
  stateSince?: number;
}): WorkerView {
  const types = new Map(instanceTypesFromConfig(stubConfig()).map((t) => [t.name, t]));
  const runners = new Map<string, RunnerView>();
  for (let i = 0; i < (init.runners ?? 0); i++) {
    runners.set(`r${i}`, { uuid: `r${i}`, state: "running", gpuDevices: [], since: 0, detachedAt: 0 });
  }
  return {
    id: init.id,
    instanceType: types.get(init.type)!,
    state: init.state,
    idleBehavior: init.idleBehavior ?? "run",
    placeholder: init.placeholder ?? false,
    address: "10.0.0.1",
    runners,
    probedAt: init.probedAt ?? null,
    stateSince: init.stateSince ?? 0,
    lastBusy: 0,
    broken: false,
  };
}

describe("instance metrics (pool/metrics.ts)", () => {
  it("sorts instances into categories", () => {
    expect(
      categoryOf(worker({ id: "a", type: "small", state: "running", runners: 1, idleBehavior: "hold" })),
    ).toBe("inuse");
    expect(categoryOf(worker({ id: "b", type: "small", state: "idle", idleBehavior: "hold" }))).toBe("hold");
    expect(categoryOf(worker({ id: "c", type: "small", state: "booting" }))).toBe("booting");
    expect(categoryOf(worker({ id: "d", type: "small", state: "unknown" }))).toBe("unknown");
    expect(categoryOf(worker({ id: "e", type: "small", state: "shutdown" }))).toBe("shutdown");
    expect(categoryOf(worker({ id: "f", type: "small", state: "idle", idleBehavior: "drain" }))).toBe("idle");
  });

  it("sums price, vCPUs and memory by category, ages probes, accrues cost and keeps the concurrency peak", async () => {
    const clock = new FakeClock();
    const registry = new Registry();
    const t0 = clock.now();
    let list: WorkerView[] = [
      worker({ id: "i-small", type: "small", state: "idle", probedAt: t0 }),
      worker({ id: "i-medium", type: "medium", state: "running", runners: 2, probedAt: t0 }),
      worker({ id: "i-big", type: "big", state: "idle", idleBehavior: "hold", probedAt: t0 }),
      worker({ id: "creating-1", type: "gpu", state: "booting", placeholder: true, stateSince: t0 }),
      worker({ id: "i-gone", type: "gpu", state: "shutdown", probedAt: t0 }),
    ];
    const types = instanceTypesFromConfig(stubConfig());
    const m = createInstanceMetrics(registry, types, clock, () => list);
    m.update();
    await clock.advance(HOUR / 2);
    const s = await series(registry);
    expect(s.get(INSTANCE_METRIC.price)).toEqual(
      new Map([
        ["category=inuse", 0.2],
        ["category=hold", 0.8],
        ["category=booting", 1.2],
        ["category=unknown", 0],
        ["category=idle", 0.1],
        ["category=shutdown", 1.2],
      ]),
    );
    expect(s.get(INSTANCE_METRIC.vcpus)?.get("category=inuse")).toBe(4);
    expect(s.get(INSTANCE_METRIC.memory)?.get("category=hold")).toBe(64 * 2 ** 30);
    // Half an hour of each real instance; the placeholder costs nothing.
    const cost = s.get(INSTANCE_METRIC.cost)!;
    expect(cost.get("instance_type=small")).toBeCloseTo(0.05, 10);
    expect(cost.get("instance_type=medium")).toBeCloseTo(0.1, 10);
    expect(cost.get("instance_type=big")).toBeCloseTo(0.4, 10);
    expect(cost.get("instance_type=gpu")).toBeCloseTo(0.6, 10);
    // Probe ages over the 3 probed, not shut down instances: all 1800 s.
    expect(s.get(INSTANCE_METRIC.probeAgeMax)?.get("")).toBe(1800);
    expect(s.get(INSTANCE_METRIC.probeAgeMedian)?.get("")).toBe(1800);
    expect(s.get(INSTANCE_METRIC.bundlesRunning)?.get("")).toBe(2);
    expect(s.get(INSTANCE_METRIC.maxConcurrent)?.get("")).toBe(2);

    // The small one is forgotten after another half hour (noticed by update at a pool event); nothing runs.
    await clock.advance(HOUR / 2);
    list = list.filter((w) => w.id !== "i-small" && w.id !== "i-medium");
    m.update();
    await clock.advance(HOUR);
    const s2 = await series(registry);
    expect(s2.get(INSTANCE_METRIC.cost)?.get("instance_type=small")).toBeCloseTo(0.1, 10);
    expect(s2.get(INSTANCE_METRIC.cost)?.get("instance_type=medium")).toBeCloseTo(0.2, 10);
    expect(s2.get(INSTANCE_METRIC.cost)?.get("instance_type=big")).toBeCloseTo(1.6, 10);
    expect(s2.get(INSTANCE_METRIC.bundlesRunning)?.get("")).toBe(0);
    expect(s2.get(INSTANCE_METRIC.maxConcurrent)?.get("")).toBe(2);
  });

  it("accrues an instance's cost at the price its driver's history gives (spot prices), not the configured one", async () => {
    const clock = new FakeClock();
    const registry = new Registry();
    const t0 = clock.now();
    // The configured price of medium is 0.2; the spot market: 0.06 from launch, 0.09 after an hour.
    const history = [
      { startTime: t0 - HOUR, price: 0.06 },
      { startTime: t0 + HOUR, price: 0.09 },
    ];
    const spot: WorkerView = {
      ...worker({ id: "i-spot", type: "medium", state: "running", runners: 1, probedAt: t0 }),
      pricePerHour: (now) => history.filter((p) => p.startTime <= now).at(-1)?.price ?? 0.2,
    };
    const m = createInstanceMetrics(registry, instanceTypesFromConfig(stubConfig()), clock, () => [spot]);
    m.update();
    await clock.advance(HOUR);
    m.update();
    await clock.advance(HOUR);
    const cost = (await series(registry)).get(INSTANCE_METRIC.cost)?.get("instance_type=medium");
    expect(cost).toBeCloseTo(0.06 + 0.09, 10);
  });
});

describe("SSH command latency (sshexec/metrics.ts)", () => {
  it("observes every command and exchange by outcome", async () => {
    const clock = new FakeClock();
    const registry = new Registry();
    const wrap = createSshMetrics(registry, clock);
    const connect = wrap(() => ({
      async execute(command) {
        await clock.sleep(command === "slow" ? 2000 : 10);
        if (command === "broken") throw new Error("connection reset");
        return {
          stdout: Buffer.alloc(0),
          stderr: Buffer.alloc(0),
          exitCode: command === "false" ? 1 : 0,
          signal: null,
        };
      },
      async exchange() {
        return Buffer.from("ok");
      },
      async close() {},
    }));
    const exec = connect({} as never, "secret");
    const run = async (p: Promise<unknown>) => {
      const done = p.then(
        () => "ok",
        () => "error",
      );
      await clock.advance(2000);
      return done;
    };
    expect(await run(exec.execute("slow"))).toBe("ok");
    expect(await run(exec.execute("false"))).toBe("ok");
    expect(await run(exec.execute("broken"))).toBe("error");
    expect(await exec.exchange?.("/run/sock", "{}")).toEqual(Buffer.from("ok"));
    const s = (await series(registry)).get(`${SSH_METRIC}_count`)!;
    expect(s).toEqual(
      new Map([
        ["operation=execute,outcome=success", 1],
        ["operation=execute,outcome=nonzero", 1],
        ["operation=execute,outcome=error", 1],
        ["operation=exchange,outcome=success", 1],
        ["operation=exchange,outcome=nonzero", 0],
        ["operation=exchange,outcome=error", 0],
      ]),
    );
    const sum = (await series(registry)).get(`${SSH_METRIC}_sum`)!;
    expect(sum.get("operation=execute,outcome=success")).toBe(2);
  });
});

/** Dispatcher metrics watching a MemoryQueue (and a pool of no workers); `changed` plays the queue's events. */
function watchedMetrics(clock: FakeClock, isAtQuota: () => boolean = () => false) {
  const registry = new Registry();
  const m = createDispatcherMetrics({ registry, config: stubConfig(), clock, logger });
  const queue = new MemoryQueue(clock);
  const listeners = new Set<(changes: readonly QueueChange[]) => void>();
  const parts: MetricParts = {
    queue: Object.assign(queue, {
      subscribe(fn: (changes: readonly QueueChange[]) => void) {
        listeners.add(fn);
        return () => listeners.delete(fn);
      },
    }),
    pool: { workers: () => [], quota: () => ({ atQuota: isAtQuota() }), subscribe: () => () => {} },
  };
  /** The queue's typed events for these rows (from: the state the queue held). */
  const changed = (...rows: { bundle: Bundle; from: BundleState | null }[]) => {
    const changes = rows.map(({ bundle, from }) => ({ uuid: bundle.uuid, from, to: bundle.state, bundle }));
    for (const fn of listeners) fn(changes);
  };
  return { registry, queue, watch: () => m.watch(parts), changed };
}

describe("dispatcher metrics (dispatcher/metrics.ts)", () => {
  const getDb = useTestDb("pglite");

  it("has every series at zero before the dispatcher is active", async () => {
    const registry = new Registry();
    const config = stubConfig();
    createDispatcherMetrics({ registry, config, clock: new FakeClock(), logger });
    const s = await series(registry);
    expect(s.get(DISPATCHER_METRIC.bundles)).toEqual(
      new Map([
        ["state=staged", 0],
        ["state=starting", 0],
        ["state=running", 0],
      ]),
    );
    const entries = s.get(DISPATCHER_METRIC.queueEntries)!;
    expect(entries.size).toBe(3 * 5);
    expect([...entries.values()].every((v) => v === 0)).toBe(true);
    expect(entries.has("instance_type=none,state=staged")).toBe(true);
    expect(s.get(DISPATCHER_METRIC.atQuota)?.get("")).toBe(0);
    expect(s.get(DISPATCHER_METRIC.longestWait)?.get("")).toBe(0);
    expect(s.get(DISPATCHER_METRIC.bundlesFinished)).toEqual(
      new Map([
        ["state=ready", 0],
        ["state=failed", 0],
        ["state=killed", 0],
      ]),
    );
    expect(s.get(`${DISPATCHER_METRIC.queueToRunner}_count`)?.get("")).toBe(0);
    expect(s.get(DISPATCHER_METRIC.bundleCost)?.size).toBe(5);
    expect([...s.get(DISPATCHER_METRIC.bundleCost)!.values()].every((v) => v === 0)).toBe(true);
    expect(s.get(INSTANCE_METRIC.price)?.size).toBe(6);
    expect(s.get(INSTANCE_METRIC.cost)?.size).toBe(4);
    expect(s.get(`${SSH_METRIC}_count`)?.size).toBe(6);
  });

  it("reads the queue, the quota and the store while watching the active parts", async () => {
    const db = getDb();
    const clock = new FakeClock(Date.UTC(2025, 11, 1, 1));
    let atQuota = true;
    const { registry, queue, watch, changed } = watchedMetrics(clock, () => atQuota);
    // A real bundle in the store, run to ready below.
    const owner = (await createTestUser(db)).uuid;
    const stored = await createTestBundle(db, owner);
    await stageBundle(db, stored.uuid, { actor: "test" });
    const staged = (await getBundle(db, stored.uuid))!;
    const small = testBundle({ state: "staged", createdAt: new Date(clock.now() - 600_000) });
    const gpu = testBundle({ state: "staged", gpu: { deviceCount: 1 } });
    const huge = testBundle({ state: "staged", vcpus: 64 });
    queue.set(small, gpu, huge, staged);
    const stop = watch();

    let s = await series(registry);
    expect(s.get(DISPATCHER_METRIC.bundles)?.get("state=staged")).toBe(4);
    const entries = s.get(DISPATCHER_METRIC.queueEntries)!;
    expect(entries.get("instance_type=small,state=staged")).toBe(2);
    expect(entries.get("instance_type=gpu,state=staged")).toBe(1);
    expect(entries.get("instance_type=none,state=staged")).toBe(1);
    // The oldest staged bundle: `huge`, testBundle's createdAt is 2025-12-01 plus a few seconds.
    const oldest = Math.min(small.stagedAt!.getTime(), gpu.stagedAt!.getTime(), huge.stagedAt!.getTime());
    expect(s.get(DISPATCHER_METRIC.longestWait)?.get("")).toBe((clock.now() - oldest) / 1000);
    expect(s.get(DISPATCHER_METRIC.atQuota)?.get("")).toBe(1);
    atQuota = false;

    // The stored bundle starts (runningAt 90 s after stagedAt), then finishes.
    const running: Bundle = {
      ...staged,
      state: "running",
      attempt: 1,
      runningAt: new Date(staged.stagedAt!.getTime() + 90_000),
    };
    queue.set(running);
    changed({ bundle: running, from: "staged" });
    s = await series(registry);
    expect(s.get(`${DISPATCHER_METRIC.queueToRunner}_count`)?.get("")).toBe(1);
    expect(s.get(`${DISPATCHER_METRIC.queueToRunner}_sum`)?.get("")).toBe(90);
    expect(s.get(DISPATCHER_METRIC.bundles)?.get("state=running")).toBe(1);
    expect(s.get(DISPATCHER_METRIC.atQuota)?.get("")).toBe(0);
    changed({ bundle: running, from: "running" }); // seen again: not observed twice
    await startWithRunnerToken(db, stored.uuid);
    await markRunning(db, stored.uuid, 1, { actor: "runner" });
    const done = await finishBundle(db, stored.uuid, 1, { exitCode: 0, actor: "runner" });
    if (!done.ok) throw new Error("finish refused");
    queue.delete(stored.uuid);
    changed({ bundle: done.bundle, from: "running" });
    // A bundle that ran and ended between two reads of the queue (never seen running) counts too.
    const quick: Bundle = {
      ...done.bundle,
      uuid: "zzzzz-bndl-quickquickquick",
      attempt: 2,
      stagedAt: new Date(clock.now() - 30_000),
      runningAt: new Date(clock.now() - 20_000),
      finishedAt: new Date(clock.now()),
      state: "failed",
    };
    changed({ bundle: quick, from: null });
    // One that finished before the dispatcher watched (the queue's first read may show it) does not.
    changed({
      bundle: { ...quick, uuid: "zzzzz-bndl-oldoldoldoldold", finishedAt: new Date(0) },
      from: null,
    });
    s = await series(registry);
    expect(s.get(`${DISPATCHER_METRIC.queueToRunner}_count`)?.get("")).toBe(3);
    expect(s.get(DISPATCHER_METRIC.bundlesFinished)?.get("state=ready")).toBe(1);
    expect(s.get(DISPATCHER_METRIC.bundlesFinished)?.get("state=failed")).toBe(1);

    stop();
    s = await series(registry);
    expect(s.get(DISPATCHER_METRIC.bundles)?.get("state=staged")).toBe(0);
    await flushMicrotasks();
  });

  it("counts each rise of a bundle's cost once, on its attempt's instance type", async () => {
    const clock = new FakeClock(Date.UTC(2025, 11, 1, 1));
    const { registry, queue, watch, changed } = watchedMetrics(clock);
    const cost = async () => (await series(registry)).get(DISPATCHER_METRIC.bundleCost)!;
    // Charged before this dispatcher watched: not counted again.
    const earlier: Bundle = { ...testBundle({ state: "staged" }), costDollars: 0.3 };
    queue.set(earlier);
    const stop = watch();
    const base = testBundle({ state: "staged" });
    const at = (over: Partial<Bundle>): Bundle => ({ ...base, ...over });
    changed({ bundle: at({ state: "starting", attempt: 1, instanceType: "medium" }), from: "staged" });
    changed({ bundle: at({ state: "running", attempt: 1, instanceType: "medium" }), from: "starting" });
    // The instance is lost: the row has no type any more; the attempt's is remembered.
    changed({
      bundle: at({ state: "staged", attempt: 1, instanceType: null, costDollars: 0.5 }),
      from: "running",
    });
    // Seen again (a re-read): nothing new.
    changed({
      bundle: at({ state: "staged", attempt: 1, instanceType: null, costDollars: 0.5 }),
      from: "staged",
    });
    changed({
      bundle: at({ state: "running", attempt: 2, instanceType: "big", costDollars: 0.5 }),
      from: "staged",
    });
    changed({
      bundle: at({
        state: "ready",
        attempt: 2,
        instanceType: "big",
        costDollars: 0.9,
        finishedAt: new Date(clock.now()),
      }),
      from: "running",
    });
    // The earlier one's next attempt ends: only its own part counts.
    changed({
      bundle: {
        ...earlier,
        state: "killed",
        instanceType: "small",
        costDollars: 0.4,
        finishedAt: new Date(clock.now()),
      },
      from: "staged",
    });
    // One the queue never held, ended while watched: all of it; one that ended before: none.
    const quick = testBundle({ state: "failed" });
    changed({
      bundle: { ...quick, instanceType: "gpu", costDollars: 1.2, finishedAt: new Date(clock.now()) },
      from: null,
    });
    changed({
      bundle: {
        ...testBundle({ state: "ready" }),
        instanceType: "gpu",
        costDollars: 7,
        finishedAt: new Date(0),
      },
      from: null,
    });
    const c = await cost();
    expect(c.get("instance_type=medium")).toBeCloseTo(0.5, 10);
    expect(c.get("instance_type=big")).toBeCloseTo(0.4, 10);
    expect(c.get("instance_type=small")).toBeCloseTo(0.1, 10);
    expect(c.get("instance_type=gpu")).toBeCloseTo(1.2, 10);
    expect(c.get("instance_type=none")).toBe(0);
    stop();
  });
});
