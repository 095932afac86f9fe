import { describe, expect, it } from "vitest";
import type { Digest } from "../../lib/cas/digest.ts";
import { TOUCH_RESOLUTION_MS } from "../../store/cas-queries.ts";
import { cacheTtlFor, MAX_CACHE_TTL_MS, ReadableCache } from "./readable-cache.ts";

const d = (i: number, size = 10): Digest => ({ hash: i.toString(16).padStart(64, "0"), size });

describe("ReadableCache", () => {
  it("knows what was added for a user, with the same size, and nothing for others", () => {
    const c = new ReadableCache({ ttlMs: 60_000, nowMs: () => 0 });
    c.add("u", [d(1), d(2)]);
    expect(c.unknown("u", [d(1), d(2), d(3), d(1, 11)])).toEqual([d(3), d(1, 11)]);
    expect(c.unknown("v", [d(1)])).toEqual([d(1)]);
    expect(c.size).toBe(2);
  });

  it("an entry lives between half the life and the whole life", () => {
    let now = 0;
    const c = new ReadableCache({ ttlMs: 60_000, nowMs: () => now });
    c.add("u", [d(1)]);
    now = 29_999;
    expect(c.unknown("u", [d(1)])).toEqual([]);
    now = 30_000; // the generation rotates: still known, as the previous one
    expect(c.unknown("u", [d(1)])).toEqual([]);
    now = 59_999;
    expect(c.unknown("u", [d(1)])).toEqual([]);
    now = 60_000;
    expect(c.unknown("u", [d(1)])).toEqual([d(1)]);
    // Nothing heard for a long time: gone at once.
    c.add("u", [d(2)]);
    now = 500_000;
    expect(c.unknown("u", [d(2)])).toEqual([d(2)]);
  });

  it("holds at most maxEntries, dropping the oldest generation", () => {
    const c = new ReadableCache({ ttlMs: 60_000, maxEntries: 10, nowMs: () => 0 });
    c.add(
      "u",
      Array.from({ length: 8 }, (_, i) => d(i)),
    );
    expect(c.size).toBe(5);
    c.add(
      "u",
      Array.from({ length: 8 }, (_, i) => d(100 + i)),
    );
    expect(c.size).toBeLessThanOrEqual(10);
    c.add(
      "u",
      Array.from({ length: 8 }, (_, i) => d(200 + i)),
    );
    expect(c.size).toBeLessThanOrEqual(10);
    expect(c.unknown("u", [d(0)])).toEqual([d(0)]);
  });

  it("forgets one user, or everything", () => {
    const c = new ReadableCache({ ttlMs: 60_000, nowMs: () => 0 });
    c.add("u", [d(1)]);
    c.add("v", [d(1)]);
    c.forgetUser("u");
    expect(c.unknown("u", [d(1)])).toEqual([d(1)]);
    expect(c.unknown("v", [d(1)])).toEqual([]);
    expect(c.size).toBe(1);
    c.clear();
    expect(c.unknown("v", [d(1)])).toEqual([d(1)]);
  });

  it("is off when the life is 0", () => {
    const c = new ReadableCache({ ttlMs: 0, nowMs: () => 0 });
    c.add("u", [d(1)]);
    expect(c.unknown("u", [d(1)])).toEqual([d(1)]);
    expect(c.size).toBe(0);
  });

  it("lives well inside what garbage collection leaves a touched blob", () => {
    expect(cacheTtlFor(7 * 86_400_000)).toBe(MAX_CACHE_TTL_MS);
    expect(cacheTtlFor(TOUCH_RESOLUTION_MS + 60_000)).toBe(30_000);
    expect(cacheTtlFor(TOUCH_RESOLUTION_MS)).toBe(0);
    expect(cacheTtlFor(1000)).toBe(0);
  });
});
