import { EC2ServiceException } from "@aws-sdk/client-ec2";
import { describe, expect, it } from "vitest";
import { FakeClock } from "../../test/fake-clock.ts";
import { CapacityError, CloudError, CloudQuotaError, CloudRateLimitError } from "../errors.ts";
import {
  classifyEc2Error,
  type Ec2ErrorContext,
  ec2ErrorInfo,
  isLostAnswer,
  isSubnetSpecific,
  QUOTA_CODES,
  THROTTLING_CODES,
  ThrottleBackoff,
} from "./errors.ts";

/** An error as the SDK throws it for an EC2 error answer. */
function ec2Error(code: string, status = 400, message = `${code} happened`): EC2ServiceException {
  const err = new EC2ServiceException({
    name: code,
    $fault: status >= 500 ? "server" : "client",
    $metadata: { httpStatusCode: status, requestId: "req-1" },
    message,
  });
  return Object.assign(err, { Code: code });
}

const TYPE = { name: "m5l", providerType: "m5.large" };

function ctx(extra: Partial<Ec2ErrorContext> = {}): Ec2ErrorContext {
  return {
    operation: "RunInstances",
    now: Date.UTC(2026, 0, 1),
    backoff: new ThrottleBackoff(),
    instanceType: TYPE,
    quotaGroup: "m",
    ...extra,
  };
}

