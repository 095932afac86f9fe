/**
 * The pool's metrics (ARVADOS-FACTS.md §3, a first few; issue 6 adds the rest). Every label combination is
 * present at zero from the start, so dashboards and alerts see series before the first event.
 */
import { Counter, Gauge, Histogram, type Registry } from "prom-client";
import type { InstanceType } from "../../cloud-drivers/types.ts";
import { WORKER_STATES, type WorkerState } from "../types.ts";

export const POOL_METRIC = {
  instances: "dispatchcloud_instances",
  bootOutcomes: "dispatchcloud_boot_outcomes_total",
  disappeared: "dispatchcloud_instances_disappeared_total",
  timeToSsh: "dispatchcloud_instance_time_to_ssh_seconds",
  timeToReady: "dispatchcloud_instance_time_to_ready_seconds",
} as const;

export const BOOT_OUTCOMES = ["success", "failure", "aborted", "disappeared"] as const;
export type BootOutcome = (typeof BOOT_OUTCOMES)[number];

const BOOT_BUCKETS = [5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 900, 1800];

export interface PoolMetrics {
  bootOutcome(outcome: BootOutcome): void;
  disappeared(state: WorkerState): void;
  timeToSsh(ms: number): void;
  timeToReady(ms: number): void;
}

/**
 * Registers the pool's metrics. `count()` is called at scrape time for the instances gauge (state and type of
 * every worker); the gauge is re-registered so it reads the newest pool of the registry.
 */
export function createPoolMetrics(
  registry: Registry,
  types: readonly InstanceType[],
  count: () => Iterable<{ state: WorkerState; instanceType: string }>,
): PoolMetrics {
  const typeNames = types.map((t) => t.name);
  registry.removeSingleMetric(POOL_METRIC.instances);
  new Gauge({
    name: POOL_METRIC.instances,
    help: "Instances the dispatcher knows, by state and instance type (placeholders for creates in flight count as booting).",
    labelNames: ["state", "instance_type"],
    registers: [registry],
    collect() {
      this.reset();
      for (const state of WORKER_STATES) {
        for (const name of typeNames) this.set({ state, instance_type: name }, 0);
      }
      for (const w of count()) this.inc({ state: w.state, instance_type: w.instanceType });
    },
  });
  const boot = single(registry, POOL_METRIC.bootOutcomes, () => {
    return new Counter({
      name: POOL_METRIC.bootOutcomes,
      help: "Boots of instances this dispatcher created, by outcome.",
      labelNames: ["outcome"],
      registers: [registry],
    });
  });
  for (const outcome of BOOT_OUTCOMES) boot.inc({ outcome }, 0);
  const gone = single(registry, POOL_METRIC.disappeared, () => {
    return new Counter({
      name: POOL_METRIC.disappeared,
      help: "Instances that vanished from the cloud's list without being shut down by us, by their last state.",
      labelNames: ["state"],
      registers: [registry],
    });
  });
  for (const state of WORKER_STATES) gone.inc({ state }, 0);
  const histogram = (name: string, help: string) =>
    single(registry, name, () => new Histogram({ name, help, buckets: BOOT_BUCKETS, registers: [registry] }));
  const ssh = histogram(
    POOL_METRIC.timeToSsh,
    "Time from the create call to the first command answered, in seconds.",
  );
  const ready = histogram(
    POOL_METRIC.timeToReady,
    "Time from the create call to ready for bundles (runner deployed, --list ok), in seconds.",
  );
  return {
    bootOutcome: (outcome) => boot.inc({ outcome }),
    disappeared: (state) => gone.inc({ state }),
    timeToSsh: (ms) => ssh.observe(ms / 1000),
    timeToReady: (ms) => ready.observe(ms / 1000),
  };
}

function single<M>(registry: Registry, name: string, create: () => M): M {
  return (registry.getSingleMetric(name) as M | undefined) ?? create();
}
