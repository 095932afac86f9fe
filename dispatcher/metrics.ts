/**
 * The dispatcher's own metrics (DESIGN.md §10, ARVADOS-FACTS.md §3): the queue as the dispatcher sees it,
 * quota, queue-to-runner time and final states seen, plus the instance gauges and cost of the pool
 * (pool/metrics.ts createInstanceMetrics) and the SSH latency wrapper (sshexec/metrics.ts). Created once per
 * dispatcher process, before it is active, so every series exists at zero from start-up; `watch()` points
 * the collect-time gauges at the parts while the dispatcher is active.
 */
import { Counter, Gauge, Histogram, type Registry } from "prom-client";
import type { InstanceType } from "../cloud-drivers/types.ts";
import type { Config } from "../config/schema.ts";
import type { Clock } from "../lib/clock.ts";
import type { Logger } from "../lib/logger.ts";
import { type Bundle, FINAL_STATES } from "../store/types.ts";
import { instanceTypesFromConfig } from "./instance-types.ts";
import { createInstanceMetrics } from "./pool/metrics.ts";
import type { QueueChange } from "./queue/queue.ts";
import { createEligibleNames } from "./scheduler/eligible.ts";
import { type Connect, createSshMetrics } from "./sshexec/metrics.ts";
import type { QueueView, WorkerView } from "./types.ts";

export const DISPATCHER_METRIC = {
  bundles: "dispatchcloud_bundles",
  bundlesFinished: "dispatchcloud_bundles_finished_total",
  queueEntries: "dispatchcloud_queue_entries",
  longestWait: "dispatchcloud_queue_longest_wait_seconds",
  queueToRunner: "dispatchcloud_bundle_queue_to_runner_seconds",
  bundleCost: "dispatchcloud_bundle_cost_dollars_total",
  atQuota: "dispatchcloud_at_quota",
  userWorkers: "dispatchcloud_user_workers",
  userWorkerCheckinAge: "dispatchcloud_user_worker_checkin_age_max_seconds",
} as const;

/** The states of users' workers (store WorkerState); `dispatchcloud_user_workers{state}` has one series each. */
export const USER_WORKER_STATES = ["new", "active", "draining", "stopped", "lost"] as const;

/** The active states (the queue's); `dispatchcloud_bundles{state}` has one series each. */
export const QUEUE_STATES = ["staged", "starting", "running"] as const;
/** The instance_type label of a queue entry no configured type can run. */
export const NO_TYPE = "none";

const QUEUE_TO_RUNNER_BUCKETS = [1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 21600, 86400];

/** What the metrics read of the active dispatcher. */
export interface MetricParts {
  queue: QueueView & { subscribe(fn: (changes: readonly QueueChange[]) => void): () => void };
  pool: {
    workers(): readonly WorkerView[];
    quota(): { atQuota: boolean };
    subscribe(fn: (event: unknown) => void): () => void;
  };
  /** Users' own workers (dispatcher/workers/user-workers.ts); absent: none are counted. */
  userWorkers?: {
    countsByState(): Record<(typeof USER_WORKER_STATES)[number], number>;
    views(): readonly { checkinAgeMs: number | null }[];
  };
}

export interface DispatcherMetrics {
  /** Reads `parts` until the returned function is called (the dispatcher's deactivation). */
  watch(parts: MetricParts): () => void;
  /** Wraps an executor factory with the SSH command latency histogram. */
  timeConnect(connect: Connect): Connect;
}

