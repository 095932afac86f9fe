import { Counter, Histogram, type Registry } from "prom-client";
import type { Clock } from "../lib/clock.ts";
import { CLOUD_ERROR_CODES, cloudErrorCode, isCloudRateLimitError } from "./errors.ts";
import type { Instance, InstanceSet, InstanceType, Tags } from "./types.ts";

/**
 * Wrappers around a driver's InstanceSet (DESIGN.md §5), inner to outer: instrumented -> rate-limited ->
 * default tags -> tag filter. Each wraps the set and the Instance objects it returns, so an instance's
 * setTags and destroy pass through the same layers as create and list.
 */

export const DRIVER_OPERATIONS = ["create", "list", "destroy", "setTags"] as const;
export type DriverOperation = (typeof DRIVER_OPERATIONS)[number];

/** The instance-level calls, given to wrapInstance; everything else is read through to the inner instance. */
interface InstanceOps {
  setTags(tags: Tags): Promise<void>;
  destroy(): Promise<void>;
}

function wrapInstance(inner: Instance, ops: InstanceOps): Instance {
  const wrapped: Instance = {
    get id() {
      return inner.id;
    },
    get address() {
      return inner.address;
    },
    get remoteUser() {
      return inner.remoteUser;
    },
    get providerType() {
      return inner.providerType;
    },
    get tags() {
      return inner.tags;
    },
    setTags: (tags) => ops.setTags(tags),
    destroy: () => ops.destroy(),
  };
  const priceHistory = inner.priceHistory;
  if (priceHistory !== undefined) wrapped.priceHistory = (type) => priceHistory.call(inner, type);
  return wrapped;
}

/** Wraps every call of a set (and of its instances) in `around(operation, call)`. */
function aroundEach(
  set: InstanceSet,
  around: <T>(op: DriverOperation, call: () => Promise<T>) => Promise<T>,
) {
  const wrap = (inst: Instance): Instance =>
    wrapInstance(inst, {
      setTags: (tags) => around("setTags", () => inst.setTags(tags)),
      destroy: () => around("destroy", () => inst.destroy()),
    });
  return {
    create: async (type: InstanceType, imageId: string, tags: Tags, initCommand: string, publicKey: string) =>
      wrap(await around("create", () => set.create(type, imageId, tags, initCommand, publicKey))),
    instances: async (filter: Tags) => (await around("list", () => set.instances(filter))).map(wrap),
    quotaGroup: (type: InstanceType) => set.quotaGroup(type),
    stop: () => set.stop(),
  } satisfies InstanceSet;
}

export const METRIC = {
  operations: "dispatchcloud_driver_operations_total",
  duration: "dispatchcloud_driver_operation_duration_seconds",
  errors: "dispatchcloud_driver_errors_total",
} as const;

/** Counts every cloud call and its latency, by operation and error (0/1), and errors by code. */
export function instrumented(
  set: InstanceSet,
  opts: { registry: Registry; clock: Clock; driver: string },
): InstanceSet {
  const { registry, clock, driver } = opts;
  const operations = metric(registry, METRIC.operations, () => {
    return new Counter({
      name: METRIC.operations,
      help: "Cloud driver calls, by operation and whether they failed.",
      labelNames: ["driver", "operation", "error"],
      registers: [registry],
    });
  });
  const duration = metric(registry, METRIC.duration, () => {
    return new Histogram({
      name: METRIC.duration,
      help: "Latency of cloud driver calls, in seconds.",
      labelNames: ["driver", "operation", "error"],
      buckets: [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300],
      registers: [registry],
    });
  });
  const errors = metric(registry, METRIC.errors, () => {
    return new Counter({
      name: METRIC.errors,
      help: "Failed cloud driver calls, by operation and error code.",
      labelNames: ["driver", "operation", "code"],
      registers: [registry],
    });
  });
  for (const operation of DRIVER_OPERATIONS) {
    for (const error of ["0", "1"]) {
      operations.inc({ driver, operation, error }, 0);
      duration.zero({ driver, operation, error });
    }
    for (const code of CLOUD_ERROR_CODES) errors.inc({ driver, operation, code }, 0);
  }
  return aroundEach(set, async (operation, call) => {
    const start = clock.now();
    const record = (error: "0" | "1") => {
      operations.inc({ driver, operation, error });
      duration.observe({ driver, operation, error }, (clock.now() - start) / 1000);
    };
    try {
      const result = await call();
      record("0");
      return result;
    } catch (err) {
      record("1");
      errors.inc({ driver, operation, code: cloudErrorCode(err) });
      throw err;
    }
  });
}

