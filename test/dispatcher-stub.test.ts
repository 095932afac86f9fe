import { pino } from "pino";
import { describe, expect, it } from "vitest";
import { isFinalState } from "../store/types.ts";
import {
  createHarness,
  GiB,
  overlaps,
  recordRunnerLives,
  runningIntervals,
  stubConfig,
  unexplainedLosses,
  useTestDb,
} from "./dispatcher-harness.ts";

const logger = pino({ level: process.env["DC_TEST_LOG"] ?? "silent" });

for (const kind of ["pg", "pglite"] as const)
  describe(`dispatcher on the stub driver [${kind}]`, () => {
    const getDb = useTestDb(kind);

    it("runs a few bundles to completion and leaves no instance after the idle timeout", async () => {
      const h = await createHarness({ db: getDb(), logger });
      const lives = recordRunnerLives(h.cloud);
      const d = await h.startDispatcher();
      expect(d.active).toBe(true);
      const uuids = await h.submit(6, (i) => ({ command: ["sleep", String(1 + (i % 4))] }));
      await h.drive(async () => [...(await h.states(uuids)).values()].every(isFinalState));
      const states = await h.states(uuids);
      expect([...states.values()]).toEqual(uuids.map(() => "ready"));
      expect(overlaps(lives)).toEqual([]);
      expect(h.runners.errors).toEqual([]);
      await h.drive(async () => h.cloud.liveCount === 0, { stallMs: 30_000 });
      expect([...runningIntervals(await h.events()).values()].every((l) => l.length === 1)).toBe(true);
      await h.close();
    });

    it("200 bundles through create and destroy failures, quota, capacity, broken VMs and crashing runners", async () => {
      const config = stubConfig(`  cap: {vcpus: 2, ram: 4GiB, includedScratch: 50GiB, price: 0.09}\n`);
      const h = await createHarness({
        db: getDb(),
        logger,
        config,
        cloud: {
          seed: 42,
          errorRateCreate: 0.15,
          errorRateDestroy: 0.1,
          quotaMaxInstances: 10,
          capacityErrors: { instanceTypes: new Set(["cap"]) },
          // Every 7th VM: broken (--list says so) or never passing its boot probe, alternately.
          broken: (vm) => vm.serial % 14 === 7,
          neverBoot: (vm) => vm.serial % 14 === 0,
          runnerCrashRate: 0.05,
          bootDelay: 2000,
        },
        runners: { dieRate: 0.05, seed: 3 },
      });
      const lives = recordRunnerLives(h.cloud);
      await h.startDispatcher();
      const uuids = await h.submit(200, (i) => ({
        command: ["sleep", String(1 + (i % 5))],
        maxAttempts: 20,
        priority: i % 3,
        resources:
          i % 10 === 9
            ? {
                vcpus: 1,
                ram: 2 * GiB,
                scratch: GiB,
                gpu: { stack: "cuda", deviceCount: 1, vram: 0, driverVersion: null, hardwareTarget: [] },
              }
            : i % 10 === 8
              ? { vcpus: 3, ram: 6 * GiB, scratch: GiB, gpu: null }
              : { vcpus: 1, ram: GiB, scratch: GiB, gpu: null },
      }));
      // A stall is longer than timeoutBooting (15 s): the last bundle left may be a GPU one planned on a VM that
      // never boots, and nothing else happens until that VM's boot times out.
      await h.drive(async () => [...(await h.states(uuids)).values()].every(isFinalState), {
        maxMs: 60 * 60_000,
        stallMs: 20_000,
      });

      const states = await h.states(uuids);
      const counts: Record<string, number> = {};
      for (const s of states.values()) counts[s] = (counts[s] ?? 0) + 1;
      expect(counts).toEqual({ ready: 200 });
      expect(h.runners.errors).toEqual([]);
      // Never on two instances at once: from the event log, per bundle, attempts' running intervals do not
      // overlap and each ends before the next starts; from the cloud, no two runner lives on different VMs.
      const mine = new Set(uuids);
      const events = (await h.events()).filter((e) => mine.has(e.bundleUuid));
      for (const [uuid, list] of runningIntervals(events)) {
        for (let i = 1; i < list.length; i++) {
          expect(list[i - 1]!.to, uuid).toBeLessThan(list[i]!.from);
          expect(list[i - 1]!.attempt, uuid).toBeLessThan(list[i]!.attempt);
        }
      }
      expect(overlaps(lives)).toEqual([]);
      expect(unexplainedLosses(events, h.runners)).toEqual([]);
      // Exactly one finish per bundle.
      const finishes = events.filter((e) => e.toState === "ready");
      expect(finishes).toHaveLength(200);
      // The faults did happen.
      expect(h.cloud.counts.create["cloud.capacity"] ?? 0).toBeGreaterThan(0);
      expect(h.cloud.counts.create["cloud.error"] ?? 0).toBeGreaterThan(0);
      expect(h.cloud.counts.destroy["cloud.error"] ?? 0).toBeGreaterThan(0);
      expect(h.runners.log.some((e) => e.event === "died")).toBe(true);
      expect(events.some((e) => e.fromState === "running" && e.toState === "staged")).toBe(true);
      expect(events.some((e) => e.fromState === "starting" && e.toState === "staged")).toBe(true);

      await h.drive(async () => h.cloud.liveCount === 0, { stallMs: 60_000, maxMs: 10 * 60_000 });
      await h.close();
    }, 300_000);
  });
