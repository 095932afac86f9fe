/**
 * The pool's metrics (ARVADOS-FACTS.md §3, a first few; issue 6 adds the rest). Every label combination is
 * present at zero from the start, so dashboards and alerts see series before the first event.
 */
import { Counter, Gauge, Histogram, type Registry } from "prom-client";
import type { InstanceType } from "../../cloud-drivers/types.ts";
import type { Clock } from "../../lib/clock.ts";
import { WORKER_STATES, type WorkerState, type WorkerView } from "../types.ts";

export const POOL_METRIC = {
  instances: "dispatchcloud_instances",
  bootOutcomes: "dispatchcloud_boot_outcomes_total",
  disappeared: "dispatchcloud_instances_disappeared_total",
  preempted: "dispatchcloud_instances_preempted_total",
  timeToSsh: "dispatchcloud_instance_time_to_ssh_seconds",
  timeToReady: "dispatchcloud_instance_time_to_ready_seconds",
} as const;

export const BOOT_OUTCOMES = ["success", "failure", "aborted", "disappeared"] as const;
export type BootOutcome = (typeof BOOT_OUTCOMES)[number];

const BOOT_BUCKETS = [5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 900, 1800];

export interface PoolMetrics {
  bootOutcome(outcome: BootOutcome): void;
  disappeared(state: WorkerState): void;
  /** An instance of this type reported a spot interruption notice (`--list` said preempted). */
  preempted(instanceType: string): void;
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
  const preempted = single(registry, POOL_METRIC.preempted, () => {
    return new Counter({
      name: POOL_METRIC.preempted,
      help: "Instances that reported a spot interruption notice (crunch-run --list said preempted), by instance type.",
      labelNames: ["instance_type"],
      registers: [registry],
    });
  });
  for (const name of typeNames) preempted.inc({ instance_type: name }, 0);
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
    preempted: (instanceType) => preempted.inc({ instance_type: instanceType }),
    timeToSsh: (ms) => ssh.observe(ms / 1000),
    timeToReady: (ms) => ready.observe(ms / 1000),
  };
}

function single<M>(registry: Registry, name: string, create: () => M): M {
  return (registry.getSingleMetric(name) as M | undefined) ?? create();
}

/**
 * How an instance counts in the by-category gauges (ARVADOS-FACTS.md §3 instances_total{category}): `inuse`
 * when a runner is on it, else `hold` when held, else its state (`booting`, `unknown`, `shutdown`), else
 * `idle`. Placeholders of creates in flight count as `booting`.
 */
export const INSTANCE_CATEGORIES = ["inuse", "hold", "booting", "unknown", "idle", "shutdown"] as const;
export type InstanceCategory = (typeof INSTANCE_CATEGORIES)[number];

export function categoryOf(w: WorkerView): InstanceCategory {
  if (w.runners.size > 0) return "inuse";
  if (w.idleBehavior === "hold") return "hold";
  if (w.state === "booting" || w.state === "unknown" || w.state === "shutdown") return w.state;
  return "idle";
}

export const INSTANCE_METRIC = {
  price: "dispatchcloud_instances_price_dollars_per_hour",
  vcpus: "dispatchcloud_instances_vcpus",
  memory: "dispatchcloud_instances_memory_bytes",
  cost: "dispatchcloud_instance_cost_dollars_total",
  probeAgeMax: "dispatchcloud_probe_age_seconds_max",
  probeAgeMedian: "dispatchcloud_probe_age_seconds_median",
  bundlesRunning: "dispatchcloud_bundles_running",
  maxConcurrent: "dispatchcloud_max_concurrent_bundles",
} as const;

export interface InstanceMetrics {
  /**
   * Accrues instance cost up to now and updates the max-concurrent gauge (called on pool events, so an
   * instance's last minutes before it is forgotten and short bursts of bundles are counted too).
   */
  update(): void;
}

/**
 * Collect-time metrics of the pool's instances: price, vCPUs and memory by category, probe age (max and median
 * over instances that exist in the cloud and are not shut down: seconds since their last successful probe, or
 * since they entered their state when never probed), runners on instances and the most seen at once, and
 * `dispatchcloud_instance_cost_dollars_total{instance_type}`: each instance's price (its driver's price history
 * when it has one, e.g. EC2 spot prices; else the configured price) x the time it was known to exist
 * (placeholders excluded), accrued at every scrape and pool event. `workers()` returns null while the
 * dispatcher is not active (every gauge reads 0).
 */
