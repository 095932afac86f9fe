import { describe, expect, it } from "vitest";
import { decodeCursor, encodeCursor } from "./views.ts";

const UUID = "zzzzz-bndl-000000000000001";
const cursorOf = (value: unknown) => Buffer.from(JSON.stringify(value), "utf8").toString("base64url");

describe("the list cursor", () => {
  it("round-trips what the API hands out", () => {
    const c = { createdAt: new Date("2026-11-03T10:20:30.456Z"), uuid: UUID };
    expect(decodeCursor(encodeCursor(c))).toEqual(c);
  });

  it.each([
    // Valid JavaScript dates outside PostgreSQL's timestamptz range (4713 BC to 294276 AD), or far from now.
    "+275760-09-13T00:00:00.000Z",
    "-271821-04-20T00:00:00.000Z",
    "-004713-01-01T00:00:00.000Z",
    "0000-01-01T00:00:00.000Z",
    // Not what encodeCursor writes.
    "2026-11-03",
    "2026-11-03T10:20:30Z",
    "2026-11-03T10:20:30.456+01:00",
    "2026-02-30T00:00:00.000Z",
    "2026-11-03T24:00:00.000Z",
    "",
  ])("refuses createdAt %j with request.invalid_query at cursor", (createdAt) => {
    expect(() => decodeCursor(cursorOf({ createdAt, uuid: UUID }))).toThrow(
      expect.objectContaining({ code: "request.invalid_query", path: "cursor" }),
    );
  });

  it("refuses what is not a cursor at all", () => {
    for (const text of ["%%%", "x".repeat(501), cursorOf([1]), cursorOf({ createdAt: 1, uuid: UUID })]) {
      expect(() => decodeCursor(text)).toThrow(expect.objectContaining({ path: "cursor" }));
    }
    expect(() => decodeCursor(cursorOf({ createdAt: "2026-11-03T10:20:30.456Z", uuid: "x\u0000" }))).toThrow(
      expect.objectContaining({ path: "cursor" }),
    );
  });
});
