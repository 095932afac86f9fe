import { describe, expect, it } from "vitest";
import {
  atQuota,
  hhmm,
  inQueue,
  noTypeAvailable,
  onlyHeld,
  startingOn,
  waitingForBoot,
  waitingForIdle,
  waitingForNewInstance,
  waitingToCreate,
  withHint,
} from "./status.ts";

const at = (h: number, m: number, s = 0) => Date.UTC(2026, 0, 1, h, m, s);

describe("status sentences", () => {
  it("formats times as HH:MM UTC", () => {
    expect(hhmm(at(10, 42, 59))).toBe("10:42");
    expect(hhmm(at(0, 5))).toBe("00:05");
  });

  it("says what a waiting bundle waits for, with its place in the queue", () => {
    expect(inQueue(3, waitingForBoot("i-123", "m5.large"))).toBe(
      "waiting in queue at position 3: waiting for instance i-123 (m5.large) to boot",
    );
    expect(waitingForNewInstance("m5.large")).toBe("waiting for a new m5.large instance to boot");
    expect(startingOn("i-123")).toBe("starting on i-123");
  });

  it("says at quota with and without a known maximum", () => {
    expect(atQuota(64, 64)).toBe("at quota: 64 of 64 instances");
    expect(atQuota(12, null)).toBe("at quota: the cloud refuses more instances (12 now)");
  });

  it("lists types at capacity, at most three", () => {
    expect(noTypeAvailable([{ typeName: "gpu.large", until: at(10, 42) }])).toBe(
      "no instance type is available: gpu.large at capacity until 10:42",
    );
    const many = ["a", "b", "c", "d", "e"].map((typeName) => ({ typeName, until: at(1, 2) }));
    expect(noTypeAvailable(many)).toBe(
      "no instance type is available: a at capacity until 01:02, b at capacity until 01:02, " +
        "c at capacity until 01:02, and 2 more",
    );
  });

  it("says why creates are refused", () => {
    expect(waitingToCreate({ kind: "rate_limit", message: "x", until: at(10, 42) })).toBe(
      "waiting to create an instance: the cloud API is rate-limited until 10:42",
    );
    expect(waitingToCreate({ kind: "max_concurrent", message: "x", inFlight: 2 })).toBe(
      "waiting to create an instance: 2 instance creates are in flight",
    );
    expect(waitingToCreate({ kind: "quota", message: "x", instances: 3, max: 3, until: null })).toBe(
      "at quota: 3 of 3 instances",
    );
  });

  it("adds a hint about existing instances", () => {
    expect(withHint(atQuota(1, 1), waitingForIdle("small"))).toBe(
      "at quota: 1 of 1 instances; waiting for an idle instance of type small",
    );
    expect(withHint(atQuota(1, 1), onlyHeld("small"))).toBe(
      "at quota: 1 of 1 instances; only held instances of type small could run it",
    );
    expect(withHint("x", null)).toBe("x");
  });
});
