/**
 * Azure Resource Manager's errors, translated once (classifyAzureError) into the classes the pool reacts to
 * (cloud-drivers/errors.ts). Nothing outside cloud-drivers/azure looks at an Azure code.
 */
import { CapacityError, CloudError, CloudQuotaError, CloudRateLimitError } from "../errors.ts";

/** When a throttled answer names no usable Retry-After: wait this long (what Arvados does too). */
export const DEFAULT_RETRY_AFTER_MS = 20_000;

/** No capacity for this VM size (here, now, at this price). */
export const TYPE_CAPACITY_CODES: ReadonlySet<string> = new Set([
  "SkuNotAvailable",
  "AllocationFailed",
  "ZonalAllocationFailed",
  "OverconstrainedAllocationRequest",
  "OverconstrainedZonalAllocationRequest",
]);

/** The subscription is at a limit: nothing more can be created until something goes away. */
export const QUOTA_CODES: ReadonlySet<string> = new Set([
  "QuotaExceeded",
  "ResourceQuotaExceeded",
  "OperationNotAllowed_QuotaExceeded",
  "SubnetIsFull",
]);

/**
 * Another operation holds this one resource (the network provider's lock on one NIC, answered with HTTP 429 and a
 * Retry-After): not the subscription's rate limit. The driver sends that call again after the wait (sendAgainWhileBusy
 * in driver.ts); if the resource stays busy the call fails as a plain CloudError.
 */
export const RESOURCE_BUSY_CODES: ReadonlySet<string> = new Set([
  "RetryableErrorDueToAnotherOperation",
  "AnotherOperationInProgress",
]);

/** A VM create naming an image Azure cannot find (here: not replicated to this region, or not there at all). */
export const IMAGE_NOT_FOUND_CODES: ReadonlySet<string> = new Set([
  "GalleryImageNotFound",
  "ImageNotFound",
  "PlatformImageNotFound",
]);

/** Codes ARM uses for "slow down" (besides HTTP 429 itself). */
export const THROTTLING_CODES: ReadonlySet<string> = new Set([
  "TooManyRequests",
  "SubscriptionRequestsThrottled",
  "TenantRequestsThrottled",
  "ResourceRequestsThrottled",
]);

/** What an error from the SDK (or from below it) says, in the fields the classification reads. */
export interface AzureErrorInfo {
  /** ARM's error code (the body's error.code, or the failed operation's), undefined without an ARM answer. */
  code: string | undefined;
  /** HTTP status of ARM's answer, when there was one. */
  status: number | undefined;
  message: string;
  /** Milliseconds to wait, from Retry-After (seconds or HTTP date) or retry-after-ms, if the answer had one. */
  retryAfterMs: number | undefined;
  /** True for a long-running operation that was accepted, then failed (its status said Failed). */
  operationFailed: boolean;
  /** True when the request got no answer within the request timeout. */
  timedOut: boolean;
}

/** core-lro's message for an operation whose status is Failed: `...has failed. <code>. <message>`. */
const LRO_FAILED = /^The long-running operation has failed(?:\. ([^\s.]+)\. ([\s\S]*))?$/;

export function azureErrorInfo(err: unknown, now: number): AzureErrorInfo {
  const info: AzureErrorInfo = {
    code: undefined,
    status: undefined,
    message: "",
    retryAfterMs: undefined,
    operationFailed: false,
    timedOut: false,
  };
  if (typeof err !== "object" || err === null) {
    info.message = String(err);
    return info;
  }
  const e = err as {
    name?: unknown;
    code?: unknown;
    statusCode?: unknown;
    message?: unknown;
    response?: { status?: unknown; headers?: { get?(name: string): string | undefined } };
  };
  info.message = typeof e.message === "string" ? e.message : "";
  if (e.name === "RestError") {
    info.status = typeof e.statusCode === "number" ? e.statusCode : undefined;
    // A RestError without a status is a transport failure; its code is Node's (ECONNREFUSED...), not ARM's.
    if (info.status !== undefined && typeof e.code === "string" && e.code !== "") info.code = e.code;
    const headers = e.response?.headers;
    if (typeof headers?.get === "function") info.retryAfterMs = retryAfter(headers, now);
    return info;
  }
  if (e.name === "AbortError") {
    // The driver aborts nothing itself: an aborted request is one past its requestTimeout.
    info.timedOut = true;
    return info;
  }
  const failed = LRO_FAILED.exec(info.message);
  if (failed !== null) {
    info.operationFailed = true;
    info.code = failed[1];
    if (failed[2] !== undefined) info.message = failed[2];
  }
  return info;
}

