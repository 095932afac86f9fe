import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import { defaultConfig } from "../config/load.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { DEFAULT_PROCESS_UIDS } from "../lib/runner-protocol.ts";
import { VERSION } from "../lib/version.ts";
import { parseStartDocument } from "./start-doc.ts";

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
      processUidFirst: 1_900_000_000,
      processUidCount: 65_536,
      warmSupervisors: 2,
      registryAuth: [],
      imagePullRetryMs: 120_000,
      containerLogMaxBytes: 256 * 2 ** 20,
      workerPid: 0,
      workerPidStart: "",
      claimInFlight: false,
    });
  });

  it("takes registryAuth and imagePullRetryMs", () => {
    const auth = [{ server: "127.0.0.1:5000", username: "u", password: "pw" }];
    expect(
      parseStartDocument(
        JSON.stringify({
          ...good,
          registryAuth: auth,
          imagePullRetryMs: 5000,
          containerLogMaxBytes: 2 ** 20,
        }),
        UUID,
      ),
    ).toMatchObject({ registryAuth: auth, imagePullRetryMs: 5000, containerLogMaxBytes: 2 ** 20 });
  });

  it.each([
    ["not an array", { password: "hunter2-secret" }, "registryAuth"],
    ["a bad server", [{ server: "x/hunter2-secret", username: "u", password: "p" }], "registryAuth.0.server"],
    [
      "a password that is not a string",
      [{ server: "r.io", username: "u", password: 7 }],
      "registryAuth.0.password",
    ],
    [
      "a misplaced field",
      [{ server: "r.io", username: "u", password: "p", token: "hunter2-secret" }],
      "registryAuth.0",
    ],
    ["no username", [{ server: "r.io", password: "hunter2-secret" }], "registryAuth.0.username"],
  ])("rejects registryAuth with %s, naming the field and never a value", (_name, registryAuth, path) => {
    const err = errorOf({ ...good, registryAuth });
    expect(err.path).toBe(path);
    expect(err.message).not.toContain("hunter2");
  });

  it("takes a worker's pid and its start time (users' workers)", () => {
    const parse = (extra: object) => parseStartDocument(JSON.stringify({ ...good, ...extra }), UUID);
    expect(parse({ workerPid: 4242, workerPidStart: "123456" })).toMatchObject({
      workerPid: 4242,
      workerPidStart: "123456",
    });
  });

  it("takes warmSupervisors (0 = none)", () => {
    const parse = (extra: object) => parseStartDocument(JSON.stringify({ ...good, ...extra }), UUID);
    expect(parse({ warmSupervisors: 0 })).toMatchObject({ warmSupervisors: 0 });
    expect(parse({ warmSupervisors: 10 })).toMatchObject({ warmSupervisors: 10 });
  });

  it("takes the process runtime's uid range; its defaults are the config's", () => {
    const parse = (extra: object) => parseStartDocument(JSON.stringify({ ...good, ...extra }), UUID);
    expect(parse({ processUidFirst: 5000, processUidCount: 10 })).toMatchObject({
      processUidFirst: 5000,
      processUidCount: 10,
    });
    const { dispatcher } = defaultConfig();
    expect(DEFAULT_PROCESS_UIDS).toEqual({
      first: dispatcher.processRuntimeFirstUid,
      count: dispatcher.processRuntimeUidCount,
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

  it("takes claimInFlight (a hand-off made while the claim ran)", () => {
    expect(parseStartDocument(JSON.stringify({ ...good, claimInFlight: true }), UUID).claimInFlight).toBe(
      true,
    );
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
    ["a claimInFlight that is not a boolean", { ...good, claimInFlight: 1 }, "claimInFlight"],
    ["a tiny spot check interval", { ...good, spotCheckIntervalMs: 5 }, "spotCheckIntervalMs"],
    ["a fractional spot check interval", { ...good, spotCheckIntervalMs: 100.5 }, "spotCheckIntervalMs"],
    ["a huge spot check interval", { ...good, spotCheckIntervalMs: 3_600_001 }, "spotCheckIntervalMs"],
    ["uid 0 as the first uid", { ...good, processUidFirst: 0 }, "processUidFirst"],
    [
      "a uid range past the last uid",
      { ...good, processUidFirst: 4_294_967_290, processUidCount: 6 },
      "processUidCount",
    ],
    ["an empty uid range", { ...good, processUidCount: 0 }, "processUidCount"],
    ["a uid as a string", { ...good, processUidFirst: "1000" }, "processUidFirst"],
    ["negative warm supervisors", { ...good, warmSupervisors: -1 }, "warmSupervisors"],
    ["too many warm supervisors", { ...good, warmSupervisors: 65 }, "warmSupervisors"],
    ["a tiny pull retry time", { ...good, imagePullRetryMs: 5 }, "imagePullRetryMs"],
    ["a container log cap below 1 MiB", { ...good, containerLogMaxBytes: 1000 }, "containerLogMaxBytes"],
    ["a container log cap as text", { ...good, containerLogMaxBytes: "1g" }, "containerLogMaxBytes"],
    ["a negative worker pid", { ...good, workerPid: -1 }, "workerPid"],
    ["a worker pid as text", { ...good, workerPid: "12" }, "workerPid"],
    ["a worker start time that is not digits", { ...good, workerPidStart: "1; rm" }, "workerPidStart"],
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
