import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../lib/errors.ts";
import { parseBundleRequest } from "./bundle-request.ts";

const OWNER = "zzzzz-user-000000000000000";
const DEP = "zzzzz-bndl-000000000000001";
const MIN = { ram: 16 * 2 ** 20, vcpus: 0.01 };
const parse = (body: unknown, minimums = MIN) => parseBundleRequest(body, OWNER, 3, minimums);

function problem(body: unknown, minimums = MIN): { code: string; path: string | undefined } {
  try {
    parse(body, minimums);
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

  describe("the smallest resources (restServer.minBundleRam and minBundleVcpus)", () => {
    it.each([
      [{ ram: 0 }, "resources.ram"],
      [{ ram: "0B" }, "resources.ram"],
      [{ ram: "1MiB" }, "resources.ram"],
      [{ ram: 16 * 2 ** 20 - 1 }, "resources.ram"],
      [{ vcpus: 1e-300 }, "resources.vcpus"],
      [{ vcpus: 0.001 }, "resources.vcpus"],
      [{ vcpus: 5e-324 }, "resources.vcpus"],
    ])("refuses resources %j below them, at %s", (resources, path) => {
      expect(problem({ ...base, resources })).toEqual({ code: "request.invalid_body", path });
    });

    it("accepts them exactly, and what the server's own minimums allow", () => {
      expect(parse({ ...base, resources: { ram: "16MiB", vcpus: 0.01 } }).resources).toMatchObject({
        ram: 16 * 2 ** 20,
        vcpus: 0.01,
      });
      expect(
        parse({ ...base, resources: { ram: "8MiB" } }, { ram: 8 * 2 ** 20, vcpus: 0.5 }).resources.ram,
      ).toBe(8 * 2 ** 20);
      expect(problem({ ...base, resources: { vcpus: 0.25 } }, { ram: 0, vcpus: 0.5 })).toEqual({
        code: "request.invalid_body",
        path: "resources.vcpus",
      });
    });
  });

  describe("text: lone surrogates everywhere, control characters where they make no sense", () => {
    it.each([
      [{ ...base, image: "busybox\nlatest" }, "image"],
      [{ ...base, image: "busybox\r" }, "image"],
      [{ ...base, image: "busy box" }, "image"],
      [{ ...base, image: "busybox\tx" }, "image"],
      [{ ...base, image: "busybox\u0085" }, "image"],
      [{ ...base, image: "busybox\u2028" }, "image"],
      [{ ...base, image: "busybox\u001b[31m" }, "image"],
      [{ ...base, image: "busybox\ud800" }, "image"],
      [{ ...base, image: "\udc00busybox" }, "image"],
      [{ ...base, name: "a\nb" }, "name"],
      [{ ...base, name: "a\u007fb" }, "name"],
      [{ ...base, name: "a\u2029b" }, "name"],
      [{ ...base, name: "\ud83d" }, "name"],
      [{ ...base, command: ["echo", "\udfff"] }, "command[1]"],
      [{ ...base, env: { A: "x\ud800y" } }, "env.A"],
      [{ ...base, env: { "A\ud800": "x" } }, 'env["A\\ud800"]'],
      [
        { ...base, resources: { gpu: { stack: "cuda", deviceCount: 1, hardwareTarget: "8.0\n" } } },
        "resources.gpu.hardwareTarget",
      ],
      [
        { ...base, resources: { gpu: { stack: "cuda", deviceCount: 1, hardwareTarget: ["8.0", "\u0000"] } } },
        "resources.gpu.hardwareTarget[1]",
      ],
    ])("refuses %j at %s", (body, path) => {
      expect(problem(body)).toEqual({ code: "request.invalid_body", path });
    });

    it("keeps command and env values as the user's own bytes (NUL and lone surrogates aside)", () => {
      const b = parse({
        ...base,
        name: "a name with spaces and ünïcödé 🚀",
        image: "registry.example:5000/team/image:1.2@sha256:abc",
        command: ["sh", "-c", "printf 'a\tb\n\u001b[0m'\n", "🚀"],
        env: { MULTI: "line one\nline two\r\n", ESC: "\u001b" },
      });
      expect(b.command).toEqual(["sh", "-c", "printf 'a\tb\n\u001b[0m'\n", "🚀"]);
      expect(b.env).toEqual({ MULTI: "line one\nline two\r\n", ESC: "\u001b" });
      expect(b.name).toBe("a name with spaces and ünïcödé 🚀");
    });
  });

  describe("dependency subpaths the filesystem can hold", () => {
    const sub = (subpath: string) => ({ ...base, dependencies: [{ bundle: DEP, subpath }] });

    it("refuses a name over 255 bytes, counted in UTF-8", () => {
      expect(problem(sub(`a/${"x".repeat(256)}/b`))).toEqual({
        code: "request.invalid_body",
        path: "dependencies[0].subpath",
      });
      // 128 characters, 256 bytes.
      expect(problem(sub("é".repeat(128)))).toEqual({
        code: "request.invalid_body",
        path: "dependencies[0].subpath",
      });
    });

    it("accepts names of 255 bytes", () => {
      const name = "x".repeat(255);
      expect(parse(sub(`${name}/${name}`)).dependencies[0]?.subpath).toBe(`${name}/${name}`);
    });
  });
});