export function createInstanceMetrics(
  registry: Registry,
  types: readonly InstanceType[],
  clock: Clock,
  workers: () => readonly WorkerView[] | null,
): InstanceMetrics {
  const typeNames = types.map((t) => t.name);
  /** Per instance (by identity: an id may change once), its price and when its cost was last accrued. */
  const accrued = new Map<WorkerView, { type: string; price: number; at: number }>();
  let maxConcurrent = 0;
  const costCounter = single(
    registry,
    INSTANCE_METRIC.cost,
    () =>
      new Counter({
        name: INSTANCE_METRIC.cost,
        help: "Dollars spent on instances, by instance type: price per hour x the time each instance existed, accrued while the dispatcher is active.",
        labelNames: ["instance_type"],
        registers: [registry],
      }),
  );
  for (const name of typeNames) costCounter.inc({ instance_type: name }, 0);

  const running = (): number => {
    let n = 0;
    for (const w of workers() ?? []) n += w.runners.size;
    return n;
  };
  const update = (): void => {
    const now = clock.now();
    const seen = new Set<WorkerView>();
    for (const w of workers() ?? []) {
      if (w.placeholder) continue;
      seen.add(w);
      const a = accrued.get(w);
      // The price of the coming interval: spot prices follow the driver's price history.
      const price = w.pricePerHour?.(now) ?? w.instanceType.price;
      if (a === undefined) {
        accrued.set(w, { type: w.instanceType.name, price, at: now });
        continue;
      }
      if (now > a.at) costCounter.inc({ instance_type: a.type }, (a.price * (now - a.at)) / 3_600_000);
      a.at = now;
      a.price = price;
    }
    // Forgotten instances: billed up to the moment they were noticed gone (this call).
    for (const [w, a] of accrued) {
      if (seen.has(w)) continue;
      if (now > a.at) costCounter.inc({ instance_type: a.type }, (a.price * (now - a.at)) / 3_600_000);
      accrued.delete(w);
    }
    maxConcurrent = Math.max(maxConcurrent, running());
  };

  const byCategory = (name: string, help: string, value: (t: InstanceType) => number) => {
    registry.removeSingleMetric(name);
    new Gauge({
      name,
      help,
      labelNames: ["category"],
      registers: [registry],
      collect() {
        const sums = new Map<InstanceCategory, number>(INSTANCE_CATEGORIES.map((c) => [c, 0]));
        for (const w of workers() ?? []) {
          const c = categoryOf(w);
          sums.set(c, (sums.get(c) ?? 0) + value(w.instanceType));
        }
        for (const [category, v] of sums) this.set({ category }, v);
      },
    });
  };
  byCategory(
    INSTANCE_METRIC.price,
    "Summed hourly price of the instances, in dollars per hour, by category (inuse, hold, booting, unknown, idle, shutdown).",
    (t) => t.price,
  );
  byCategory(INSTANCE_METRIC.vcpus, "Summed vCPUs of the instances, by category.", (t) => t.vcpus);
  byCategory(INSTANCE_METRIC.memory, "Summed RAM of the instances, in bytes, by category.", (t) => t.ram);

  const gauge = (name: string, help: string, value: () => number) => {
    registry.removeSingleMetric(name);
    new Gauge({
      name,
      help,
      registers: [registry],
      collect() {
        this.set(value());
      },
    });
  };
  const probeAges = (): number[] => {
    const now = clock.now();
    const ages: number[] = [];
    for (const w of workers() ?? []) {
      if (w.placeholder || w.state === "shutdown") continue;
      ages.push(Math.max(0, now - (w.probedAt ?? w.stateSince)) / 1000);
    }
    return ages.sort((a, b) => a - b);
  };
  gauge(
    INSTANCE_METRIC.probeAgeMax,
    "Longest time since an instance's last successful probe (or since it entered its state, if never probed), in seconds.",
    () => probeAges().at(-1) ?? 0,
  );
  gauge(
    INSTANCE_METRIC.probeAgeMedian,
    "Median time since the instances' last successful probes, in seconds.",
    () => {
      const ages = probeAges();
      return ages[Math.floor(ages.length / 2)] ?? 0;
    },
  );
  gauge(
    INSTANCE_METRIC.bundlesRunning,
    "Runners on instances (bundles starting or running, as the pool sees them).",
    running,
  );
  gauge(
    INSTANCE_METRIC.maxConcurrent,
    "The most runners seen on instances at once since the dispatcher process started.",
    () => {
      maxConcurrent = Math.max(maxConcurrent, running());
      return maxConcurrent;
    },
  );
  // The cost counter accrues at scrape time: a collect hook on a gauge registered after it would run too
  // late, so the counter's own collect does it.
  (costCounter as unknown as { collect?: () => void }).collect = update;
  return { update };
}
