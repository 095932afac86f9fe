/**
 * The one small interface the supervisor needs from a container runtime (docker, or process without any
 * isolation). Errors that mean the instance itself is unusable (daemon gone, no space left) are
 * DispatchCloudError crunchrun.docker_error or carry ENOSPC; an image that cannot be had is
 * crunchrun.image_missing.
 */
import type { Readable } from "node:stream";
import type { ResourceUsage, RunnerSpec } from "./api-client.ts";
import type { ContainerRef } from "./lock.ts";

export interface ContainerConfig {
  uuid: string;
  attempt: number;
  spec: RunnerSpec;
  /** Host directory mounted read-write at /out. */
  outDir: string;
  /** Host directory holding one directory per dependency, mounted read-only at /in/<name>. */
  inDir: string;
  /** Dependency mount names (subdirectories of inDir). */
  inputs: string[];
  gpuDevices: number[];
  /** DISPATCH_VM_ROOT ("" on a real VM), for the container's labels. */
  vmRoot: string;
}

export interface ContainerExit {
  /** The exit code; 128 + n when killed by signal n. */
  exitCode: number;
  /** True when the kernel killed it for exceeding its memory limit. */
  oomKilled: boolean;
}

export interface RunningContainer {
  readonly ref: ContainerRef;
  readonly stdout: Readable;
  readonly stderr: Readable;
  /** Resolves when the container exits. */
  wait(): Promise<ContainerExit>;
  /** Current usage (cpuSeconds cumulative, memory now and peak); diskBytes is the supervisor's. */
  stats(): Promise<Omit<ResourceUsage, "diskBytes">>;
  /** Bytes written inside the container outside the mounts (docker's writable layer; 0 for process). */
  writableLayerBytes(): Promise<number>;
  /** Stops it: a polite signal, then a kill after graceSeconds. */
  stop(graceSeconds: number): Promise<void>;
  /** Releases everything it holds (docker: removes the container). Safe to call twice. */
  remove(): Promise<void>;
}

export interface ContainerRuntime {
  readonly name: "docker" | "process";
  /** Sentences for the bundle's stderr before the run (the process runtime's NO ISOLATION warning). */
  readonly warnings: string[];
  /** Makes sure the image is there (docker: inspect, else pull); throws crunchrun.image_missing. */
  prepare(spec: RunnerSpec): Promise<void>;
  start(config: ContainerConfig): Promise<RunningContainer>;
}

export const DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/** The container's environment: the bundle's env, the input/output dirs, PATH unless the bundle sets it. */
export function containerEnv(spec: RunnerSpec, outDir: string, inDir: string): Record<string, string> {
  const env: Record<string, string> = {};
  if (!("PATH" in spec.env)) env["PATH"] = DEFAULT_PATH;
  Object.assign(env, spec.env);
  env["DISPATCH_OUTPUT_DIR"] = outDir;
  env["DISPATCH_INPUT_DIR"] = inDir;
  return env;
}
