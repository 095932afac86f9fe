import { describe, expect, it } from "vitest";
import type { RunnerSpec } from "./api-client.ts";
import type { ContainerConfig } from "./runtime.ts";
import { containerCreateBody } from "./runtime-docker.ts";

const UUID = "zzzzz-bndl-000000000000001";

function config(over: {
  gpu?: RunnerSpec["resources"]["gpu"];
  gpuDevices?: number[];
  network?: boolean;
  ram?: number;
  vcpus?: number;
  logMaxBytes?: number;
}) {
  const spec: RunnerSpec = {
    uuid: UUID,
    attempt: 2,
    command: ["sh", "-c", "nvidia-smi -L"],
    image: "dctest/busybox:1",
    env: { A: "1" },
    resources: { vcpus: over.vcpus ?? 1.5, ram: over.ram ?? 64 * 2 ** 20, scratch: 0, gpu: over.gpu ?? null },
    limits: { time: null, disk: null, network: over.network ?? false },
    dependencies: [],
    gpuDevices: over.gpuDevices ?? [],
    instanceType: "gpu4",
  };
  const c: ContainerConfig = {
    uuid: UUID,
    attempt: 2,
    spec,
    outDir: "/w/out",
    inDir: "/w/in",
    inputs: ["ref", "reads"],
    gpuDevices: over.gpuDevices ?? [],
    vmRoot: "/vm/1",
    ...(over.logMaxBytes === undefined ? {} : { logMaxBytes: over.logMaxBytes }),
  };
  return containerCreateBody(c, { uid: 1001, gid: 1002 });
}

describe("the container a bundle runs in", () => {
  it("has the bundle's limits, read-only inputs, no network, the runner's user, and its labels", () => {
    const body = config({});
    expect(body.HostConfig).toEqual({
      Binds: ["/w/out:/out:rw", "/w/in/ref:/in/ref:ro", "/w/in/reads:/in/reads:ro"],
      Memory: 64 * 2 ** 20,
      MemorySwap: 64 * 2 ** 20,
      NanoCpus: 1_500_000_000,
      PidsLimit: 4096,
      NetworkMode: "none",
      LogConfig: { Type: "json-file", Config: { "max-size": String(256 * 2 ** 20), "max-file": "2" } },
    });
    expect(body.User).toBe("1001:1002");
    expect(body.Labels).toEqual({
      "dispatch-cloud.bundle": UUID,
      "dispatch-cloud.attempt": "2",
      "dispatch-cloud.vm-root": "/vm/1",
    });
    expect(body.Env).toEqual(
      expect.arrayContaining(["A=1", "DISPATCH_OUTPUT_DIR=/out", "DISPATCH_INPUT_DIR=/in"]),
    );
    expect(config({ network: true }).HostConfig["NetworkMode"]).toBe("default");
    // Docker's own copy of the log is capped too (the start document's containerLogMaxBytes).
    expect(config({ logMaxBytes: 5 * 2 ** 20 }).HostConfig["LogConfig"]).toEqual({
      Type: "json-file",
      Config: { "max-size": "5242880", "max-file": "2" },
    });
  });

  it("requests exactly the CUDA devices the dispatcher assigned", () => {
    const body = config({ gpu: { stack: "cuda", deviceCount: 2 }, gpuDevices: [1, 3] });
    expect(body.HostConfig["DeviceRequests"]).toEqual([
      { Driver: "nvidia", DeviceIDs: ["1", "3"], Capabilities: [["gpu"]] },
    ]);
    expect(body.HostConfig["Devices"]).toBeUndefined();
  });

  it("passes the ROCm devices for a ROCm bundle, and no GPU at all without assigned devices", () => {
    const rocm = config({ gpu: { stack: "rocm", deviceCount: 1 }, gpuDevices: [0] });
    expect(rocm.HostConfig["Devices"]).toEqual([
      { PathOnHost: "/dev/kfd", PathInContainer: "/dev/kfd", CgroupPermissions: "rwm" },
      { PathOnHost: "/dev/dri", PathInContainer: "/dev/dri", CgroupPermissions: "rwm" },
    ]);
    expect(rocm.Env).toContain("ROCR_VISIBLE_DEVICES=0");
    const none = config({ gpu: null });
    expect(none.HostConfig["DeviceRequests"]).toBeUndefined();
    expect(none.HostConfig["Devices"]).toBeUndefined();
  });

  it("never gives Docker a 0 (no limit at all): memory and CPUs at least Docker's minimums", () => {
    for (const [ram, vcpus] of [
      [0, 0],
      [1, 1e-300],
      [-1, -1],
      [Number.NaN, Number.NaN],
    ] as const) {
      const host = config({ ram, vcpus }).HostConfig;
      expect([host["Memory"], host["MemorySwap"], host["NanoCpus"]], `${ram} ${vcpus}`).toEqual([
        6 * 2 ** 20,
        6 * 2 ** 20,
        10_000_000,
      ]);
    }
    const host = config({ ram: 16 * 2 ** 20, vcpus: 0.01 }).HostConfig;
    expect([host["Memory"], host["NanoCpus"]]).toEqual([16 * 2 ** 20, 10_000_000]);
  });
});
