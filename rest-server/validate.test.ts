import { Type } from "@sinclair/typebox";
import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../lib/errors.ts";
import { KillRequest, UserRequest } from "./routes-users.ts";
import { checkJsonShape, pointerToPath, validate } from "./validate.ts";

function caught(fn: () => unknown): DispatchCloudError {
  try {
    fn();
  } catch (err) {
    if (err instanceof DispatchCloudError) return err;
    throw err;
  }
  throw new Error("did not throw");
}

describe("pointerToPath", () => {
  it("turns JSON pointers into dotted paths", () => {
    expect(pointerToPath("")).toBe("");
    expect(pointerToPath("/resources/ram")).toBe("resources.ram");
    expect(pointerToPath("/dependencies/2/bundle")).toBe("dependencies[2].bundle");
    expect(pointerToPath("/env/A.B")).toBe('env["A.B"]');
    expect(pointerToPath("/a~1b")).toBe('["a/b"]');
  });
});

describe("validate", () => {
  const S = Type.Object(
    { n: Type.Optional(Type.Integer({ minimum: 0, maximum: 10, default: 3 })), s: Type.String() },
    { additionalProperties: false },
  );

  it("fills defaults and neither coerces nor strips", () => {
    expect(validate(S, { s: "x" })).toEqual({ s: "x", n: 3 });
    expect(caught(() => validate(S, { s: "x", n: "3" }))).toMatchObject({
      code: "request.invalid_body",
      path: "n",
    });
    expect(caught(() => validate(S, { s: "x", extra: 1 }))).toMatchObject({
      code: "request.unknown_field",
      path: "extra",
    });
  });

  it("refuses non-integers, negatives and huge numbers", () => {
    for (const n of [1.5, -1, 1e300, 2 ** 60]) {
      expect(caught(() => validate(S, { s: "x", n }))).toMatchObject({
        code: "request.invalid_body",
        path: "n",
      });
    }
  });

  it("refuses a body that is not an object", () => {
    for (const body of [undefined, null, 3, "x", []]) {
      expect(caught(() => validate(S, body)).code).toBe("request.invalid_body");
    }
  });
});

describe("checkJsonShape", () => {
  it("refuses deep nesting, NUL characters and __proto__ keys", () => {
    let deep: unknown = 1;
    for (let i = 0; i < 100_000; i++) deep = [deep];
    expect(caught(() => checkJsonShape(deep)).code).toBe("request.invalid_body");
    expect(caught(() => checkJsonShape({ a: ["ok", "b\u0000"] })).path).toBe("a[1]");
    expect(caught(() => checkJsonShape(JSON.parse('{"x":{"__proto__":{"y":1}}}'))).path).toBe("x.__proto__");
    expect(() => checkJsonShape({ a: [1, { b: "c" }] })).not.toThrow();
  });

  it("refuses lone surrogates in strings and keys, with the path; keeps surrogate pairs", () => {
    // JSON.parse keeps a lone "\ud800" escape as it is; UTF-8 (and so the database) cannot hold it.
    const parsed = JSON.parse('{"a":{"b":["ok","x\\ud800"]},"c":"fine"}');
    expect(caught(() => checkJsonShape(parsed))).toMatchObject({
      code: "request.invalid_body",
      path: "a.b[1]",
    });
    expect(caught(() => checkJsonShape({ c: "\udc00y" })).path).toBe("c");
    expect(caught(() => checkJsonShape({ c: "y\ud83d" })).path).toBe("c");
    expect(caught(() => checkJsonShape({ ["k\ud800"]: 1 })).path).toBe('["k\\ud800"]');
    expect(() => checkJsonShape(JSON.parse('{"rocket":"\\ud83d\\ude80","k\\ud83d\\ude80":1}'))).not.toThrow();
  });
});

describe("the users' API's small bodies", () => {
  it("refuse control characters and line breaks in a kill reason, and take any other text", () => {
    for (const reason of ["a\nb", "a\rb", "\u001b[31mred", "a\u0085b", "a\u2029b", "tab\there"]) {
      expect(caught(() => validate(KillRequest, { reason }))).toMatchObject({
        code: "request.invalid_body",
        path: "reason",
      });
    }
    expect(validate(KillRequest, { reason: "no longer needed — ünïcödé 🚀" })).toEqual({
      reason: "no longer needed — ünïcödé 🚀",
    });
    expect(caught(() => validate(UserRequest, { name: "bob\nadmin" }))).toMatchObject({ path: "name" });
  });
});
