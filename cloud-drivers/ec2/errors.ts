/**
 * EC2's error codes, translated once (classifyEc2Error) into the classes the pool reacts to
 * (cloud-drivers/errors.ts). Nothing outside cloud-drivers/ec2 looks at an EC2 code.
 */
import { CapacityError, CloudError, CloudQuotaError, CloudRateLimitError } from "../errors.ts";

/** Codes EC2 (and the AWS SDK's own list) use for "slow down"; HTTP 429 counts too. */
export const THROTTLING_CODES: ReadonlySet<string> = new Set([
  "RequestLimitExceeded",
  "Throttling",
  "ThrottlingException",
  "ThrottledException",
  "RequestThrottled",
  "RequestThrottledException",
  "TooManyRequestsException",
  "SlowDown",
  "EC2ThrottledException",
  "PriorRequestNotComplete",
]);

/** The account is at a limit: nothing more can be created until something goes away. */
export const QUOTA_CODES: ReadonlySet<string> = new Set([
  "InstanceLimitExceeded",
  "InsufficientAddressCapacity",
  "InsufficientVolumeCapacity",
  "VolumeLimitExceeded",
]);

/**
 * The quota of the instance type's quota group is used up: the vCPUs of its family, or (for a preemptible type,
 * whose group ends in `-spot`) the account's spot instances. On-demand creates are not held up by the latter.
 */
export const QUOTA_GROUP_CAPACITY_CODES: ReadonlySet<string> = new Set([
  "VcpuLimitExceeded",
  "MaxSpotInstanceCountExceeded",
]);

/** No capacity for this instance type (in this place, at this price) for now, whatever the message. */
export const TYPE_CAPACITY_CODES: ReadonlySet<string> = new Set([
  "InsufficientInstanceCapacity",
  "SpotMaxPriceTooLow",
]);

/**
 * The subnet has no free address left: EC2 says so with its own code, or as an InvalidParameterValue whose message
 * says it ("Not enough free addresses in subnet ...", "There aren't sufficient free Ipv4 addresses or prefixes").
 */
export function isSubnetFull(info: Ec2ErrorInfo): boolean {
  if (info.code === "InsufficientFreeAddressesInSubnet") return true;
  return (
    info.code?.startsWith("InvalidParameter") === true &&
    /not enough free addresses|sufficient free ipv[46] addresses/i.test(info.message)
  );
}

/** Whether an EC2 message names the requested instance type (by name, or as "requested instance type"). */
function namesType(text: string, providerType: string): boolean {
  return /requested instance type/i.test(text) || (providerType !== "" && text.includes(providerType));
}

/** Codes that depend on the subnet (or its availability zone): the next subnet may work. */
const SUBNET_SPECIFIC_CODES: ReadonlySet<string> = new Set([
  "InsufficientInstanceCapacity",
  "InsufficientVolumeCapacity",
  "InsufficientAddressCapacity",
  "Unsupported",
  "SpotMaxPriceTooLow",
]);

/** What an error from the SDK (or from below it) says, in the fields the classification reads. */
export interface Ec2ErrorInfo {
  /** EC2's error code (the SDK's `name`/`Code`), undefined when no EC2 answer was parsed. */
  code: string | undefined;
  /** HTTP status of EC2's answer, when there was one. */
  status: number | undefined;
  message: string;
}

export function ec2ErrorInfo(err: unknown): Ec2ErrorInfo {
  if (typeof err !== "object" || err === null)
    return { code: undefined, status: undefined, message: String(err) };
  const e = err as {
    name?: unknown;
    Code?: unknown;
    message?: unknown;
    $metadata?: { httpStatusCode?: unknown };
    $fault?: unknown;
    $response?: { statusCode?: unknown };
  };
  const status =
    typeof e.$metadata?.httpStatusCode === "number"
      ? e.$metadata.httpStatusCode
      : typeof e.$response?.statusCode === "number"
        ? e.$response.statusCode
        : undefined;
  const message = typeof e.message === "string" ? e.message : "";
  // Only a service answer carries an EC2 code: the SDK sets $fault on those. A socket or timeout error has a
  // `name` too (TimeoutError, Error), which is not an EC2 code.
  const fromService = e.$fault === "client" || e.$fault === "server" || typeof e.Code === "string";
  const code = !fromService
    ? undefined
    : typeof e.Code === "string" && e.Code !== ""
      ? e.Code
      : typeof e.name === "string"
        ? e.name
        : undefined;
  return { code, status, message };
}

/**
 * True when another subnet may succeed where this one failed: subnet, zone or capacity errors, including an
 * InvalidParameter* answer about the subnet (e.g. out of addresses).
 */
export function isSubnetSpecific(err: unknown): boolean {
  const info = ec2ErrorInfo(err);
  const code = info.code;
  if (code === undefined) return false;
  if (/subnet/i.test(code) || SUBNET_SPECIFIC_CODES.has(code) || isSubnetFull(info)) return true;
  return code.startsWith("InvalidParameter") && /\bsubnet\b/i.test(info.message);
}

/**
 * No answer from EC2 at all (a timeout, a dropped connection): the request may have been carried out or not.
 * Only such a failure is worth sending again, and only with the same idempotency token.
 */
export function isLostAnswer(err: unknown): boolean {
  return ec2ErrorInfo(err).code === undefined;
}

