import { DispatchCloudError } from "../lib/errors.ts";

/**
 * The errors a driver throws, classified by how the dispatcher reacts (DESIGN.md §5). Each keeps the
 * provider's error as `cause`; messages are written by the driver and never include credentials.
 */

/** The cloud refused a call for its rate limit: no cloud calls at all before `earliestRetry`. */
export class CloudRateLimitError extends DispatchCloudError {
  /** Milliseconds since the epoch. */
  readonly earliestRetry: number;

  constructor(message: string, options: { earliestRetry: number; cause?: unknown }) {
    super("cloud.rate_limit", message, withCause(options.cause));
    this.name = "CloudRateLimitError";
    this.earliestRetry = options.earliestRetry;
  }
}

/** The account is at an instance or resource quota: create nothing more until an instance goes away. */
export class CloudQuotaError extends DispatchCloudError {
  constructor(message: string, options: { cause?: unknown } = {}) {
    super("cloud.quota", message, withCause(options.cause));
    this.name = "CloudQuotaError";
  }
}

export type CapacityScope = "instanceType" | "quotaGroup" | "all";

/** No capacity for now: for one instance type, for a quota group, or for anything at all. */
export class CapacityError extends DispatchCloudError {
  readonly scope: CapacityScope;
  readonly instanceType: string | undefined;
  readonly quotaGroup: string | undefined;

  constructor(
    message: string,
    options: { scope: CapacityScope; instanceType?: string; quotaGroup?: string; cause?: unknown },
  ) {
    super("cloud.capacity", message, withCause(options.cause));
    this.name = "CapacityError";
    this.scope = options.scope;
    this.instanceType = options.instanceType;
    this.quotaGroup = options.quotaGroup;
  }
}

/** Any other failed cloud call; the cause has the details. */
export class CloudError extends DispatchCloudError {
  constructor(message: string, options: { cause?: unknown } = {}) {
    super("cloud.error", message, withCause(options.cause));
    this.name = "CloudError";
  }
}

export function isCloudRateLimitError(err: unknown): err is CloudRateLimitError {
  return err instanceof CloudRateLimitError;
}

export function isCloudQuotaError(err: unknown): err is CloudQuotaError {
  return err instanceof CloudQuotaError;
}

export function isCapacityError(err: unknown): err is CapacityError {
  return err instanceof CapacityError;
}

export function isCloudError(err: unknown): err is CloudError {
  return err instanceof CloudError;
}

/** The cloud.* code of an error thrown by a driver: anything unclassified counts as cloud.error. */
export function cloudErrorCode(err: unknown): CloudErrorCode {
  if (err instanceof DispatchCloudError && (CLOUD_ERROR_CODES as readonly string[]).includes(err.code)) {
    return err.code as CloudErrorCode;
  }
  return "cloud.error";
}

export const CLOUD_ERROR_CODES = [
  "cloud.rate_limit",
  "cloud.quota",
  "cloud.capacity",
  "cloud.error",
] as const;
export type CloudErrorCode = (typeof CLOUD_ERROR_CODES)[number];

function withCause(cause: unknown): { cause?: unknown } {
  return cause === undefined ? {} : { cause };
}
