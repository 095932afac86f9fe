/**
 * Whether the pool may create an instance now, and why not (dispatcher/README.md "Pool error handling"): the
 * configured maxInstances, the cloud's own quota, capacity errors (by type, quota group or everything), the
 * cloud API's rate limit, creates in flight (maxConcurrentInstanceCreateOps), and the back-off after new
 * instances on which the runner could not run. Cloud errors arrive classified (cloud-drivers/errors.ts); this
 * is where they become blocks. Fleet-wide state only: the pool counts instances and calls in.
 */
import {
  type CapacityError,
  isCapacityError,
  isCloudQuotaError,
  isCloudRateLimitError,
} from "../../cloud-drivers/errors.ts";
import type { InstanceSet, InstanceType } from "../../cloud-drivers/types.ts";
import type { Config } from "../../config/schema.ts";
import type { Clock } from "../../lib/clock.ts";
import type { Logger } from "../../lib/logger.ts";
import type { CreateRefusal } from "../types.ts";

/** How long a capacity error blocks its type, quota group or everything; and a quota error with no instances. */
export const CAPACITY_BLOCK_MS = 60_000;
export const QUOTA_BLOCK_MS = 60_000;
/**
 * After a new instance is shut down because the runner cannot run on it, creates wait RUNNER_BLOCK_MS, doubled
 * for each further instance that fails the same way in a row (at most RUNNER_BLOCK_MAX_MS), until an instance
 * becomes ready.
 */
export const RUNNER_BLOCK_MS = 60_000;
export const RUNNER_BLOCK_MAX_MS = 16 * 60_000;

interface Block {
  until: number;
  message: string;
}

export interface QuotaState {
  atQuota: boolean;
  instances: number;
  max: number | null;
  until: number | null;
}

/** What the gate needs to know of the fleet. */
export interface FleetCounts {
  /** Instances and creates in flight. */
  all(): number;
  /** Instances the cloud has (creates in flight left out). */
  real(): number;
}

export interface CreateGate {
  quota(): QuotaState;
  capacityBlocked(type: InstanceType): Block | null;
  /** Rate limit, creates in flight, or the runner back-off: for status sentences. */
  createsBlocked(): CreateRefusal | null;
  /** Why a create of `type` may not start now, or null. */
  refusalFor(type: InstanceType): CreateRefusal | null;
  /** A create call starts / ends (maxConcurrentInstanceCreateOps). */
  callStarted(): void;
  callEnded(): void;
  /** A create failed: quota, capacity and rate-limit errors become blocks (logged); others are only logged. */
  createFailed(type: InstanceType, err: unknown, log: Logger): void;
  /** A new instance was shut down because the runner cannot run on it: creates wait, longer each time. */
  runnerFailed(message: string): void;
  /** An instance became ready: the runner runs, creates need not wait for it any more. */
  instanceReady(log: Logger): void;
}

