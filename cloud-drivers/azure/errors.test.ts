import { AbortError } from "@azure/abort-controller";
import { createHttpHeaders, RestError } from "@azure/core-rest-pipeline";
import { describe, expect, it } from "vitest";
import { CapacityError, CloudError, CloudQuotaError, CloudRateLimitError } from "../errors.ts";
import {
  type AzureErrorContext,
  armErrorCode,
  azureErrorInfo,
  busyRetryAfterMs,
  classifyAzureError,
  DEFAULT_RETRY_AFTER_MS,
  isNotFound,
  isResourceBusy,
  outcomeUnknown,
} from "./errors.ts";

const NOW = Date.parse("2026-03-01T12:00:00Z");
const TYPE = { name: "d2s", providerType: "Standard_D2s_v3" };
const CREATE: AzureErrorContext = {
  operation: "create VM dc-x",
  now: NOW,
  instanceType: TYPE,
  quotaGroup: "dsv3",
};

/** A RestError as the SDK builds it from an ARM error answer. */
function armError(
  status: number,
  code: string,
  message: string,
  headers: Record<string, string> = {},
): RestError {
  return new RestError(message, {
    statusCode: status,
    code,
    response: {
      status,
      headers: createHttpHeaders(headers),
      request: undefined as never,
    },
  });
}

/** What core-lro throws when an accepted operation ends Failed. */
function failedOperation(code: string, message: string): Error {
  return new Error(`The long-running operation has failed. ${code}. ${message}`);
}