export function isThrottling(info: Ec2ErrorInfo): boolean {
  return (info.code !== undefined && THROTTLING_CODES.has(info.code)) || info.status === 429;
}

/**
 * The delay after consecutive throttling errors: 1 s, then x1.5 + 1 s each time (2.5 s, 4.75 s, ...), at
 * most 60 s; back to the start after a successful call. One per instance set: EC2 throttles per account.
 */
export class ThrottleBackoff {
  static readonly MIN_MS = 1000;
  static readonly MAX_MS = 60_000;
  private delay = 0;

  /** The delay to wait after one more throttling error. */
  next(): number {
    this.delay = Math.min(ThrottleBackoff.MAX_MS, Math.max(ThrottleBackoff.MIN_MS, this.delay * 1.5 + 1000));
    return this.delay;
  }

  /** After a success. */
  reset(): void {
    this.delay = 0;
  }

  /** The last delay handed out (0 after a reset). */
  get current(): number {
    return this.delay;
  }
}

export interface Ec2ErrorContext {
  /** The EC2 action, e.g. RunInstances (named in the message). */
  operation: string;
  /** Milliseconds since the epoch (the injected clock). */
  now: number;
  backoff: ThrottleBackoff;
  /** For a create: the instance type and its quota group. */
  instanceType?: { name: string; providerType: string };
  quotaGroup?: string;
  /** Values that must never appear in a message (the secret access key); replaced by "***". */
  secrets?: readonly string[];
  /** The request timeout, named in the message of a timed-out call. */
  timeoutMs?: number;
}

/**
 * THE mapping of an EC2/SDK error to the dispatcher's classes:
 * throttling -> CloudRateLimitError (earliestRetry = now + backoff); the quota codes -> CloudQuotaError;
 * for a create: VcpuLimitExceeded and MaxSpotInstanceCountExceeded -> CapacityError for the type's quota group;
 * a subnet out of addresses -> CapacityError for everything (no type can get an address);
 * InsufficientInstanceCapacity, SpotMaxPriceTooLow, and Unsupported or "not supported" answers that name the
 * requested instance type -> CapacityError for the instance type; everything else (other codes, an Unsupported
 * configuration, InvalidInstanceID.NotFound, timeouts, connection errors) -> CloudError. The EC2 error is the cause.
 */
export function classifyEc2Error(err: unknown, ctx: Ec2ErrorContext): Error {
  const info = ec2ErrorInfo(err);
  const text = redact(info.message, ctx.secrets ?? []);
  const what =
    info.code !== undefined ? `${info.code}: ${text}` : describeTransportError(err, text, ctx.timeoutMs);
  let message = `ec2 ${ctx.operation}: ${what}`;
  if (info.code === "InvalidInstanceID.NotFound") {
    // EC2's eventual consistency: an instance launched moments ago may be unknown to this call and still run.
    message += " (EC2 may not know a just-launched instance yet; it is not taken as gone)";
  }
  if (isThrottling(info)) {
    const delay = ctx.backoff.next();
    return new CloudRateLimitError(`${message} (no EC2 calls for ${delay / 1000} s)`, {
      earliestRetry: ctx.now + delay,
      cause: err,
    });
  }
  const code = info.code;
  if (code === undefined) return new CloudError(message, { cause: err });
  if (QUOTA_CODES.has(code)) return new CloudQuotaError(message, { cause: err });
  const type = ctx.instanceType;
  if (type !== undefined) {
    if (QUOTA_GROUP_CAPACITY_CODES.has(code) && ctx.quotaGroup !== undefined) {
      return new CapacityError(message, {
        scope: "quotaGroup",
        instanceType: type.name,
        quotaGroup: ctx.quotaGroup,
        cause: err,
      });
    }
    if (isSubnetFull(info)) {
      return new CapacityError(`${message} (no free address: no instance of any type can launch there)`, {
        scope: "all",
        instanceType: type.name,
        cause: err,
      });
    }
    const unsupportedType =
      (code === "Unsupported" || /not supported/i.test(text)) && namesType(text, type.providerType);
    if (TYPE_CAPACITY_CODES.has(code) || unsupportedType) {
      return new CapacityError(message, { scope: "instanceType", instanceType: type.name, cause: err });
    }
  }
  return new CloudError(message, { cause: err });
}

function describeTransportError(err: unknown, text: string, timeoutMs: number | undefined): string {
  const e = err as { name?: unknown; code?: unknown } | null;
  const name = typeof e?.name === "string" ? e.name : "Error";
  const sysCode = typeof e?.code === "string" ? ` (${e.code})` : "";
  // The SDK names a reset connection TimeoutError too: it was no timeout, the connection closed.
  if (e?.code === "ECONNRESET" || e?.code === "EPIPE" || e?.code === "ECONNABORTED") {
    return `the connection closed without an answer: ${text}${sysCode}`;
  }
  if (name === "TimeoutError" || e?.code === "ETIMEDOUT") {
    return `no answer${timeoutMs === undefined ? "" : ` within ${timeoutMs} ms`}: ${text}${sysCode}`;
  }
  return `request failed: ${name}${sysCode}: ${text}`;
}

function redact(text: string, secrets: readonly string[]): string {
  let out = text;
  for (const s of secrets) if (s.length >= 4) out = out.split(s).join("***");
  return out;
}