describe("classifyEc2Error", () => {
  it.each([...THROTTLING_CODES].map((code) => [code]))("%s -> CloudRateLimitError", (code) => {
    const c = ctx();
    const err = classifyEc2Error(ec2Error(code, 503), c);
    expect(err).toBeInstanceOf(CloudRateLimitError);
    expect((err as CloudRateLimitError).earliestRetry).toBe(c.now + 1000);
    expect(err.message).toContain(`ec2 RunInstances: ${code}`);
  });

  it("HTTP 429 with any code is throttling too", () => {
    expect(classifyEc2Error(ec2Error("SomethingNew", 429), ctx())).toBeInstanceOf(CloudRateLimitError);
  });

  it.each([...QUOTA_CODES].map((code) => [code]))("%s -> CloudQuotaError", (code) => {
    const err = classifyEc2Error(ec2Error(code), ctx());
    expect(err).toBeInstanceOf(CloudQuotaError);
    expect(err.message).toBe(`ec2 RunInstances: ${code}: ${code} happened`);
    expect(err.cause).toBeInstanceOf(EC2ServiceException);
  });

  it.each(["VcpuLimitExceeded", "MaxSpotInstanceCountExceeded"])(
    "%s -> CapacityError for the type's quota group (not a quota for every type)",
    (code) => {
      const err = classifyEc2Error(ec2Error(code), ctx({ quotaGroup: "m-spot" }));
      expect(err).toBeInstanceOf(CapacityError);
      expect(err).not.toBeInstanceOf(CloudQuotaError);
      expect(err).toMatchObject({ scope: "quotaGroup", quotaGroup: "m-spot", instanceType: "m5l" });
    },
  );

  it.each([
    ["InsufficientFreeAddressesInSubnet", "There are not enough free addresses in subnet 'subnet-1a'."],
    ["InvalidParameterValue", "Not enough free addresses in subnet subnet-1a."],
    ["InvalidParameterValue", "There aren't sufficient free Ipv4 addresses or prefixes"],
    ["InvalidParameterCombination", "There aren't sufficient free IPv6 addresses in the subnet"],
  ])("a subnet out of addresses (%s: %s) -> CapacityError for every type", (code, message) => {
    const err = classifyEc2Error(ec2Error(code, 400, message), ctx());
    expect(err).toBeInstanceOf(CapacityError);
    expect(err).toMatchObject({ scope: "all", code: "cloud.capacity" });
    expect(err.message).toContain(message);
  });

  it.each([
    [
      "Unsupported",
      "The requested configuration is currently not supported. Please check the documentation.",
    ],
    ["Unsupported", "The instance type c5.large is not supported in this zone"],
    ["InvalidParameterValue", "Not enough free space"],
  ])("%s without the requested type named (%s) -> CloudError, not capacity", (code, message) => {
    const err = classifyEc2Error(ec2Error(code, 400, message), ctx());
    expect(err).toBeInstanceOf(CloudError);
    expect(err).not.toBeInstanceOf(CapacityError);
  });

  it("InvalidInstanceID.NotFound -> CloudError saying it is not taken as gone", () => {
    const err = classifyEc2Error(
      ec2Error("InvalidInstanceID.NotFound", 400, "The instance ID 'i-1' does not exist"),
      ctx({ operation: "TerminateInstances" }),
    );
    expect(err).toBeInstanceOf(CloudError);
    expect(err.message).toBe(
      "ec2 TerminateInstances: InvalidInstanceID.NotFound: The instance ID 'i-1' does not exist " +
        "(EC2 may not know a just-launched instance yet; it is not taken as gone)",
    );
  });

  it.each([
    ["InsufficientInstanceCapacity", "We currently do not have sufficient m5.large capacity"],
    [
      "Unsupported",
      "Your requested instance type (m5.large) is not supported in your requested Availability Zone",
    ],
    ["SpotMaxPriceTooLow", "Your Spot request price of 0.01 is lower than the minimum required Spot request"],
    ["InvalidParameterValue", "The instance type 'm5.large' is not supported for this AMI"],
    ["InvalidParameterCombination", "Instance type m5.large is not supported with spot"],
  ])("%s -> CapacityError for the instance type", (code, message) => {
    const err = classifyEc2Error(ec2Error(code, 400, message), ctx());
    expect(err).toBeInstanceOf(CapacityError);
    expect(err).toMatchObject({ scope: "instanceType", instanceType: "m5l" });
  });

  it.each([
    ["InternalError", 500],
    ["Unavailable", 503],
    ["AuthFailure", 401],
    ["UnauthorizedOperation", 403],
    ["InvalidAMIID.NotFound", 400],
    ["InvalidSubnetID.NotFound", 400],
    ["InvalidParameterValue", 400],
  ] as const)("%s (%i) -> CloudError", (code, status) => {
    const err = classifyEc2Error(ec2Error(code, status), ctx());
    expect(err).toBeInstanceOf(CloudError);
    expect(err.message).toContain(code);
  });

  it("capacity codes outside a create (no instance type) are plain CloudErrors", () => {
    const c = { operation: "DescribeInstances", now: 0, backoff: new ThrottleBackoff() };
    expect(classifyEc2Error(ec2Error("InsufficientInstanceCapacity"), c)).toBeInstanceOf(CloudError);
    expect(classifyEc2Error(ec2Error("VcpuLimitExceeded"), c)).toBeInstanceOf(CloudError);
    // Quota and throttling need no type.
    expect(classifyEc2Error(ec2Error("InstanceLimitExceeded"), c)).toBeInstanceOf(CloudQuotaError);
    expect(classifyEc2Error(ec2Error("RequestLimitExceeded", 503), c)).toBeInstanceOf(CloudRateLimitError);
  });

  it("timeouts and connection errors are CloudErrors naming the operation", () => {
    const timeout = Object.assign(new Error("a request has exceeded the configured 300 ms requestTimeout."), {
      name: "TimeoutError",
      code: "ETIMEDOUT",
    });
    const t = classifyEc2Error(timeout, ctx({ operation: "DescribeInstances", timeoutMs: 300 }));
    expect(t).toBeInstanceOf(CloudError);
    expect(t.message).toMatch(/^ec2 DescribeInstances: no answer within 300 ms/);
    const refused = Object.assign(new Error("connect ECONNREFUSED 127.0.0.1:1"), { code: "ECONNREFUSED" });
    const r = classifyEc2Error(refused, ctx());
    expect(r).toBeInstanceOf(CloudError);
    expect(r.message).toBe(
      "ec2 RunInstances: request failed: Error (ECONNREFUSED): connect ECONNREFUSED 127.0.0.1:1",
    );
    // The SDK names a reset connection TimeoutError: it is said as what it was.
    const reset = Object.assign(new Error("socket hang up"), { name: "TimeoutError", code: "ECONNRESET" });
    expect(classifyEc2Error(reset, ctx()).message).toBe(
      "ec2 RunInstances: the connection closed without an answer: socket hang up (ECONNRESET)",
    );
    // A socket error's name is not an EC2 code, even when it looks like one.
    const named = Object.assign(new Error("x"), { name: "RequestLimitExceeded" });
    expect(classifyEc2Error(named, ctx())).toBeInstanceOf(CloudError);
    expect(classifyEc2Error("a string", ctx())).toBeInstanceOf(CloudError);
  });

  it("never repeats a secret that reached an error message", () => {
    const secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    const err = classifyEc2Error(
      ec2Error("AuthFailure", 401, `signature with ${secret} does not match`),
      ctx({ secrets: [secret] }),
    );
    expect(err.message).not.toContain(secret);
    expect(err.message).toContain("***");
  });
});

