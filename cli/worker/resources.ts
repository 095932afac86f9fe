/**
 * What a worker says of its machine (lib/worker-protocol.ts WorkerResourcesReport): CPUs and RAM from node:os,
 * free disk of its work directory by statfs, GPUs from `nvidia-smi` when it is installed. These are claims: the
 * server checks them for plausibility only, and the owner is the one who trusts them (docs/workers.md).
 */
import { execFile } from "node:child_process";
import { statfs } from "node:fs/promises";
import os from "node:os";
import type { WorkerResourcesReport } from "../../lib/worker-protocol.ts";

export type GpuReport = NonNullable<WorkerResourcesReport["gpu"]>;

/** The nvidia-smi query the worker runs: one line per device, no header, sizes in MiB. */
export const NVIDIA_SMI_ARGS = [
  "--query-gpu=memory.total,driver_version,compute_cap",
  "--format=csv,noheader,nounits",
];

/**
 * nvidia-smi's answer to NVIDIA_SMI_ARGS as a GPU report: the device count, the smallest device's memory (a
 * bundle asks for memory per device), the driver version and the compute capability of the first device. Null
 * when it names no device or a line is not understood (a GPU the worker cannot describe is not offered).
 */
export function parseNvidiaSmi(stdout: string): GpuReport | null {
  const lines = stdout
    .split("\n")
    .map((l) => l.trim())
    .filter((l) => l !== "");
  if (lines.length === 0) return null;
  let vramMiB = Number.POSITIVE_INFINITY;
  let driverVersion: string | null = null;
  let hardwareTarget: string | null = null;
  for (const line of lines) {
    const [mem, driver, cap] = line.split(",").map((f) => f.trim());
    const mib = Number(mem);
    if (!Number.isFinite(mib) || mib <= 0 || !/^\d+$/.test(mem ?? "")) return null;
    vramMiB = Math.min(vramMiB, mib);
    if (driverVersion === null && driver !== undefined && /^\d+(\.\d+)*$/.test(driver))
      driverVersion = driver;
    if (hardwareTarget === null && cap !== undefined && /^\d+\.\d+$/.test(cap)) hardwareTarget = cap;
  }
  return {
    stack: "cuda",
    deviceCount: lines.length,
    vram: vramMiB * 1024 * 1024,
    driverVersion,
    hardwareTarget,
  };
}

/** Runs nvidia-smi (at most 10 s); null when it is not installed, fails, or names no device. */
export function detectGpus(command = "nvidia-smi"): Promise<GpuReport | null> {
  return new Promise((resolve) => {
    execFile(command, NVIDIA_SMI_ARGS, { timeout: 10_000 }, (err, stdout) => {
      resolve(err === null ? parseNvidiaSmi(stdout) : null);
    });
  });
}

/** Free bytes of the file system holding `dir` (for an unprivileged user: what it may still write). */
export async function freeDisk(dir: string): Promise<number> {
  const s = await statfs(dir);
  return s.bavail * s.bsize;
}

/** The machine's resources now; `gpu` is given by the caller (detectGpus, run once at start). */
export async function detectResources(
  workDir: string,
  gpu: GpuReport | null,
): Promise<WorkerResourcesReport> {
  return {
    vcpus: Math.max(1, os.availableParallelism?.() ?? os.cpus().length),
    ram: os.totalmem(),
    freeDisk: await freeDisk(workDir),
    gpu,
  };
}
