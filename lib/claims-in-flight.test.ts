import { describe, expect, it } from "vitest";
import { ClaimsInFlight } from "./claims-in-flight.ts";

describe("ClaimsInFlight", () => {
  it("holds a claim until it answers, however it answers, then forgets it", async () => {
    const claims = new ClaimsInFlight();
    let fail: (err: Error) => void = () => {};
    const failing = new Promise((_, reject) => {
      fail = reject;
    });
    let succeed: (v: unknown) => void = () => {};
    claims.add("a", failing);
    claims.add("b", new Promise((r) => (succeed = r)));
    expect(claims.settled("c")).toBeUndefined();
    const a = claims.settled("a");
    expect(a).toBeDefined();
    expect(claims.size).toBe(2);
    fail(new Error("the database went away"));
    // A failed claim is waited for like any other (the waiter then finds the token unknown): never a rejection.
    await expect(a).resolves.toBeUndefined();
    expect(claims.settled("a")).toBeUndefined();
    succeed({ ok: true });
    await claims.settled("b");
    expect(claims.size).toBe(0);
  });
});
