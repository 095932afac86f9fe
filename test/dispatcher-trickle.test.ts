/**
 * A trickle of short bundles after a burst: the fleet the burst booted shrinks to what the trickle needs. Each
 * bundle ends before the next comes, so every instance is equally free when one arrives; the scheduler must
 * not spread them over the idle instances (which would keep each of them from its idle timeout), but put them
 * where the usual order says, so the instances the trickle does not need go after timeoutIdle.
 */
import { pino } from "pino";
import { describe, expect, it } from "vitest";
import { isFinalState } from "../store/types.ts";
import { createHarness, stubConfig, useTestDb } from "./dispatcher-harness.ts";

const logger = pino({ level: process.env["DC_TEST_LOG"] ?? "silent" });

for (const kind of ["pg", "pglite"] as const)
  describe(`a trickle after a burst [${kind}]`, () => {
    const getDb = useTestDb(kind);

    it("runs on one instance and lets the others go idle and shut down", async () => {
      const config = stubConfig();
      const h = await createHarness({
        db: getDb(),
        logger,
        config: {
          ...config,
          // The product's defaults for both: a runner whose bundle ended is seen gone at the next probe.
          cloud: { ...config.cloud, probeInterval: 10_000, timeoutIdle: 60_000 },
        },
      });
      await h.startDispatcher();
      // One bundle fills a `small` instance (2 vCPUs): the burst boots four.
      const whole = { vcpus: 2, ram: 2 ** 30, scratch: 2 ** 30, gpu: null };
      const burst = await h.submit(4, () => ({ command: ["sleep", "5"], resources: whole }));
      await h.drive(async () => [...(await h.states(burst)).values()].every(isFinalState), {
        stallMs: 30_000,
      });
      expect(h.cloud.liveCount).toBe(4);

      // Then, for three minutes, one bundle (done in about 1 s) 2 s after the dispatcher's queue saw the last one
      // end: past CLEANING_UP_MS, well within probeInterval.
      const queue = h.active()!.parts!.queue;
      const usedAt: Array<{ at: number; instance: string }> = [];
      const until = h.clock.now() + 180_000;
      while (h.clock.now() < until) {
        const [uuid] = await h.submit(1, () => ({ command: ["sleep", "1"], resources: whole }));
        await h.drive(async () => queue.endedAt(uuid!) !== undefined, { stallMs: 30_000 });
        const { rows } = await h.db.query<{ instance_id: string }>(
          "SELECT instance_id FROM bundles WHERE uuid = $1",
          [uuid],
        );
        usedAt.push({ at: h.clock.now(), instance: rows[0]!.instance_id });
        const next = queue.endedAt(uuid!)! + 2000;
        await h.drive(async () => h.clock.now() >= next, { stallMs: 30_000 });
      }
      // Before CLEANING_UP_MS, each bundle went to an instance where none had ended since its last probe: the
      // trickle went round all four, and all four were still up after the three minutes.
      const lastMinute = new Set(usedAt.filter((u) => u.at >= until - 60_000).map((u) => u.instance));
      expect([...lastMinute]).toHaveLength(1);
      expect(h.cloud.liveCount).toBe(1);
      await h.close();
    }, 120_000);
  });
