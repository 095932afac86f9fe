import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../lib/errors.ts";
import { parseStartDocument } from "./start-doc.ts";
import { VERSION } from "./version.ts";

const UUID = "zzzzz-bndl-aaaaaaaaaaaaaaa";
const TOKEN = `dcr_${"A".repeat(43)}`;
const good = {
  uuid: UUID,
  attempt: 2,
  apiUrl: "http://127.0.0.1:8080/",
  token: TOKEN,
  instanceType: "small",
  gpuDevices: [0, 2],
  runtimeEngine: "auto",
};

function errorOf(doc: unknown): DispatchCloudError {
  try {
    parseStartDocument(typeof doc === "string" ? doc : JSON.stringify(doc), UUID);
  } catch (err) {
    if (err instanceof DispatchCloudError) return err;
    throw err;
  }
  throw new Error("accepted");
}

describe("parseStartDocument", () => {
  it("accepts a good document, with defaults", () => {
    const { runtimeEngine: _, ...noEngine } = good;
    expect(parseStartDocument(JSON.stringify(noEngine), UUID)).toEqual({
      ...noEngine,
      apiUrl: "http://127.0.0.1:8080",
      runtimeEngine: "docker",
      heartbeatIntervalMs: 5000,
      preemptible: false,
      spotCheckIntervalMs: 5000,
    });
  });

  it("takes preemptible and spotCheckIntervalMs (0 = never)", () => {
    const parse = (extra: object) => parseStartDocument(JSON.stringify({ ...good, ...extra }), UUID);
    expect(parse({ preemptible: true, spotCheckIntervalMs: 250 })).toMatchObject({
      preemptible: true,
      spotCheckIntervalMs: 250,
    });
    expect(parse({ preemptible: true, spotCheckIntervalMs: 0 })).toMatchObject({ spotCheckIntervalMs: 0 });
  });

  it.each([
    ["not json", "{", ""],
    ["an array", [], "(document)"],
    ["another uuid", { ...good, uuid: "zzzzz-bndl-bbbbbbbbbbbbbbb" }, "uuid"],
    ["attempt 0", { ...good, attempt: 0 }, "attempt"],
    ["a bad url", { ...good, apiUrl: "ftp://x" }, "apiUrl"],
    ["a user token", { ...good, token: "dcu_abcdefabcdefabcdefabcdef" }, "token"],
    ["a bad device", { ...good, gpuDevices: [0, -1] }, "gpuDevices.1"],
    ["a repeated device", { ...good, gpuDevices: [1, 1] }, "gpuDevices"],
    ["an unknown engine", { ...good, runtimeEngine: "podman" }, "runtimeEngine"],
    ["an unknown field", { ...good, extra: 1 }, "extra"],
    ["no instance type", { ...good, instanceType: "" }, "instanceType"],
    ["a tiny heartbeat", { ...good, heartbeatIntervalMs: 1 }, "heartbeatIntervalMs"],
    ["a preemptible that is not a boolean", { ...good, preemptible: "yes" }, "preemptible"],
    ["a tiny spot check interval", { ...good, spotCheckIntervalMs: 5 }, "spotCheckIntervalMs"],
    ["a fractional spot check interval", { ...good, spotCheckIntervalMs: 100.5 }, "spotCheckIntervalMs"],
    ["a huge spot check interval", { ...good, spotCheckIntervalMs: 3_600_001 }, "spotCheckIntervalMs"],
  ])("rejects %s with the field's path", (_name, doc, path) => {
    const err = errorOf(doc);
    expect(err.code).toBe("crunchrun.invalid_start_document");
    expect(err.path).toBe(path);
  });

  it("never puts the token in an error message", () => {
    const err = errorOf({ ...good, token: "dcr_short secret!" });
    expect(err.message).not.toContain("secret");
  });
});

describe("VERSION", () => {
  it("is package.json's version", () => {
    const pkg = JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8")) as {
      version: string;
    };
    expect(VERSION).toBe(pkg.version);
  });
});