/** Retry-After (delay-seconds or an HTTP date), or retry-after-ms / x-ms-retry-after-ms, in milliseconds. */
function retryAfter(headers: { get?(name: string): string | undefined }, now: number): number | undefined {
  for (const name of ["retry-after-ms", "x-ms-retry-after-ms"]) {
    const ms = Number(headers.get?.(name) ?? Number.NaN);
    if (Number.isFinite(ms) && ms >= 0) return ms;
  }
  const value = headers.get?.("retry-after")?.trim();
  if (value === undefined || value === "") return undefined;
  if (/^\d+(\.\d+)?$/.test(value)) return Number(value) * 1000;
  const date = Date.parse(value);
  if (Number.isNaN(date)) return undefined;
  return Math.max(0, date - now);
}

/** ARM's error code of an SDK error, or of the SDK error a driver error was classified from (its cause). */
export function armErrorCode(err: unknown, now = 0): string | undefined {
  const direct = azureErrorInfo(err, now).code;
  if (direct !== undefined) return direct;
  const cause = (err as { cause?: unknown } | null)?.cause;
  return cause === undefined ? undefined : azureErrorInfo(cause, now).code;
}

/** ARM answered that another operation holds the resource (RESOURCE_BUSY_CODES): send the same call again later. */
export function isResourceBusy(err: unknown): boolean {
  const code = armErrorCode(err);
  return code !== undefined && RESOURCE_BUSY_CODES.has(code);
}

/** How long to wait before sending a call refused as busy again: Retry-After, else the message's "retried in N seconds". */
export function busyRetryAfterMs(err: unknown, now: number): number | undefined {
  const info = azureErrorInfo(err, now);
  if (info.retryAfterMs !== undefined) return info.retryAfterMs;
  const m = /retried in (\d+(?:\.\d+)?) seconds?/i.exec(info.message);
  return m === null ? undefined : Number(m[1]) * 1000;
}

/**
 * Whether a failed request may have been carried out all the same: no ARM answer at all (timed out, connection
 * lost) or a 5xx. Only a 4xx answer (429 included) says that nothing was done.
 */
export function outcomeUnknown(err: unknown, now = 0): boolean {
  const info = azureErrorInfo(err, now);
  if (info.operationFailed) return false;
  return info.status === undefined || info.status >= 500;
}

export function isNotFound(err: unknown): boolean {
  const e = err as { name?: unknown; statusCode?: unknown; code?: unknown } | null;
  if (e?.name !== "RestError") return false;
  return e.statusCode === 404 || e.code === "ResourceNotFound" || e.code === "NotFound";
}

export interface AzureErrorContext {
  /** What was being done, e.g. "create VM dc-abc" (named in the message). */
  operation: string;
  /** Milliseconds since the epoch (the injected clock). */
  now: number;
  /** For a create: the instance type and its quota group. */
  instanceType?: { name: string; providerType: string };
  quotaGroup?: string;
  /** Values that must never appear in a message (the client secret); replaced by "***". */
  secrets?: readonly string[];
  /** The request timeout, named in the message of a timed-out call. */
  timeoutMs?: number;
}

/** Family cores quota: "...exceeding approved standardDSv3Family Cores quota..." (not the regional totals). */
const FAMILY_QUOTA = /exceeding approved (\S+Family) Cores quota/i;

