import { pino } from "pino";
import { describe, expect, it } from "vitest";
import { DriverRegistry } from "../cloud-drivers/registry.ts";
import { stubDriver } from "../cloud-drivers/stub/driver.ts";
import type { StubVm } from "../cloud-drivers/stub/vm.ts";
import type { CloudDriver, InstanceSet } from "../cloud-drivers/types.ts";
import type { Dispatcher } from "../dispatcher/main.ts";
import { LOCK_RETRY_INTERVAL_MS } from "../dispatcher/main.ts";
import type { WorkerView } from "../dispatcher/types.ts";
import { isFinalState } from "../store/types.ts";
import type { DbKind } from "./db.ts";
import {
  createHarness,
  type Harness,
  overlaps,
  recordRunnerLives,
  settle,
  unexplainedLosses,
  useTestDb,
} from "./dispatcher-harness.ts";

const logger = pino({ level: process.env["DC_TEST_LOG"] ?? "silent" });

/** A stub driver whose instance sets count the creates they make (one count per dispatcher). */
function countingDrivers(): { drivers: DriverRegistry; creates: () => number } {
  let creates = 0;
  const driver: CloudDriver = {
    async instanceSet(...args) {
      const set = await stubDriver.instanceSet(...args);
      const counted: InstanceSet = {
        create: (...a) => {
          creates++;
          return set.create(...a);
        },
        instances: (filter) => set.instances(filter),
        quotaGroup: (t) => set.quotaGroup(t),
        stop: () => set.stop(),
      };
      return counted;
    },
  };
  return { drivers: new DriverRegistry().register("stub", driver), creates: () => creates };
}

const allFinal = (h: Harness, uuids: readonly string[]) => async () =>
  [...(await h.states(uuids)).values()].every(isFinalState);

/** A booted, healthy worker with at least one runner, other than `not`. */
function busyWorker(d: Dispatcher, not?: string): WorkerView | undefined {
  return d.parts?.pool
    .workers()
    .find(
      (w) => w.id !== not && !w.placeholder && !w.broken && w.state === "running" && w.idleBehavior === "run",
    );
}

for (const kind of ["pg", "pglite"] as DbKind[]) {
  describe(`dispatcher restart [${kind}]`, () => {
    const getDb = useTestDb(kind);

    it("a dispatcher killed mid-run is replaced; every bundle finishes exactly once; hold and drain survive", async () => {
      const h = await createHarness({
        db: getDb(),
        logger,
        cloud: {
          seed: 5,
          errorRateCreate: 0.1,
          errorRateDestroy: 0.1,
          runnerCrashRate: 0.05,
          bootDelay: 2000,
        },
        runners: { dieRate: 0.03, seed: 11 },
      });
      const lives = recordRunnerLives(h.cloud);
      const detaches: Array<{ vm: string; at: number }> = [];
      h.cloud.on("runner:detach", (vm: StubVm) => detaches.push({ vm: vm.id, at: h.clock.now() }));
      const first = await h.startDispatcher();
      const uuids = await h.submit(60, (i) => ({ command: ["sleep", String(1 + (i % 4))], maxAttempts: 20 }));

      // Mid-run: some bundles done, several running.
      await h.drive(async () => {
        const states = [...(await h.states(uuids)).values()];
        return (
          states.filter((s) => s === "ready").length >= 10 &&
          states.filter((s) => s === "running").length >= 6
        );
      });
      const held = busyWorker(first);
      const drained = busyWorker(first, held?.id);
      if (held === undefined || drained === undefined)
        throw new Error("no two busy workers to hold and drain");
      await first.parts?.pool.setIdleBehavior(held.id, "hold");
      await first.parts?.pool.setIdleBehavior(drained.id, "drain");
      const behaviourSetAt = h.clock.now();

      await first.kill();
      expect(first.active).toBe(false);
      // The cloud and the runners live on without a dispatcher for a while.
      for (let i = 0; i < 20; i++) {
        await h.clock.advance(250);
        await settle();
      }

      const second = await h.startDispatcher();
      expect(second.active).toBe(true);
      const pool = second.parts?.pool;
      expect(pool?.worker(held.id)?.idleBehavior).toBe("hold");
      if (pool?.worker(drained.id) !== undefined) expect(pool.worker(drained.id)?.idleBehavior).toBe("drain");

      await h.drive(allFinal(h, uuids), { maxMs: 30 * 60_000 });
      const states = await h.states(uuids);
      expect([...states.values()].filter((s) => s !== "ready")).toEqual([]);
      const mine = new Set(uuids);
      const events = (await h.events()).filter((e) => mine.has(e.bundleUuid));
      const finishes = new Map<string, number>();
      for (const e of events)
        if (e.toState === "ready") finishes.set(e.bundleUuid, (finishes.get(e.bundleUuid) ?? 0) + 1);
      expect(finishes.size).toBe(60);
      expect([...finishes.values()].every((n) => n === 1)).toBe(true);
      expect(overlaps(lives)).toEqual([]);
      expect(unexplainedLosses(events, h.runners)).toEqual([]);
      expect(h.runners.errors).toEqual([]);

      // Neither the held nor the drained instance got a new runner after its behaviour was set.
      expect(
        detaches.filter((d) => d.at > behaviourSetAt && (d.vm === held.id || d.vm === drained.id)),
      ).toEqual([]);
      // Past the idle timeout: everything is gone but the held instance, which keeps its tag.
      await h.drive(async () => h.cloud.liveCount === 1, { stallMs: 60_000, maxMs: 10 * 60_000 });
      const left = h.cloud.liveVms();
      expect(left.map((vm) => vm.id)).toEqual([held.id]);
      expect(Object.entries(left[0]?.tags ?? {})).toContainEqual(["DispatchCloudIdleBehavior", "hold"]);
      expect(h.cloud.vm(drained.id)?.destroyed ?? true).toBe(true);
      await h.close();
    }, 300_000);
  });
}

describe("dispatcher standby [pg]", () => {
  const getDb = useTestDb("pg");

  it("a second dispatcher waits, making no cloud calls, until the first is killed, then takes over", async () => {
    const h = await createHarness({ db: getDb(), logger, cloud: { seed: 9, bootDelay: 2000 } });
    const a = countingDrivers();
    const b = countingDrivers();
    const first = await h.startDispatcher({ drivers: a.drivers });
    const second = await h.startDispatcher({ drivers: b.drivers });
    expect(first.active).toBe(true);
    expect(second.active).toBe(false);
    const uuids = await h.submit(20, (i) => ({ command: ["sleep", String(3 + (i % 4))] }));
    await h.drive(async () => [...(await h.states(uuids)).values()].some((s) => s === "ready"));
    // Several lock retries have passed: still standby, no parts, no cloud calls.
    expect(second.active).toBe(false);
    expect(second.parts).toBeNull();
    expect(a.creates()).toBeGreaterThan(0);
    expect(b.creates()).toBe(0);

    await first.kill();
    const killedAt = h.clock.now();
    await h.drive(async () => second.active, { stallMs: 60_000 });
    expect(h.clock.now() - killedAt).toBeLessThanOrEqual(2 * LOCK_RETRY_INTERVAL_MS);

    await h.drive(allFinal(h, uuids), { maxMs: 30 * 60_000 });
    const states = await h.states(uuids);
    expect([...states.values()].filter((s) => s !== "ready")).toEqual([]);
    await h.close();
  }, 300_000);
});
