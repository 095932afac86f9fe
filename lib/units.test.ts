import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "./errors.ts";
import { formatDuration, formatSize, parseDuration, parseSize } from "./units.ts";

function errorOf(fn: () => unknown): DispatchCloudError {
  try {
    fn();
  } catch (err) {
    expect(err).toBeInstanceOf(DispatchCloudError);
    return err as DispatchCloudError;
  }
  throw new Error("expected an error");
}

describe("parseDuration", () => {
  it.each([
    ["500ms", 500],
    ["10s", 10_000],
    ["1m", 60_000],
    ["1m30s", 90_000],
    ["2h", 7_200_000],
    ["1.5h", 5_400_000],
    ["1d", 86_400_000],
    ["0", 0],
    ["0s", 0],
    [" 10s ", 10_000],
    ["1h2m3s4ms", 3_723_004],
  ])("reads %j as %d ms", (text, ms) => {
    expect(parseDuration(text)).toBe(ms);
  });

  it("rejects a bare number with a hint to add a unit", () => {
    const err = errorOf(() => parseDuration("10"));
    expect(err.code).toBe("config.invalid_value");
    expect(err.message).toContain('"10s"');
    expect(errorOf(() => parseDuration(10 as unknown as string)).message).toContain('"10s"');
  });

  it("rejects unknown units and lists the valid ones", () => {
    const err = errorOf(() => parseDuration("10x"));
    expect(err.message).toContain('unknown unit "x"');
    expect(err.message).toContain("ms, s, m, h, d");
  });

  it.each(["", "abc", "s", "1h30", "10 s", "--1s", "NaN", "Infinitys"])("rejects %j", (text) => {
    expect(errorOf(() => parseDuration(text)).code).toBe("config.invalid_value");
  });

  it("rejects negative durations", () => {
    expect(errorOf(() => parseDuration("-5s")).message).toContain("negative");
  });

  it("rejects durations past Number.MAX_SAFE_INTEGER milliseconds", () => {
    expect(errorOf(() => parseDuration("9999999999999999d")).message).toContain("too large");
  });
});

describe("formatDuration", () => {
  it.each([
    [0, "0s"],
    [500, "500ms"],
    [10_000, "10s"],
    [90_000, "1m30s"],
    [7_200_000, "2h"],
    [1_500, "1s500ms"],
    [86_400_000, "24h"],
  ])("writes %d ms as %j", (ms, text) => {
    expect(formatDuration(ms)).toBe(text);
  });

  it("round-trips through parseDuration", () => {
    for (const ms of [1, 999, 1000, 61_001, 3_600_000, 123_456_789, Number.MAX_SAFE_INTEGER]) {
      expect(parseDuration(formatDuration(ms))).toBe(ms);
    }
  });

  it.each([-1, 1.5, Number.NaN, Number.POSITIVE_INFINITY])("rejects %d", (ms) => {
    expect(errorOf(() => formatDuration(ms)).code).toBe("config.invalid_value");
  });
});

describe("parseSize", () => {
  it.each([
    ["4GiB", 4 * 2 ** 30],
    ["512MiB", 512 * 2 ** 20],
    ["1.5GB", 1_500_000_000],
    ["1KB", 1000],
    ["1KiB", 1024],
    ["2TiB", 2 * 2 ** 40],
    ["1PB", 1e15],
    ["1024", 1024],
    ["1024B", 1024],
    ["10 GiB", 10 * 2 ** 30],
    [0, 0],
    [4096, 4096],
  ] as const)("reads %j as %d bytes", (value, bytes) => {
    expect(parseSize(value)).toBe(bytes);
  });

  it("rejects 4XB and lists the valid units", () => {
    const err = errorOf(() => parseSize("4XB"));
    expect(err.code).toBe("config.invalid_value");
    expect(err.message).toContain('unknown size unit "XB"');
    expect(err.message).toContain("KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB");
  });

  it.each(["", "GiB", "abc", "1.5", "1.5B", "four", "1e3"])("rejects %j", (text) => {
    expect(errorOf(() => parseSize(text)).code).toBe("config.invalid_value");
  });

  it.each([-1, 1.5, Number.NaN, Number.POSITIVE_INFINITY])("rejects the number %d", (n) => {
    expect(errorOf(() => parseSize(n)).code).toBe("config.invalid_value");
  });

  it("rejects negative sizes and sizes past Number.MAX_SAFE_INTEGER", () => {
    expect(errorOf(() => parseSize("-1GiB")).message).toContain("negative");
    expect(errorOf(() => parseSize("9000PiB")).message).toContain("too large");
    expect(errorOf(() => parseSize(2 ** 60)).message).toContain("too large");
  });
});

describe("formatSize", () => {
  it.each([
    [0, "0B"],
    [1024, "1KiB"],
    [2 * 2 ** 30, "2GiB"],
    [550 * 2 ** 20, "550MiB"],
    [1_000_000, "1MB"],
    [1_500_000_000, "1500MB"],
    [1_610_612_736 + 1, "1610612737B"],
    [1536, "1536B"],
    [1536 * 2 ** 20, "1536MiB"],
    [1001, "1001B"],
  ])("writes %d bytes as %j", (bytes, text) => {
    expect(formatSize(bytes)).toBe(text);
  });

  it("round-trips through parseSize", () => {
    for (const bytes of [1, 999, 1023, 1025, 123_456_789, 3 * 2 ** 40 + 7, Number.MAX_SAFE_INTEGER]) {
      expect(parseSize(formatSize(bytes))).toBe(bytes);
    }
  });

  it.each([-1, 0.5, Number.NaN])("rejects %d", (bytes) => {
    expect(errorOf(() => formatSize(bytes)).code).toBe("config.invalid_value");
  });
});
