/**
 * `promtool check metrics` (Debian's `prometheus` package) on the Prometheus text of a dispatcher on the stub
 * cloud that has booted instances and run bundles to completion, and the values that run must have left.
 */
import { pino } from "pino";
import { Registry } from "prom-client";
import { describe, expect, it } from "vitest";
import { isFinalState } from "../store/types.ts";
import { createHarness, useTestDb } from "./dispatcher-harness.ts";
import { promtool } from "./promtool.ts";

const logger = pino({ level: process.env["DC_TEST_LOG"] ?? "silent" });

/** The value of one series in the exposition text (the line `name{labels} value`). */
function seriesValue(text: string, series: string): number {
  const line = text.split("\n").find((l) => l.startsWith(`${series} `));
  if (line === undefined) throw new Error(`no series ${series} in the metrics`);
  return Number(line.slice(series.length + 1));
}

describe("metrics of a dispatcher that has run bundles", () => {
  const getDb = useTestDb("pg");

  it("pass promtool check metrics and count the boots, bundles and cost", async () => {
    const h = await createHarness({ db: getDb(), logger });
    try {
      const registry = new Registry();
      const d = await h.startDispatcher({ registry });
      expect(d.active).toBe(true);
      const uuids = await h.submit(6, (i) => ({ command: ["sleep", String(1 + (i % 3))] }));
      await h.drive(async () => [...(await h.states(uuids)).values()].every(isFinalState));
      expect([...(await h.states(uuids)).values()]).toEqual(uuids.map(() => "ready"));
      // The queue has seen every bundle leave (the finished counter reads them back from the store).
      await h.drive(async () => {
        const text = await registry.metrics();
        return seriesValue(text, 'dispatchcloud_bundles_finished_total{state="ready"}') === 6;
      });

      const text = await registry.metrics();
      const check = promtool(text);
      expect(check.output).toBe("");
      expect(check.status).toBe(0);

      expect(seriesValue(text, 'dispatchcloud_boot_outcomes_total{outcome="success"}')).toBeGreaterThan(0);
      expect(seriesValue(text, "dispatchcloud_instance_time_to_ready_seconds_count")).toBeGreaterThan(0);
      expect(seriesValue(text, "dispatchcloud_bundle_queue_to_runner_seconds_count")).toBe(6);
      expect(seriesValue(text, "dispatchcloud_max_concurrent_bundles")).toBeGreaterThan(0);
      expect(seriesValue(text, 'dispatchcloud_bundles{state="staged"}')).toBe(0);
      expect(
        seriesValue(
          text,
          'dispatchcloud_ssh_command_duration_seconds_count{operation="execute",outcome="success"}',
        ),
      ).toBeGreaterThan(0);
      expect(
        seriesValue(
          text,
          'dispatchcloud_driver_operations_total{driver="stub",operation="create",error="0"}',
        ),
      ).toBeGreaterThan(0);
      const cost = ["small", "medium", "big", "gpu"].reduce(
        (sum, t) =>
          sum + seriesValue(text, `dispatchcloud_instance_cost_dollars_total{instance_type="${t}"}`),
        0,
      );
      expect(cost).toBeGreaterThan(0);
      // Every family of DESIGN.md §10 is there.
      for (const name of [
        "dispatchcloud_instances",
        "dispatchcloud_instances_price_dollars_per_hour",
        "dispatchcloud_instances_vcpus",
        "dispatchcloud_instances_memory_bytes",
        "dispatchcloud_instances_disappeared_total",
        "dispatchcloud_instance_time_to_ssh_seconds",
        "dispatchcloud_driver_operation_duration_seconds",
        "dispatchcloud_at_quota",
        "dispatchcloud_queue_entries",
        "dispatchcloud_queue_longest_wait_seconds",
        "dispatchcloud_probe_age_seconds_max",
        "dispatchcloud_probe_age_seconds_median",
        "dispatchcloud_bundles_running",
      ]) {
        expect(text).toContain(`# TYPE ${name} `);
      }
    } finally {
      await h.close();
    }
  });
});
