import { describe, expect, it } from "vitest";
import { DispatchCloudError, ERROR_CODES } from "../lib/errors.ts";
import {
  CapacityError,
  CLOUD_ERROR_CODES,
  CloudError,
  CloudQuotaError,
  CloudRateLimitError,
  cloudErrorCode,
  isCapacityError,
  isCloudError,
  isCloudQuotaError,
  isCloudRateLimitError,
} from "./errors.ts";

describe("cloud errors", () => {
  const cause = new Error("RequestLimitExceeded");
  const rate = new CloudRateLimitError("rate limited by the cloud", { earliestRetry: 1_000, cause });
  const quota = new CloudQuotaError("instance quota reached", { cause });
  const capacity = new CapacityError("no capacity for t.big", {
    scope: "instanceType",
    instanceType: "t.big",
    cause,
  });
  const other = new CloudError("create failed", { cause });

  it("carry stable codes, statuses and the provider error as cause", () => {
    const all = [rate, quota, capacity, other];
    expect(all.map((e) => e.code)).toEqual([
      "cloud.rate_limit",
      "cloud.quota",
      "cloud.capacity",
      "cloud.error",
    ]);
    for (const err of all) {
      expect(err).toBeInstanceOf(DispatchCloudError);
      expect(err.cause).toBe(cause);
      expect(err.status).toBe(ERROR_CODES[err.code].status);
      expect(err.toJSON().error.code).toBe(err.code);
    }
    expect(rate.earliestRetry).toBe(1_000);
    expect([capacity.scope, capacity.instanceType, capacity.quotaGroup]).toEqual([
      "instanceType",
      "t.big",
      undefined,
    ]);
    expect(new CloudQuotaError("q").cause).toBeUndefined();
    expect(new CapacityError("c", { scope: "quotaGroup", quotaGroup: "m5" }).quotaGroup).toBe("m5");
  });

  it("type guards tell the classes apart", () => {
    const guards = [isCloudRateLimitError, isCloudQuotaError, isCapacityError, isCloudError];
    const errs = [rate, quota, capacity, other];
    guards.forEach((guard, i) => {
      for (const [j, err] of errs.entries()) expect(guard(err)).toBe(i === j);
      expect(guard(new Error("x"))).toBe(false);
      expect(guard(undefined)).toBe(false);
    });
  });

  it("classify anything else as cloud.error", () => {
    expect([rate, quota, capacity, other].map(cloudErrorCode)).toEqual([...CLOUD_ERROR_CODES]);
    expect(cloudErrorCode(new Error("ECONNRESET"))).toBe("cloud.error");
    expect(cloudErrorCode("a string")).toBe("cloud.error");
    expect(cloudErrorCode(new DispatchCloudError("cloud.instance_gone", "gone"))).toBe("cloud.error");
  });
});