describe("classifyAzureError", () => {
  it("429 -> rate limit at now + Retry-After seconds", () => {
    const err = classifyAzureError(
      armError(429, "TooManyRequests", "slow down", { "Retry-After": "7" }),
      CREATE,
    ) as CloudRateLimitError;
    expect(err).toBeInstanceOf(CloudRateLimitError);
    expect(err.earliestRetry).toBe(NOW + 7000);
    expect(err.code).toBe("cloud.rate_limit");
    expect(err.message).toContain("azure create VM dc-x: TooManyRequests: slow down");
  });

  it("Retry-After as an HTTP date, and retry-after-ms", () => {
    const date = new Date(NOW + 12_000).toUTCString();
    const byDate = classifyAzureError(armError(429, "x", "m", { "retry-after": date }), CREATE);
    expect((byDate as CloudRateLimitError).earliestRetry).toBe(NOW + 12_000);
    const ms = classifyAzureError(armError(429, "x", "m", { "retry-after-ms": "1500" }), CREATE);
    expect((ms as CloudRateLimitError).earliestRetry).toBe(NOW + 1500);
  });

  it("429 without a usable Retry-After -> 20 s", () => {
    for (const headers of [{}, { "Retry-After": "soon" }]) {
      const err = classifyAzureError(armError(429, "SubscriptionRequestsThrottled", "m", headers), CREATE);
      expect((err as CloudRateLimitError).earliestRetry).toBe(NOW + DEFAULT_RETRY_AFTER_MS);
    }
    expect(DEFAULT_RETRY_AFTER_MS).toBe(20_000);
  });

  it("any error answer with Retry-After (e.g. 503) -> rate limit", () => {
    const err = classifyAzureError(
      armError(503, "ServiceUnavailable", "busy", { "Retry-After": "3" }),
      CREATE,
    );
    expect(err).toBeInstanceOf(CloudRateLimitError);
    expect((err as CloudRateLimitError).earliestRetry).toBe(NOW + 3000);
  });

  it.each([
    "SkuNotAvailable",
    "AllocationFailed",
    "ZonalAllocationFailed",
    "OverconstrainedAllocationRequest",
    "OverconstrainedZonalAllocationRequest",
  ])("%s (sync or from a failed operation) -> capacity for the instance type", (code) => {
    for (const raw of [armError(409, code, "no room"), failedOperation(code, "no room")]) {
      const err = classifyAzureError(raw, CREATE) as CapacityError;
      expect(err).toBeInstanceOf(CapacityError);
      expect(err.scope).toBe("instanceType");
      expect(err.instanceType).toBe("d2s");
      expect(err.cause).toBe(raw);
    }
  });

  it("a family cores quota -> capacity for the quota group", () => {
    const err = classifyAzureError(
      armError(
        409,
        "OperationNotAllowed",
        "Operation could not be completed as it results in exceeding approved standardDSv3Family Cores quota. Additional details - Current Limit: 10",
      ),
      CREATE,
    ) as CapacityError;
    expect(err).toBeInstanceOf(CapacityError);
    expect(err.scope).toBe("quotaGroup");
    expect(err.quotaGroup).toBe("dsv3");
  });

  it.each([
    [
      "OperationNotAllowed",
      "Operation could not be completed as it results in exceeding approved Total Regional Cores quota.",
    ],
    [
      "OperationNotAllowed",
      "Operation could not be completed as it results in exceeding approved Low Priority Cores quota.",
    ],
    ["QuotaExceeded", "Operation results in exceeding quota limits of Core."],
    ["NetworkInterfaceCountLimitReached", "Cannot create more than 65536 network interfaces."],
    ["PublicIPCountLimitExceeded", "limit"],
    ["SubnetIsFull", "Subnet default does not have enough capacity for 1 IP addresses."],
  ])("%s: %s -> quota", (code, message) => {
    const err = classifyAzureError(armError(409, code, message), CREATE);
    expect(err).toBeInstanceOf(CloudQuotaError);
    expect(err.message).toContain(code);
  });

  it.each([
    [armError(401, "InvalidAuthenticationToken", "The access token is invalid.")],
    [armError(403, "AuthorizationFailed", "The client does not have authorization")],
    [armError(404, "ResourceGroupNotFound", "Resource group 'x' could not be found.")],
    [armError(500, "InternalServerError", "boom")],
    [armError(409, "OperationNotAllowed", "The virtual machine is being deleted.")],
    [failedOperation("InternalServerError", "failed after accept")],
    [new Error("The long-running operation has failed")],
    [new RestError("connect ECONNREFUSED 127.0.0.1:1", { code: "ECONNREFUSED" })],
    [new TypeError("weird")],
    ["a string"],
  ])("%s -> CloudError", (raw) => {
    const err = classifyAzureError(raw, CREATE);
    expect(err).toBeInstanceOf(CloudError);
    expect(err.cause).toBe(raw);
  });

  it("capacity codes outside a create are plain errors (no type to block)", () => {
    const err = classifyAzureError(armError(409, "SkuNotAvailable", "x"), {
      operation: "list VMs",
      now: NOW,
    });
    expect(err).toBeInstanceOf(CloudError);
  });

  it("a request past its timeout says so", () => {
    const err = classifyAzureError(new AbortError("The operation was aborted."), {
      ...CREATE,
      timeoutMs: 5000,
    });
    expect(err).toBeInstanceOf(CloudError);
    expect(err.message).toBe("azure create VM dc-x: no answer within 5000 ms");
  });

  it("a transport error names its system code", () => {
    const err = classifyAzureError(new RestError("connect ECONNREFUSED", { code: "ECONNREFUSED" }), CREATE);
    expect(err.message).toContain("RestError (ECONNREFUSED)");
  });

  it("never shows a secret", () => {
    const secret = "Qx8~verySecretClientValue";
    const err = classifyAzureError(armError(401, "invalid_client", `bad secret ${secret}`), {
      ...CREATE,
      secrets: [secret],
    });
    expect(err.message).not.toContain(secret);
    expect(err.message).toContain("***");
  });

  it("reads the code of a failed operation from core-lro's message", () => {
    const info = azureErrorInfo(failedOperation("AllocationFailed", "Allocation failed. Try again."), NOW);
    expect(info).toMatchObject({
      code: "AllocationFailed",
      operationFailed: true,
      message: "Allocation failed. Try again.",
    });
  });

  it("RetryableErrorDueToAnotherOperation (429 with Retry-After): a busy resource, CloudError, not a rate limit", () => {
    const busy = armError(
      429,
      "RetryableErrorDueToAnotherOperation",
      "Operation DeleteNetworkInterfaceOperation (x) is updating resource /subscriptions/s/resourceGroups/r/providers/Microsoft.Network/networkInterfaces/n. The call can be retried in 13 seconds.",
      { "Retry-After": "13" },
    );
    const err = classifyAzureError(busy, { operation: "delete NIC n", now: NOW });
    expect(err).toBeInstanceOf(CloudError);
    expect(err).not.toBeInstanceOf(CloudRateLimitError);
    expect((err as CloudError).code).toBe("cloud.error");
    expect(err.message).toMatch(
      /^azure delete NIC n: RetryableErrorDueToAnotherOperation: .*not a rate limit\)$/,
    );
    expect(isResourceBusy(busy)).toBe(true);
    expect(isResourceBusy(err)).toBe(true); // through its cause
    expect(busyRetryAfterMs(busy, NOW)).toBe(13_000);
    // Without the header, the message's own delay.
    const noHeader = armError(
      429,
      "RetryableErrorDueToAnotherOperation",
      "... The call can be retried in 4 seconds.",
    );
    expect(busyRetryAfterMs(noHeader, NOW)).toBe(4000);
    expect(classifyAzureError(armError(409, "AnotherOperationInProgress", "busy"), CREATE)).toBeInstanceOf(
      CloudError,
    );
    expect(isResourceBusy(armError(429, "TooManyRequests", "slow down"))).toBe(false);
  });

  it("an image Azure cannot find: a CloudError that says so, never capacity", () => {
    for (const [status, code, message] of [
      [
        404,
        "NotFound",
        "The Image '/subscriptions/s/resourceGroups/r/providers/Microsoft.Compute/images/x' cannot be found in 'westus2' region.",
      ],
      [
        404,
        "GalleryImageNotFound",
        "The gallery image /subscriptions/s/.../versions/1.0.0 is not available in westus2 region.",
      ],
    ] as const) {
      const err = classifyAzureError(armError(status, code, message), CREATE);
      expect(err).toBeInstanceOf(CloudError);
      expect(err).not.toBeInstanceOf(CapacityError);
      expect(err.message).toContain(`${code}: ${message}`);
      expect(err.message).toContain(
        "the image does not exist in this region, or cannot be read: check cloud.imageId",
      );
    }
  });

  it("outcomeUnknown: no answer, or a 5xx, may have been done; a 4xx or a failed operation was not", () => {
    expect(outcomeUnknown(new AbortError("The operation was aborted."))).toBe(true);
    expect(outcomeUnknown(new RestError("socket hang up", { code: "ECONNRESET" }))).toBe(true);
    expect(outcomeUnknown(armError(500, "InternalServerError", "x"))).toBe(true);
    expect(outcomeUnknown(armError(429, "TooManyRequests", "x"))).toBe(false);
    expect(outcomeUnknown(armError(409, "SkuNotAvailable", "x"))).toBe(false);
    expect(outcomeUnknown(failedOperation("AllocationFailed", "x"))).toBe(false);
  });

  it("armErrorCode reads a driver error's cause", () => {
    const sdk = armError(400, "NicInUse", "in use");
    expect(armErrorCode(sdk)).toBe("NicInUse");
    expect(armErrorCode(classifyAzureError(sdk, { operation: "delete NIC n", now: NOW }))).toBe("NicInUse");
    expect(armErrorCode(new Error("x"))).toBeUndefined();
  });

  it("isNotFound", () => {
    expect(isNotFound(armError(404, "ResourceNotFound", "gone"))).toBe(true);
    expect(isNotFound(armError(404, "NotFound", "gone"))).toBe(true);
    expect(isNotFound(armError(409, "Conflict", "x"))).toBe(false);
    expect(isNotFound(new Error("404"))).toBe(false);
  });
});
