import { describe, expect, it } from "vitest";
import { parseCount, parseLogQuery } from "./logs.ts";

describe("parseLogQuery", () => {
  it("defaults to stdout of the current attempt, not following", () => {
    expect(parseLogQuery({})).toEqual({ stream: "stdout", follow: false, attempt: null });
    expect(parseLogQuery(undefined)).toEqual({ stream: "stdout", follow: false, attempt: null });
  });

  it("reads stream, follow and attempt", () => {
    expect(parseLogQuery({ stream: "stderr", follow: "1", attempt: "2" })).toEqual({
      stream: "stderr",
      follow: true,
      attempt: 2,
    });
    expect(parseLogQuery({ follow: "true" }).follow).toBe(true);
    expect(parseLogQuery({ follow: "0" }).follow).toBe(false);
    expect(parseLogQuery({ attempt: "2147483647" }).attempt).toBe(2 ** 31 - 1);
  });

  it("refuses anything else with the parameter's path", () => {
    for (const [query, path] of [
      [{ stream: "stdin" }, "stream"],
      [{ stream: ["stdout", "stderr"] }, "stream"],
      [{ follow: "yes" }, "follow"],
      [{ attempt: "0" }, "attempt"],
      [{ attempt: "-1" }, "attempt"],
      [{ attempt: "1e3" }, "attempt"],
      // The attempt column is a PostgreSQL integer (int4).
      [{ attempt: "2147483648" }, "attempt"],
      [{ attempt: "9007199254740991" }, "attempt"],
      [{ tail: "10" }, "tail"],
    ] as const) {
      expect(() => parseLogQuery(query), JSON.stringify(query)).toThrow(
        expect.objectContaining({ code: "request.invalid_query", path }),
      );
    }
  });
});

describe("parseCount", () => {
  it("takes decimal whole numbers up to 2^53 - 1", () => {
    expect(parseCount("offset", "0")).toBe(0);
    expect(parseCount("offset", "9007199254740991")).toBe(2 ** 53 - 1);
    for (const bad of ["", "01", "+1", "1.0", "0x10", "9007199254740992", " 1", "99999999999999999"]) {
      expect(() => parseCount("offset", bad), bad).toThrow(expect.objectContaining({ path: "offset" }));
    }
  });
});

describe("parseCount with a maximum", () => {
  it("refuses numbers above it, with the parameter's path", () => {
    expect(parseCount("n", "10", 1, 10)).toBe(10);
    expect(() => parseCount("n", "11", 1, 10)).toThrow(
      expect.objectContaining({ code: "request.invalid_query", path: "n" }),
    );
  });
});