describe("throttling backoff", () => {
  it("starts at 1 s, grows x1.5 + 1 s per consecutive throttle, stops at 60 s, and resets", async () => {
    const clock = new FakeClock();
    const backoff = new ThrottleBackoff();
    const delays: number[] = [];
    for (let i = 0; i < 12; i++) {
      const err = classifyEc2Error(ec2Error("RequestLimitExceeded", 503), {
        operation: "RunInstances",
        now: clock.now(),
        backoff,
      }) as CloudRateLimitError;
      delays.push(err.earliestRetry - clock.now());
      // The caller waits until earliestRetry before its next call.
      await clock.advance(err.earliestRetry - clock.now());
    }
    expect(delays.slice(0, 5)).toEqual([1000, 2500, 4750, 8125, 13187.5]);
    for (let i = 1; i < delays.length; i++) expect(delays[i]).toBeGreaterThanOrEqual(delays[i - 1]!);
    expect(delays.at(-1)).toBe(60_000);
    expect(Math.max(...delays)).toBe(60_000);
    backoff.reset();
    expect(backoff.current).toBe(0);
    const after = classifyEc2Error(ec2Error("Throttling", 400), {
      operation: "DescribeInstances",
      now: clock.now(),
      backoff,
    }) as CloudRateLimitError;
    expect(after.earliestRetry - clock.now()).toBe(1000);
  });

  it("other errors neither grow nor reset it", () => {
    const backoff = new ThrottleBackoff();
    const c = { operation: "RunInstances", now: 0, backoff };
    classifyEc2Error(ec2Error("RequestLimitExceeded", 503), c);
    classifyEc2Error(ec2Error("InternalError", 500), c);
    expect(backoff.current).toBe(1000);
    expect(
      (classifyEc2Error(ec2Error("RequestLimitExceeded", 503), c) as CloudRateLimitError).earliestRetry,
    ).toBe(2500);
  });
});

describe("subnet-specific errors", () => {
  it.each([
    "InsufficientFreeAddressesInSubnet",
    "InvalidSubnetID.NotFound",
    "InvalidSubnetID.Malformed",
    "InvalidSubnet",
    "InvalidSubnet.Range",
    "InsufficientInstanceCapacity",
    "InsufficientVolumeCapacity",
    "InsufficientAddressCapacity",
    "Unsupported",
    "SpotMaxPriceTooLow",
  ])("%s moves on to the next subnet", (code) => {
    expect(isSubnetSpecific(ec2Error(code))).toBe(true);
  });

  it.each([
    "Not enough free addresses in subnet subnet-1a.",
    "There aren't sufficient free Ipv4 addresses or prefixes",
    "The subnet ID 'subnet-1a' belongs to another VPC than the security groups",
  ])("InvalidParameterValue about the subnet (%s) moves on too", (message) => {
    expect(isSubnetSpecific(ec2Error("InvalidParameterValue", 400, message))).toBe(true);
  });

  it("another InvalidParameterValue does not", () => {
    expect(isSubnetSpecific(ec2Error("InvalidParameterValue", 400, "Invalid value 'x' for UserData"))).toBe(
      false,
    );
  });

  it.each([
    "RequestLimitExceeded",
    "InstanceLimitExceeded",
    "VcpuLimitExceeded",
    "MaxSpotInstanceCountExceeded",
    "InternalError",
    "AuthFailure",
  ])("%s does not", (code) => {
    expect(isSubnetSpecific(ec2Error(code))).toBe(false);
  });

  it("nor does a connection error", () => {
    expect(isSubnetSpecific(new Error("socket hang up"))).toBe(false);
  });
});

describe("isLostAnswer", () => {
  it("is true when EC2 gave no answer (timeout, reset), false for any EC2 answer", () => {
    const reset = Object.assign(new Error("socket hang up"), { name: "TimeoutError", code: "ECONNRESET" });
    expect(isLostAnswer(reset)).toBe(true);
    expect(isLostAnswer(Object.assign(new Error("timed out"), { name: "TimeoutError" }))).toBe(true);
    expect(isLostAnswer(ec2Error("InternalError", 500))).toBe(false);
    expect(isLostAnswer(ec2Error("RequestLimitExceeded", 503))).toBe(false);
  });
});

describe("ec2ErrorInfo", () => {
  it("reads the code and status of an SDK error", () => {
    expect(ec2ErrorInfo(ec2Error("InstanceLimitExceeded", 400, "m"))).toEqual({
      code: "InstanceLimitExceeded",
      status: 400,
      message: "m",
    });
    expect(ec2ErrorInfo(null)).toEqual({ code: undefined, status: undefined, message: "null" });
  });
});
