import { describe, expect, it } from "vitest";
import {
  hasControlCharacter,
  hasLoneSurrogate,
  NO_CONTROL_PATTERN,
  pathLengthProblem,
} from "./text-limits.ts";

describe("text limits", () => {
  it("finds names over 255 bytes and paths over 4096 bytes, counting UTF-8 bytes", () => {
    expect(pathLengthProblem(["x".repeat(255), "y"])).toBeUndefined();
    expect(pathLengthProblem(["x".repeat(256)])).toMatch(/256 bytes/);
    expect(pathLengthProblem(["é".repeat(127)])).toBeUndefined();
    expect(pathLengthProblem(["é".repeat(128)])).toMatch(/256 bytes/);
    expect(pathLengthProblem(Array.from({ length: 16 }, () => "z".repeat(255)))).toBeUndefined();
    expect(pathLengthProblem(Array.from({ length: 17 }, () => "z".repeat(240)))).toBeUndefined();
    expect(pathLengthProblem(Array.from({ length: 18 }, () => "z".repeat(240)))).toMatch(/at most 4096/);
  });

  it("finds lone surrogates, not pairs", () => {
    for (const s of ["\ud800", "a\udbffb", "\udc00", "x\ude80", "\ude80\ud83d", "\ud83d\ud83d"]) {
      expect(hasLoneSurrogate(s), JSON.stringify(s)).toBe(true);
    }
    for (const s of ["", "plain", "🚀", "a\ud83d\ude80b", "\ufffd"]) {
      expect(hasLoneSurrogate(s), JSON.stringify(s)).toBe(false);
    }
  });

  it("finds C0 and C1 controls, DEL and line separators; the schema pattern agrees", () => {
    const pattern = new RegExp(NO_CONTROL_PATTERN);
    for (const s of [
      "a\nb",
      "\r",
      "\t",
      "\u0000",
      "\u001b[31m",
      "\u007f",
      "\u0085",
      "\u009f",
      "\u2028",
      "\u2029",
    ]) {
      expect(hasControlCharacter(s), JSON.stringify(s)).toBe(true);
      expect(pattern.test(s), JSON.stringify(s)).toBe(false);
    }
    for (const s of ["", "a b", "ünïcödé", "🚀", "\u00a0", "tab-less"]) {
      expect(hasControlCharacter(s), JSON.stringify(s)).toBe(false);
      expect(pattern.test(s), JSON.stringify(s)).toBe(true);
    }
  });
});