export function createDispatcherMetrics(opts: {
  registry: Registry;
  config: Config;
  clock: Clock;
  logger: Logger;
  instanceTypes?: readonly InstanceType[];
}): DispatcherMetrics {
  const { registry, config, clock } = opts;
  const types = opts.instanceTypes ?? instanceTypesFromConfig(config);
  const typeLabels = [...types.map((t) => t.name), NO_TYPE];
  let parts: MetricParts | null = null;
  const instances = createInstanceMetrics(registry, types, clock, () => parts?.pool.workers() ?? null);

  // --- collect-time gauges ----------------------------------------------------------------------------

  const eligibleNames = createEligibleNames(config, types);
  const firstTypeOf = (b: Bundle): string => eligibleNames(b)[0] ?? NO_TYPE;

  const replace = (name: string) => registry.removeSingleMetric(name);
  replace(DISPATCHER_METRIC.bundles);
  new Gauge({
    name: DISPATCHER_METRIC.bundles,
    help: "Bundles in the dispatcher's queue, by state (staged, starting, running).",
    labelNames: ["state"],
    registers: [registry],
    collect() {
      const counts = new Map<string, number>(QUEUE_STATES.map((s) => [s, 0]));
      for (const b of parts?.queue.all() ?? []) counts.set(b.state, (counts.get(b.state) ?? 0) + 1);
      for (const [state, n] of counts) this.set({ state }, n);
    },
  });
  replace(DISPATCHER_METRIC.queueEntries);
  new Gauge({
    name: DISPATCHER_METRIC.queueEntries,
    help: `Bundles in the dispatcher's queue, by state and first eligible instance type ("${NO_TYPE}": no type fits).`,
    labelNames: ["state", "instance_type"],
    registers: [registry],
    collect() {
      this.reset();
      for (const state of QUEUE_STATES) for (const t of typeLabels) this.set({ state, instance_type: t }, 0);
      for (const b of parts?.queue.all() ?? []) this.inc({ state: b.state, instance_type: firstTypeOf(b) });
    },
  });
  replace(DISPATCHER_METRIC.longestWait);
  new Gauge({
    name: DISPATCHER_METRIC.longestWait,
    help: "How long the longest-waiting staged bundle has waited since it was staged, in seconds (0: none waits).",
    registers: [registry],
    collect() {
      const now = clock.now();
      let oldest = now;
      for (const b of parts?.queue.all() ?? []) {
        if (b.state !== "staged") continue;
        oldest = Math.min(oldest, (b.stagedAt ?? b.createdAt).getTime());
      }
      this.set(Math.max(0, now - oldest) / 1000);
    },
  });
  replace(DISPATCHER_METRIC.atQuota);
  new Gauge({
    name: DISPATCHER_METRIC.atQuota,
    help: "1 while the dispatcher is at its instance quota (cloud.maxInstances or the cloud's quota), else 0.",
    registers: [registry],
    collect() {
      this.set(parts?.pool.quota().atQuota === true ? 1 : 0);
    },
  });

  replace(DISPATCHER_METRIC.userWorkers);
  new Gauge({
    name: DISPATCHER_METRIC.userWorkers,
    help: "Users' own workers (docs/workers.md) by state, as the dispatcher last read them.",
    labelNames: ["state"],
    registers: [registry],
    collect() {
      const counts = parts?.userWorkers?.countsByState();
      for (const state of USER_WORKER_STATES) this.set({ state }, counts?.[state] ?? 0);
    },
  });
  replace(DISPATCHER_METRIC.userWorkerCheckinAge);
  new Gauge({
    name: DISPATCHER_METRIC.userWorkerCheckinAge,
    help: "Seconds since the active or draining user's worker that checked in longest ago last checked in (0: none).",
    registers: [registry],
    collect() {
      let oldest = 0;
      for (const v of parts?.userWorkers?.views() ?? []) oldest = Math.max(oldest, v.checkinAgeMs ?? 0);
      this.set(oldest / 1000);
    },
  });

  // --- event metrics (kept across activations) -----------------------------------------------------------

  const single = <M>(name: string, create: () => M): M =>
    (registry.getSingleMetric(name) as M | undefined) ?? create();
  const queueToRunner = single(
    DISPATCHER_METRIC.queueToRunner,
    () =>
      new Histogram({
        name: DISPATCHER_METRIC.queueToRunner,
        help: "Time from a bundle's staging to its runner's start call (starting -> running), in seconds.",
        buckets: QUEUE_TO_RUNNER_BUCKETS,
        registers: [registry],
      }),
  );
  const finished = single(
    DISPATCHER_METRIC.bundlesFinished,
    () =>
      new Counter({
        name: DISPATCHER_METRIC.bundlesFinished,
        help: "Bundles this dispatcher saw leave its queue in a final state (ready, failed, killed).",
        labelNames: ["state"],
        registers: [registry],
      }),
  );
  for (const state of FINAL_STATES) finished.inc({ state }, 0);
  const bundleCost = single(
    DISPATCHER_METRIC.bundleCost,
    () =>
      new Counter({
        name: DISPATCHER_METRIC.bundleCost,
        help:
          "What bundles' attempts were charged as they left running (costDollars: their share of their instance's " +
          "price x the time they ran), by the attempt's instance type; dispatchcloud_instance_cost_dollars_total less " +
          "this is what instances cost beyond the bundles on them.",
        labelNames: ["instance_type"],
        registers: [registry],
      }),
  );
  for (const t of typeLabels) bundleCost.inc({ instance_type: t }, 0);
  /**
   * Per bundle in the queue with a cost or an instance type, the cost its row showed last and the instance type
   * of its attempt (a lost attempt's row has none any more): each rise of the cost is counted once, on that type.
   * Kept for starting and running bundles, and staged ones with earlier attempts charged: not the whole queue.
   */
  const charged = new Map<string, { cost: number; type: string | null }>();
  const knownType = new Set(typeLabels);
  const remember = (b: Bundle, type: string | null): void => {
    const cost = b.costDollars ?? 0;
    const active = (QUEUE_STATES as readonly string[]).includes(b.state);
    if (active && (cost > 0 || type !== null)) charged.set(b.uuid, { cost, type });
    else charged.delete(b.uuid);
  };
  const countCost = (b: Bundle): void => {
    const last = charged.get(b.uuid);
    const rise = (b.costDollars ?? 0) - (last?.cost ?? 0);
    const type = b.instanceType ?? last?.type ?? null;
    if (rise > 0)
      bundleCost.inc({ instance_type: type !== null && knownType.has(type) ? type : NO_TYPE }, rise);
    remember(b, type);
  };

  /** Attempts whose queue-to-runner time is observed (`uuid/attempt`); forgotten once the bundle is final. */
  const observedRunning = new Set<string>();
  /** Bundles that finished before this moment are not counted (the queue's first read may show some). */
  let watchingSince = Number.POSITIVE_INFINITY;

  /** Queue-to-runner time, once per attempt: from any row of the attempt that has its runningAt. */
  const observeRunning = (b: Bundle): void => {
    if (b.runningAt === null || b.stagedAt === null) return;
    const key = `${b.uuid}/${b.attempt}`;
    if (observedRunning.has(key)) return;
    observedRunning.add(key);
    queueToRunner.observe(Math.max(0, b.runningAt.getTime() - b.stagedAt.getTime()) / 1000);
  };

  /**
   * What the queue says changed (typed events: no re-read of the queue or the store). A bundle that ran and ended
   * between two reads of the queue still counts: its final row carries its runningAt.
   */
  const onChanges = (changes: readonly QueueChange[]): void => {
    for (const c of changes) {
      const b = c.bundle;
      const final = (FINAL_STATES as readonly string[]).includes(c.to);
      // One that finished before this dispatcher watched (the queue's first read may show it) was counted before.
      const seenEnd = b.finishedAt === null || b.finishedAt.getTime() >= watchingSince;
      if (!final || seenEnd) countCost(b);
      else charged.delete(b.uuid);
      if (c.to === "running") {
        observeRunning(b);
        continue;
      }
      if (!final) continue;
      if (c.to !== "killed") observeRunning(b);
      if (seenEnd) finished.inc({ state: c.to });
      for (let a = 0; a <= b.attempt; a++) observedRunning.delete(`${b.uuid}/${a}`);
    }
  };

  const timeConnect = createSshMetrics(registry, clock);

  return {
    watch(p) {
      parts = p;
      observedRunning.clear();
      charged.clear();
      watchingSince = clock.now();
      for (const b of p.queue.all()) {
        if (b.state === "running") observeRunning(b);
        // What was charged before this dispatcher watched is not counted again.
        remember(b, b.instanceType);
      }
      const unsubscribe = [p.queue.subscribe(onChanges), p.pool.subscribe(() => instances.update())];
      return () => {
        for (const u of unsubscribe) u();
        instances.update();
        if (parts === p) parts = null;
      };
    },
    timeConnect,
  };
}
