import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../lib/errors.ts";
import { parseBundleRequest } from "./bundle-request.ts";

const OWNER = "zzzzz-user-000000000000000";
const DEP = "zzzzz-bndl-000000000000001";
const parse = (body: unknown) => parseBundleRequest(body, OWNER, 3);

function problem(body: unknown): { code: string; path: string | undefined } {
  try {
    parse(body);
  } catch (err) {
    if (err instanceof DispatchCloudError) return { code: err.code, path: err.path };
    throw err;
  }
  throw new Error("accepted");
}

const base = { command: ["echo", "hi"], image: "busybox" };

describe("parseBundleRequest", () => {
  it("fills every default", () => {
    expect(parse(base)).toEqual({
      ownerUuid: OWNER,
      name: "",
      command: ["echo", "hi"],
      image: "busybox",
      env: {},
      resources: { vcpus: 1, ram: 256 * 2 ** 20, scratch: 0, gpu: null },
      preemptible: false,
      priority: 500,
      limits: { time: null, disk: null, network: false },
      dependencies: [],
      allowFailedDependencies: false,
      maxAttempts: 3,
    });
  });

  it("normalises sizes, durations, GPUs and dependencies", () => {
    const b = parse({
      ...base,
      env: { A_1: "x" },
      resources: {
        vcpus: 0.5,
        ram: "4GiB",
        scratch: 1000,
        gpu: { stack: "cuda", deviceCount: 2, vram: "40GB", driverVersion: "12.2", hardwareTarget: "8.0" },
      },
      limits: { time: "1h30m", disk: "1.5GB", network: true },
      dependencies: [
        { bundle: DEP, subpath: "./out//x/" },
        { bundle: DEP, name: "again" },
      ],
      maxAttempts: 1,
    });
    expect(b.resources).toEqual({
      vcpus: 0.5,
      ram: 4 * 2 ** 30,
      scratch: 1000,
      gpu: { stack: "cuda", deviceCount: 2, vram: 40e9, driverVersion: "12.2", hardwareTarget: ["8.0"] },
    });
    expect(b.limits).toEqual({ time: 5_400_000, disk: 1.5e9, network: true });
    expect(b.dependencies).toEqual([
      { bundle: DEP, subpath: "out/x", name: DEP },
      { bundle: DEP, subpath: "", name: "again" },
    ]);
    expect(b.maxAttempts).toBe(1);
  });

  it.each([
    [{ ...base, extra: 1 }, "request.unknown_field", "extra"],
    [{ ...base, resources: { ram: "1GiB", cpus: 2 } }, "request.unknown_field", "resources.cpus"],
    [{ image: "x" }, "request.invalid_body", "command"],
    [{ ...base, command: [] }, "request.invalid_body", "command"],
    [{ ...base, command: "echo" }, "request.invalid_body", "command"],
    [{ ...base, command: [1] }, "request.invalid_body", "command[0]"],
    [{ ...base, image: "" }, "request.invalid_body", "image"],
    [{ ...base, resources: { ram: "4XB" } }, "request.invalid_body", "resources.ram"],
    [{ ...base, resources: { ram: -1 } }, "request.invalid_body", "resources.ram"],
    [{ ...base, resources: { ram: 1.5 } }, "request.invalid_body", "resources.ram"],
    [{ ...base, resources: { ram: 1e300 } }, "request.invalid_body", "resources.ram"],
    [{ ...base, resources: { ram: "65TiB" } }, "request.invalid_body", "resources.ram"],
    [{ ...base, resources: { ram: "1e300GiB" } }, "request.invalid_body", "resources.ram"],
    [{ ...base, resources: { vcpus: 0 } }, "request.invalid_body", "resources.vcpus"],
    [{ ...base, resources: { vcpus: "2" } }, "request.invalid_body", "resources.vcpus"],
    [{ ...base, resources: { vcpus: 2 ** 60 } }, "request.invalid_body", "resources.vcpus"],
    [
      { ...base, resources: { gpu: { stack: "opencl", deviceCount: 1 } } },
      "request.invalid_body",
      "resources.gpu.stack",
    ],
    [
      { ...base, resources: { gpu: { stack: "cuda", deviceCount: 1.5 } } },
      "request.invalid_body",
      "resources.gpu.deviceCount",
    ],
    [
      { ...base, resources: { gpu: { stack: "cuda", deviceCount: 1, driverVersion: "12" } } },
      "request.invalid_body",
      "resources.gpu.driverVersion",
    ],
    [{ ...base, priority: 1001 }, "request.invalid_body", "priority"],
    [{ ...base, priority: -1 }, "request.invalid_body", "priority"],
    [{ ...base, maxAttempts: 0 }, "request.invalid_body", "maxAttempts"],
    [{ ...base, preemptible: "yes" }, "request.invalid_body", "preemptible"],
    [{ ...base, env: { "1BAD": "x" } }, "request.invalid_body", 'env["1BAD"]'],
    [{ ...base, env: { A: 1 } }, "request.invalid_body", "env.A"],
    [{ ...base, limits: { time: "10" } }, "request.invalid_body", "limits.time"],
    [{ ...base, limits: { time: "0s" } }, "request.invalid_body", "limits.time"],
    [{ ...base, limits: { time: "1000d" } }, "request.invalid_body", "limits.time"],
    [{ ...base, dependencies: [{ bundle: "nope" }] }, "request.invalid_body", "dependencies[0].bundle"],
    [
      { ...base, dependencies: [{ bundle: DEP, subpath: "/etc" }] },
      "request.invalid_body",
      "dependencies[0].subpath",
    ],
    [
      { ...base, dependencies: [{ bundle: DEP, subpath: "a/../.." }] },
      "request.invalid_body",
      "dependencies[0].subpath",
    ],
    [
      { ...base, dependencies: [{ bundle: DEP, name: "a/b" }] },
      "request.invalid_body",
      "dependencies[0].name",
    ],
    [
      { ...base, dependencies: [{ bundle: DEP, name: ".." }] },
      "request.invalid_body",
      "dependencies[0].name",
    ],
    [
      { ...base, dependencies: [{ bundle: DEP }, { bundle: DEP }] },
      "request.invalid_body",
      "dependencies[1].name",
    ],
    [{ ...base, name: "x".repeat(201) }, "request.invalid_body", "name"],
    [{ ...base, name: "a\u0000b" }, "request.invalid_body", "name"],
  ])("refuses %j with %s at %s", (body, code, path) => {
    expect(problem(body)).toEqual({ code, path });
  });
});