/**
 * THE mapping of an Azure/SDK error to the dispatcher's classes:
 * - another operation holds the resource (RESOURCE_BUSY_CODES, even as HTTP 429 with Retry-After) -> CloudError:
 *   a lock on that one resource, which the driver has waited out and retried already, not a rate limit;
 * - HTTP 429, a throttling code, or any error answer with Retry-After -> CloudRateLimitError, earliestRetry =
 *   now + Retry-After (seconds or HTTP date), 20 s when the answer has none;
 * - SkuNotAvailable, AllocationFailed, ZonalAllocationFailed, OverconstrainedAllocationRequest,
 *   OverconstrainedZonalAllocationRequest (sync or from a failed operation) -> CapacityError for the type;
 * - "exceeding approved <family> Cores quota" -> CapacityError for the type's quota group;
 * - QuotaExceeded & co., and any other code whose message speaks of a quota (OperationNotAllowed with the
 *   regional or low-priority cores quota, ...) or of a limit being exceeded -> CloudQuotaError;
 * - an image Azure cannot find (IMAGE_NOT_FOUND_CODES, NotFound about an image) -> CloudError saying so;
 * - everything else (auth, other codes, 5xx, timeouts, connection errors) -> CloudError.
 * The SDK's error is the cause.
 */
export function classifyAzureError(err: unknown, ctx: AzureErrorContext): Error {
  const info = azureErrorInfo(err, ctx.now);
  const text = redact(info.message, ctx.secrets ?? []);
  let what: string;
  if (info.code !== undefined)
    what = `${info.code}${info.operationFailed ? " (operation failed)" : ""}: ${text}`;
  else if (info.timedOut)
    what = `no answer${ctx.timeoutMs === undefined ? "" : ` within ${ctx.timeoutMs} ms`}`;
  else if (info.status !== undefined) what = `HTTP ${info.status}: ${text}`;
  else what = `${describeError(err)}: ${text}`;
  const message = `azure ${ctx.operation}: ${what}`;

  const code = info.code;
  if (code !== undefined && RESOURCE_BUSY_CODES.has(code)) {
    return new CloudError(`${message} (another operation holds this resource; not a rate limit)`, {
      cause: err,
    });
  }
  if (
    info.status === 429 ||
    (code !== undefined && THROTTLING_CODES.has(code)) ||
    (info.retryAfterMs !== undefined && (info.status ?? 0) >= 400)
  ) {
    const delay = info.retryAfterMs ?? DEFAULT_RETRY_AFTER_MS;
    return new CloudRateLimitError(`${message} (no Azure calls for ${delay / 1000} s)`, {
      earliestRetry: ctx.now + delay,
      cause: err,
    });
  }
  if (code === undefined) return new CloudError(message, { cause: err });
  if (IMAGE_NOT_FOUND_CODES.has(code) || (code === "NotFound" && /\bimage\b/i.test(text))) {
    return new CloudError(
      `${message} (the image does not exist in this region, or cannot be read: check cloud.imageId)`,
      { cause: err },
    );
  }
  const type = ctx.instanceType;
  if (type !== undefined && TYPE_CAPACITY_CODES.has(code)) {
    return new CapacityError(message, { scope: "instanceType", instanceType: type.name, cause: err });
  }
  if (type !== undefined && ctx.quotaGroup !== undefined && FAMILY_QUOTA.test(text)) {
    return new CapacityError(message, {
      scope: "quotaGroup",
      instanceType: type.name,
      quotaGroup: ctx.quotaGroup,
      cause: err,
    });
  }
  if (
    QUOTA_CODES.has(code) ||
    /QuotaExceeded$|LimitExceeded$|LimitReached$/.test(code) ||
    /\bquota\b/i.test(text) ||
    (code === "OperationNotAllowed" && /\bexceed|\blimit\b/i.test(text))
  ) {
    return new CloudQuotaError(message, { cause: err });
  }
  return new CloudError(message, { cause: err });
}

function describeError(err: unknown): string {
  const e = err as { name?: unknown; code?: unknown } | null;
  const name = typeof e?.name === "string" ? e.name : "Error";
  return typeof e?.code === "string" ? `${name} (${e.code})` : name;
}

function redact(text: string, secrets: readonly string[]): string {
  let out = text;
  for (const s of secrets) if (s.length >= 4) out = out.split(s).join("***");
  return out;
}
