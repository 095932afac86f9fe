/**
 * The one small interface the supervisor needs from a container runtime (docker, or process), and what a
 * failed start means. Errors that mean the instance itself is unusable (daemon gone, no space left) are
 * DispatchCloudError crunchrun.docker_error or carry ENOSPC; an image that cannot be had is
 * crunchrun.image_missing. A container that cannot start is either the bundle's fault,
 * crunchrun.command_unusable (its command is missing or not executable: the bundle fails), or the instance's,
 * crunchrun.runtime_failed (an OCI hook, a mount, a cgroup, a daemon error: the bundle is requeued and the
 * failure counts against the instance). `start` throws them; `wait` throws them too when the runtime reports
 * the failure only once the container has ended (docker's State.Error).
 */
import type { Readable } from "node:stream";
import { DispatchCloudError } from "../lib/errors.ts";
import type { RegistryAuth } from "../lib/runner-protocol.ts";
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
  /** The docker runtime's cap on docker's own log file of the container (two files); default 256 MiB. */
  logMaxBytes?: number;
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

/** An image kept in our content-addressed store (the spec's imageStore; docs/images.md). */
export interface ImageStoreRef {
  /** The CAS manifest digest (`<sha256>/<size>`) of the unpacked `docker save` tree. */
  manifest: string;
  /** The image's config digest, `sha256:<hex>`. */
  imageId: string;
  bytes: number;
}

/** The image fields of a spec from a server that pins images (optional: older servers send neither). */
export type ImageSpec = Pick<RunnerSpec, "image"> & {
  /** The immutable reference to run (`repo@sha256:...`, or `sha256:<imageId>` for a store image); null = image. */
  imagePinned?: string | null;
  imageStore?: ImageStoreRef | null;
};

/** The reference the container runs: the pinned one when the server pinned the image. */
export const imageToRun = (spec: RunnerSpec): string => (spec as ImageSpec).imagePinned ?? spec.image;

/** What prepare needs from the supervisor. */
export interface PrepareContext {
  /** A line for the user (the bundle's stderr and the supervisor's log). */
  say(line: string): void;
  /** The bundle's status while prepare waits (heartbeats carry it); null clears it. */
  status?(text: string | null): void;
  /** The start document's credentials (only those of the image's registry). Never logged. */
  registryAuth: readonly RegistryAuth[];
  signal: AbortSignal;
  /** How long an unavailable registry is retried before crunchrun.image_unavailable (the start document's). */
  pullRetryMs: number;
  /** Loads an image in our store onto the daemon (crunch-run/image-store.ts); absent = none. */
  loadFromStore?: (store: ImageStoreRef) => Promise<void>;
}

export interface ContainerRuntime {
  readonly name: "docker" | "process";
  /** Sentences for the bundle's stderr before the run (the process runtime's NO ISOLATION warning). */
  readonly warnings: string[];
  /**
   * Makes sure the image is there (docker: on the daemon, else from our store, else pulled from its registry);
   * throws crunchrun.image_missing, crunchrun.image_denied or crunchrun.image_unavailable (image-pull.ts).
   */
  prepare(spec: RunnerSpec, ctx: PrepareContext): Promise<void>;
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

/** The bundle's command cannot be run (the bundle's fault); the message names the command. */
export function commandUnusable(command: string, why: string): DispatchCloudError {
  return new DispatchCloudError(
    "crunchrun.command_unusable",
    `the command ${JSON.stringify(command)} cannot be run: ${why}`,
  );
}

/** The runtime could not create or start the container (the instance's fault). */
export function runtimeFailed(what: string, cause?: unknown): DispatchCloudError {
  return new DispatchCloudError(
    "crunchrun.runtime_failed",
    `the container runtime failed: ${oneLine(what)}`,
    cause === undefined ? {} : { cause },
  );
}

/** Control characters (the daemon's messages may hold newlines) as spaces, and at most 500 characters. */
function oneLine(text: string): string {
  // biome-ignore lint/suspicious/noControlCharactersInRegex: control characters are what it replaces
  const flat = text.replace(/[\u0000-\u001f\u007f]+/g, " ").trim();
  return flat.length > 500 ? `${flat.slice(0, 500)}...` : flat;
}

/**
 * How runc (and crun) say that the process they were to exec is unusable: `exec: "<name>": ` then "executable
 * file not found in $PATH", "stat <name>: no such file or directory", "permission denied" or "not a directory".
 * Anything else from a start (hooks, mounts, devices, cgroups) is the runtime's. "no such file or directory"
 * alone proves nothing: a hook or a device path can be missing too, so the quoted name must be the command's.
 */
const EXEC_FAILURE =
  /exec: ("(?:[^"\\]|\\.)*"): (executable file not found in \$PATH|(?:stat [^:]*: )?(?:no such file or directory|permission denied|not a directory))/;

/**
 * Classifies a container start the daemon refused (docker's message, as in its JSON answer or State.Error):
 * crunchrun.command_unusable when it is about `command` itself, else crunchrun.runtime_failed.
 */
export function classifyStartFailure(message: string, command: string): DispatchCloudError {
  const m = EXEC_FAILURE.exec(message);
  if (m !== null && !/error running hook/i.test(message)) {
    let name: unknown = null;
    try {
      name = JSON.parse(m[1] ?? "");
    } catch {
      // a quoting JSON does not share with Go's %q: compare it as it is
      name = (m[1] ?? "").slice(1, -1);
    }
    if (name === command) {
      return commandUnusable(command, (m[2] ?? "").replace(/^stat [^:]*: /, ""));
    }
  }
  return runtimeFailed(message);
}

/** Spawn errors that are about the command itself (the process runtime's equivalent of docker's). */
const COMMAND_ERRNOS: Record<string, string> = {
  ENOENT: "no such file or directory (or not found in $PATH)",
  EACCES: "permission denied",
  ENOTDIR: "not a directory",
  ENOEXEC: "exec format error",
  ELOOP: "too many levels of symbolic links",
  ENAMETOOLONG: "file name too long",
};

/** Classifies a failed spawn: the command's fault for the errors above, else the instance's. */
export function classifySpawnFailure(err: NodeJS.ErrnoException, command: string): DispatchCloudError {
  const why = err.code === undefined ? undefined : COMMAND_ERRNOS[err.code];
  if (why !== undefined) return commandUnusable(command, why);
  return runtimeFailed(`cannot start the command as a process: ${err.message}`, err);
}
