import { describe, expect, it } from "vitest";
import { joinBatch, splitBatch } from "./batch.ts";

describe("the binary batch-read answer", () => {
  it("carries blobs and errors in order, bytes as they are", () => {
    const a = Buffer.from([0, 10, 13, 255, 10]);
    const body = joinBatch([
      { digest: "a", data: a },
      { digest: "b", error: { code: "cas.not_found", message: "no" } },
      { digest: "e", data: Buffer.alloc(0) },
      { digest: "c", data: Buffer.from("{\n}") },
    ]);
    const got = splitBatch(body);
    expect(got.map((e) => e.digest)).toEqual(["a", "b", "e", "c"]);
    expect(got[0]).toEqual({ digest: "a", data: a });
    expect(got[1]).toEqual({ digest: "b", error: { code: "cas.not_found", message: "no" } });
    expect(got[2]).toEqual({ digest: "e", data: Buffer.alloc(0) });
    expect((got[3] as { data: Buffer }).data.toString()).toBe("{\n}");
  });

  it("refuses an answer cut short, one with bytes left over, and one without a header", () => {
    const body = joinBatch([{ digest: "a", data: Buffer.from("hello") }]);
    expect(() => splitBatch(body.subarray(0, body.length - 1))).toThrow(/cut short/);
    expect(() => splitBatch(Buffer.concat([body, Buffer.from("x")]))).toThrow(/after its last blob/);
    expect(() => splitBatch(Buffer.from("no header"))).toThrow(/no header line/);
    expect(() => splitBatch(Buffer.from('{"x":1}\n'))).toThrow(/no blobs/);
  });
});
