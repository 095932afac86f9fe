import { describe, expect, it } from "vitest";
import { boundedLine, escapeArg, formatLine, LineReader, MAX_REPLY_BYTES, parseRequest } from "./wire.ts";

const args = (text: string) => {
  const r = parseRequest(Buffer.from(text));
  if (!r.ok) throw new Error(r.reason);
  return r.args;
};

describe("GAHP wire format", () => {
  it("escapes space, backslash, CR and LF, and reads them back", () => {
    const tricky = "a b\\c\rd\ne#f";
    expect(escapeArg(tricky)).toBe("a\\ b\\\\c\\\rd\\\ne#f");
    expect(args(formatLine(["CMD", tricky, "", "x"]))).toEqual(["CMD", tricky, "", "x"]);
  });

  it("splits on single spaces: two spaces make an empty argument; a CRLF's CR is dropped, an escaped one kept", () => {
    expect(args("A  b\r")).toEqual(["A", "", "b"]);
    expect(args("A b\\\r")).toEqual(["A", "b\r"]);
    expect(args("A b\\\\\r")).toEqual(["A", "b\\"]);
  });

  it("refuses bad escapes, control characters and bytes that are not UTF-8", () => {
    for (const bad of ["A \\x", "A b\\", "A \u0001", "A b\rc"]) {
      const r = parseRequest(Buffer.from(bad));
      expect(r.ok, bad).toBe(false);
    }
    const r = parseRequest(Buffer.from([0x41, 0x20, 0xff, 0xfe]));
    expect(r).toEqual({ ok: false, reason: "the line is not UTF-8 text" });
  });

  it("frames lines at unescaped LFs, across chunks, and cuts lines over the limit without keeping them", () => {
    const reader = new LineReader(10);
    const frames = [
      ...reader.push(Buffer.from("AB\\")),
      ...reader.push(Buffer.from("\nC\nDEF")),
      ...reader.push(Buffer.from("0123456789\nG\n")),
    ];
    expect(frames.map((f) => (f.kind === "line" ? f.bytes.toString() : `too long ${f.bytes}`))).toEqual([
      "AB\\\nC",
      "too long 13",
      "G",
    ]);
    expect(reader.push(Buffer.from("tail"))).toEqual([]);
    expect(reader.end().map((f) => (f.kind === "line" ? f.bytes.toString() : "?"))).toEqual(["tail"]);
  });

  it("bounds reply lines to the gridmanager's 500 KB buffer", () => {
    expect(boundedLine(["1", "x".repeat(MAX_REPLY_BYTES - 3)])).toBeDefined();
    expect(boundedLine(["1", "x".repeat(MAX_REPLY_BYTES - 2)])).toBeUndefined();
  });
});