/** One metric per registry: a second instance set on the same registry shares the first's metrics. */
function metric<M>(registry: Registry, name: string, create: () => M): M {
  return (registry.getSingleMetric(name) as M | undefined) ?? create();
}

/**
 * Spaces all cloud calls (create, list, destroy, setTags) at least 1/maxOpsPerSecond apart, first come
 * first served; 0 = unlimited. After a CloudRateLimitError, no call starts before its earliestRetry.
 */
export function rateLimited(set: InstanceSet, opts: { maxOpsPerSecond: number; clock: Clock }): InstanceSet {
  const { clock } = opts;
  const interval = opts.maxOpsPerSecond > 0 ? 1000 / opts.maxOpsPerSecond : 0;
  let nextAt = Number.NEGATIVE_INFINITY;
  let holdUntil = Number.NEGATIVE_INFINITY;
  let queue: Promise<void> = Promise.resolve();
  const turn = (): Promise<void> => {
    const mine = queue.then(async () => {
      // Re-check after each sleep: a rate-limit error may have moved holdUntil meanwhile.
      for (let wait = Math.max(nextAt, holdUntil) - clock.now(); wait > 0; ) {
        await clock.sleep(wait);
        wait = Math.max(nextAt, holdUntil) - clock.now();
      }
      nextAt = clock.now() + interval;
    });
    queue = mine.catch(() => {});
    return mine;
  };
  return aroundEach(set, async (_operation, call) => {
    await turn();
    try {
      return await call();
    } catch (err) {
      if (isCloudRateLimitError(err)) holdUntil = Math.max(holdUntil, err.earliestRetry);
      throw err;
    }
  });
}

/**
 * Adds `defaults` to the tags of create and setTags (the caller's value wins for the same key), and
 * `fixed` on top of both (nobody overrides them: the instance set ID tag goes here).
 */
export function withDefaultTags(set: InstanceSet, defaults: Tags, fixed: Tags): InstanceSet {
  const merge = (tags: Tags): Tags => ({ ...defaults, ...tags, ...fixed });
  const wrap = (inst: Instance): Instance =>
    wrapInstance(inst, { setTags: (tags) => inst.setTags(merge(tags)), destroy: () => inst.destroy() });
  return {
    create: async (type, imageId, tags, initCommand, publicKey) =>
      wrap(await set.create(type, imageId, merge(tags), initCommand, publicKey)),
    instances: async (filter) => (await set.instances(filter)).map(wrap),
    quotaGroup: (type) => set.quotaGroup(type),
    stop: () => set.stop(),
  };
}

/** True if `tags` has every key of `filter` with the same value. */
export function hasTags(tags: Tags, filter: Tags): boolean {
  return Object.entries(filter).every(([key, value]) => Object.hasOwn(tags, key) && tags[key] === value);
}

/**
 * Lists only instances carrying every tag of `filter` (and of the caller's filter), checked here on the
 * client side, so a driver that ignores the filter cannot leak foreign instances in.
 */
export function withTagFilter(set: InstanceSet, filter: Tags): InstanceSet {
  return {
    create: (type, imageId, tags, initCommand, publicKey) =>
      set.create(type, imageId, tags, initCommand, publicKey),
    instances: async (callerFilter) => {
      const all = { ...callerFilter, ...filter };
      return (await set.instances(all)).filter((inst) => hasTags(inst.tags, all));
    },
    quotaGroup: (type) => set.quotaGroup(type),
    stop: () => set.stop(),
  };
}

export interface WrapOptions {
  registry: Registry;
  clock: Clock;
  /** The driver's name, the `driver` label of the metrics. */
  driver: string;
  /** cloud.maxCloudOpsPerSecond; 0 = unlimited. */
  maxOpsPerSecond: number;
  /** Added to every instance's tags; the caller's tags win (cloud.resourceTags). */
  defaultTags: Tags;
  /** The tags marking this set's instances (the instance set ID tag): always set, and required on list. */
  instanceSetTags: Tags;
}

/** All four wrappers, in DESIGN.md §5's order. */
export function wrapInstanceSet(set: InstanceSet, opts: WrapOptions): InstanceSet {
  const metered = instrumented(set, opts);
  const limited = rateLimited(metered, opts);
  const tagged = withDefaultTags(limited, opts.defaultTags, opts.instanceSetTags);
  return withTagFilter(tagged, opts.instanceSetTags);
}