export function createCreateGate(opts: {
  config: Config;
  clock: Clock;
  logger: Logger;
  instanceSet: Pick<InstanceSet, "quotaGroup">;
  fleet: FleetCounts;
}): CreateGate {
  const { clock, instanceSet, fleet } = opts;
  const cloud = opts.config.cloud;
  const log = opts.logger;
  let quotaHit: { instances: number; until: number | null; message: string } | null = null;
  let rateLimit: Block | null = null;
  let runnerBlock: { instances: number; until: number; message: string } | null = null;
  let calls = 0;
  const capacity = {
    types: new Map<string, Block>(),
    groups: new Map<string, Block>(),
    all: null as Block | null,
  };

  function quota(): QuotaState {
    const now = clock.now();
    const instances = fleet.all();
    let max = cloud.maxInstances > 0 ? cloud.maxInstances : null;
    let atQuota = max !== null && instances >= max;
    let until: number | null = null;
    if (quotaHit !== null) {
      const over = quotaHit.until !== null ? now >= quotaHit.until : fleet.real() < quotaHit.instances;
      if (over) {
        log.info("cloud quota: no longer at quota");
        quotaHit = null;
      } else {
        atQuota = true;
        until = quotaHit.until;
        if (quotaHit.instances > 0) max = Math.min(max ?? Number.POSITIVE_INFINITY, quotaHit.instances);
      }
    }
    return { atQuota, instances, max, until };
  }

  function capacityBlocked(type: InstanceType): Block | null {
    const now = clock.now();
    const live = (b: Block | null | undefined): Block | null => (b != null && now < b.until ? b : null);
    const blocks = [
      live(capacity.all),
      live(capacity.types.get(type.name)),
      live(capacity.groups.get(instanceSet.quotaGroup(type))),
    ].filter((b): b is Block => b !== null);
    if (blocks.length === 0) return null;
    return blocks.reduce((a, b) => (b.until > a.until ? b : a));
  }

  function createsBlocked(): CreateRefusal | null {
    const now = clock.now();
    if (rateLimit !== null && now < rateLimit.until) {
      return { kind: "rate_limit", message: rateLimit.message, until: rateLimit.until };
    }
    if (runnerBlock !== null && now < runnerBlock.until) {
      const n = runnerBlock.instances;
      return {
        kind: "runner_failed",
        message: `the runner could not run on the last ${n === 1 ? "new instance" : `${n} new instances`} (${runnerBlock.message})`,
        until: runnerBlock.until,
        instances: n,
      };
    }
    const max = cloud.maxConcurrentInstanceCreateOps;
    if (max > 0 && calls >= max) {
      return {
        kind: "max_concurrent",
        message: `${calls} instance creation${calls === 1 ? "" : "s"} in flight (cloud.maxConcurrentInstanceCreateOps is ${max})`,
        inFlight: calls,
      };
    }
    return null;
  }

  function blockCapacity(type: InstanceType, err: CapacityError, now: number): void {
    const until = now + CAPACITY_BLOCK_MS;
    const at = new Date(until).toISOString();
    if (err.scope === "all") {
      capacity.all = { until, message: `no cloud capacity for any instance type until ${at}` };
    } else if (err.scope === "quotaGroup") {
      // Keyed as capacityBlocked() looks it up, whatever name the driver used.
      const group = instanceSet.quotaGroup(type);
      capacity.groups.set(group, { until, message: `no cloud capacity in quota group ${group} until ${at}` });
    } else {
      const name = type.name;
      capacity.types.set(name, { until, message: `${name} at capacity until ${at}` });
    }
    log.warn({ err, scope: err.scope, until }, "cloud capacity error: creates blocked");
  }

  return {
    quota,
    capacityBlocked,
    createsBlocked,
    refusalFor(type) {
      const q = quota();
      if (q.atQuota) {
        const message =
          q.max !== null
            ? `at quota: ${q.instances} of ${q.max} instances`
            : `at quota: the cloud refused more instances (${q.instances} now)`;
        return { kind: "quota", message, instances: q.instances, max: q.max, until: q.until };
      }
      const cap = capacityBlocked(type);
      if (cap !== null) return { kind: "capacity", message: cap.message, until: cap.until };
      return createsBlocked();
    },
    callStarted() {
      calls++;
    },
    callEnded() {
      calls--;
    },
    createFailed(type, err, wlog) {
      const now = clock.now();
      const message = err instanceof Error ? err.message : String(err);
      if (isCloudQuotaError(err)) {
        const instances = fleet.real();
        quotaHit = { instances, until: instances === 0 ? now + QUOTA_BLOCK_MS : null, message };
        wlog.warn({ err, instances }, "cloud quota reached: no creates until an instance goes away");
      } else if (isCapacityError(err)) {
        blockCapacity(type, err, now);
      } else if (isCloudRateLimitError(err)) {
        const until = Math.max(err.earliestRetry, rateLimit?.until ?? 0);
        rateLimit = { until, message: `cloud rate limit: no creates until ${new Date(until).toISOString()}` };
        wlog.warn({ err, until }, "cloud rate limit on create");
      } else {
        wlog.error({ err, instanceType: type.name }, "create failed");
      }
    },
    runnerFailed(message) {
      const instances = (runnerBlock?.instances ?? 0) + 1;
      const until = clock.now() + Math.min(RUNNER_BLOCK_MAX_MS, RUNNER_BLOCK_MS * 2 ** (instances - 1));
      runnerBlock = { instances, until, message };
      log.warn(
        { reason: message, instances, until: new Date(until).toISOString() },
        "the runner cannot run on new instances: creates wait",
      );
    },
    instanceReady(wlog) {
      if (runnerBlock === null) return;
      wlog.info("the runner runs on a new instance again: creates no longer wait");
      runnerBlock = null;
    },
  };
}
