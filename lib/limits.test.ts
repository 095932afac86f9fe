import { describe, expect, it } from "vitest";
import { FakeClock, flushMicrotasks } from "../test/fake-clock.ts";
import { ConcurrencyLimit, type Permit, RateLimit } from "./limits.ts";

describe("ConcurrencyLimit", () => {
  it("hands slots out first come first served; a waiter that gives up is skipped; release is idempotent", async () => {
    const clock = new FakeClock();
    const limit = new ConcurrencyLimit({ max: 1, countForMs: Number.POSITIVE_INFINITY, clock });
    const got: string[] = [];
    const first = await limit.acquire();
    const quitter = new AbortController();
    const second = limit.acquire(quitter.signal);
    const third = limit.acquire().then((p) => {
      got.push("third");
      return p;
    });
    quitter.abort(new Error("gave up"));
    await expect(second).rejects.toThrow("gave up");
    expect(limit.waiting).toBe(1);
    first.release();
    first.release();
    const p: Permit = await third;
    expect(got).toEqual(["third"]);
    expect(limit.active).toBe(1);
    p.release();
    expect(limit.active).toBe(0);
  });

  it("stops counting a holder after countForMs, so a waiter gets its slot", async () => {
    const clock = new FakeClock();
    const limit = new ConcurrencyLimit({ max: 1, countForMs: 5000, clock });
    const hung = await limit.acquire();
    let next: Permit | null = null;
    void limit.acquire().then((p) => {
      next = p;
    });
    await clock.advance(4999);
    expect(next).toBeNull();
    await clock.advance(1);
    await flushMicrotasks();
    expect(next).not.toBeNull();
    expect(limit.slow).toBe(1);
    // The slow holder's late release does not free a second slot.
    hung.release();
    expect(limit.active).toBe(1);
  });

  it("has no limit at max 0", async () => {
    const limit = new ConcurrencyLimit({ max: 0, countForMs: 5000, clock: new FakeClock() });
    await Promise.all(Array.from({ length: 100 }, () => limit.acquire()));
    expect(limit.waiting).toBe(0);
  });
});

describe("RateLimit", () => {
  it("lets one second's worth through at once, then one every 1/rate seconds", async () => {
    const clock = new FakeClock();
    const rate = new RateLimit(4, clock);
    const passed: number[] = [];
    for (let i = 0; i < 6; i++) void rate.take().then(() => passed.push(i));
    await flushMicrotasks();
    expect(passed).toEqual([0, 1, 2, 3]);
    await clock.advance(250);
    expect(passed).toEqual([0, 1, 2, 3, 4]);
    await clock.advance(250);
    expect(passed).toEqual([0, 1, 2, 3, 4, 5]);
  });
});
