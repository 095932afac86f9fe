/**
 * The docker runtime: the Docker Engine API over the daemon's unix socket (docker-api.ts). Limits: memory
 * (and swap = memory, so going over means the OOM killer), CPUs, pids; no network unless the bundle asks;
 * outputs mounted read-write at /out and dependencies read-only at /in/<name>; GPU device requests for
 * exactly the devices the dispatcher assigned. The container runs as the supervisor's uid:gid so its
 * outputs belong to the supervisor.
 *
 * A start the daemon refuses is classified by runtime.ts (classifyStartFailure): the bundle's command missing or
 * not executable fails the bundle; anything else (OCI hooks, mounts, devices, cgroups, 5xx) is the runtime's and
 * requeues it. Docker answers 400 for both kinds, so the status alone tells nothing. A 5xx on create is the
 * runtime's too; an unreachable daemon is crunchrun.docker_error (the instance is broken at once).
 */
import { PassThrough } from "node:stream";
import { DispatchCloudError } from "../lib/errors.ts";
import { DEFAULT_CONTAINER_LOG_MAX_BYTES } from "../lib/runner-protocol.ts";
import type { RunnerSpec } from "./api-client.ts";
import {
  DockerApiError,
  type DockerClient,
  LABEL_ATTEMPT,
  LABEL_BUNDLE,
  LABEL_VM_ROOT,
} from "./docker-api.ts";
import { followContainerLog } from "./docker-logs.ts";
import { pullImage } from "./image-pull.ts";
import {
  type ContainerConfig,
  type ContainerExit,
  type ContainerRuntime,
  classifyStartFailure,
  containerEnv,
  type ImageSpec,
  imageToRun,
  type PrepareContext,
  type RunningContainer,
  runtimeFailed,
} from "./runtime.ts";

const brokenDaemon = (what: string, err: unknown) =>
  err instanceof DispatchCloudError
    ? err
    : new DispatchCloudError("crunchrun.docker_error", `docker ${what} failed: ${(err as Error).message}`, {
        cause: err,
      });

/** Docker's smallest memory limit (it refuses less); 0 would mean no limit at all. */
export const DOCKER_MIN_MEMORY = 6 * 2 ** 20;
/** Docker's smallest CPU limit, 0.01 CPUs; 0 would mean no limit at all. */
export const DOCKER_MIN_NANO_CPUS = 10_000_000;

/**
 * A limit for Docker from a bundle's request: at least Docker's minimum, so a 0 (or a value that rounds to 0,
 * or garbage) from a server that let it through never becomes "unlimited".
 */
function dockerLimit(value: number, minimum: number): number {
  return Number.isFinite(value) && value > minimum ? Math.round(value) : minimum;
}

/**
 * The Docker Engine API body that creates a bundle's container: its limits, mounts (outputs read-write, inputs
 * read-only), no network unless asked, the runner's uid:gid, labels, and exactly the GPU devices assigned.
 */
export function containerCreateBody(config: ContainerConfig, user: { uid: number; gid: number }) {
  const { spec } = config;
  const env = containerEnv(spec, "/out", "/in");
  // ROCm has no per-device request: every GPU node is passed, and the runtime is told which ones are this
  // bundle's, so packed bundles never share one.
  const rocm = config.gpuDevices.length > 0 && spec.resources.gpu?.stack === "rocm";
  if (rocm) env["ROCR_VISIBLE_DEVICES"] = config.gpuDevices.join(",");
  const memory = dockerLimit(spec.resources.ram, DOCKER_MIN_MEMORY);
  const binds = [`${config.outDir}:/out:rw`, ...config.inputs.map((n) => `${config.inDir}/${n}:/in/${n}:ro`)];
  const hostConfig: Record<string, unknown> = {
    Binds: binds,
    Memory: memory,
    MemorySwap: memory,
    NanoCpus: dockerLimit(spec.resources.vcpus * 1e9, DOCKER_MIN_NANO_CPUS),
    PidsLimit: 4096,
    NetworkMode: spec.limits.network ? "default" : "none",
    // Docker keeps its own copy of everything the container writes; without a cap a bundle that writes without
    // end fills the instance's disk even though the supervisor stops storing its log at the server's limit.
    LogConfig: {
      Type: "json-file",
      Config: {
        "max-size": String(config.logMaxBytes ?? DEFAULT_CONTAINER_LOG_MAX_BYTES),
        "max-file": "2",
      },
    },
  };
  if (config.gpuDevices.length > 0) {
    if (rocm) {
      hostConfig["Devices"] = ["/dev/kfd", "/dev/dri"].map((d) => ({
        PathOnHost: d,
        PathInContainer: d,
        CgroupPermissions: "rwm",
      }));
    } else {
      hostConfig["DeviceRequests"] = [
        { Driver: "nvidia", DeviceIDs: config.gpuDevices.map(String), Capabilities: [["gpu"]] },
      ];
    }
  }
  return {
    Image: imageToRun(spec),
    Cmd: spec.command,
    Env: Object.entries(env).map(([k, v]) => `${k}=${v}`),
    User: `${user.uid}:${user.gid}`,
    WorkingDir: "/out",
    Labels: {
      [LABEL_BUNDLE]: config.uuid,
      [LABEL_ATTEMPT]: String(config.attempt),
      [LABEL_VM_ROOT]: config.vmRoot,
    },
    AttachStdout: true,
    AttachStderr: true,
    Tty: false,
    HostConfig: hostConfig,
  };
}

export interface DockerRuntimeOptions {
  /** Where the per-image pull locks live (shared by the instance's supervisors, image-pull.ts). */
  pullLockDir: string;
}

export function createDockerRuntime(docker: DockerClient, opts: DockerRuntimeOptions): ContainerRuntime {
  return {
    name: "docker",
    warnings: [],
    async prepare(spec: RunnerSpec, ctx: PrepareContext) {
      // Resolution order (docs/images.md): on the daemon (the pinned reference, else the image as named), our
      // store, the registry.
      const image = imageToRun(spec);
      const res = await docker.call("GET", `/images/${encodeURIComponent(image)}/json`);
      if (res.status >= 500) throw brokenDaemon("image inspect", new Error(res.body.toString("utf8")));
      if (res.status === 200) return;
      const store = (spec as ImageSpec).imageStore;
      if (store !== undefined && store !== null && ctx.loadFromStore !== undefined) {
        await ctx.loadFromStore(store);
        return;
      }
      await pullImage({
        docker,
        image,
        auth: ctx.registryAuth,
        say: ctx.say,
        ...(ctx.status === undefined ? {} : { status: ctx.status }),
        signal: ctx.signal,
        retryBudgetMs: ctx.pullRetryMs,
        lockDir: opts.pullLockDir,
        uuid: spec.uuid,
      });
    },

    async start(config: ContainerConfig): Promise<RunningContainer> {
      const name = `crunch-run-${config.uuid}-${config.attempt}`;
      const body = containerCreateBody(config, {
        uid: process.getuid?.() ?? 0,
        gid: process.getgid?.() ?? 0,
      });
      const create = () =>
        docker.json<{ Id: string }>("POST", `/containers/create?name=${encodeURIComponent(name)}`, body);
      let id: string;
      try {
        id = (await create()).Id;
      } catch (err) {
        if (err instanceof DockerApiError && err.status === 409) {
          // A leftover of this very attempt (an earlier supervisor died): it is ours to remove.
          await docker.call("DELETE", `/containers/${encodeURIComponent(name)}?force=true`);
          id = (await create().catch((e: unknown) => Promise.reject(brokenOrBad("create", e)))).Id;
        } else {
          throw brokenOrBad("create", err);
        }
      }
      const stdout = new PassThrough();
      const stderr = new PassThrough();
      const command = config.spec.command[0] ?? "";
      const container = dockerContainer(docker, id, name, command, stdout, stderr);
      try {
        await docker.json("POST", `/containers/${id}/start`);
      } catch (err) {
        await container.remove().catch(() => {});
        // Docker answers 400 both for a missing command and for an OCI hook that failed: the message decides.
        if (err instanceof DockerApiError) throw classifyStartFailure(err.daemonMessage, command);
        throw brokenDaemon("start", err);
      }
      void followContainerLog(docker, id, { stdout, stderr });
      return container;
    },
  };
}

/**
 * A refused create: 404 is the image; other 4xx answers are about this bundle's container (the supervisor fails
 * the bundle); a 5xx is the runtime's (requeued, counted against the instance); no daemon at all is broken.
 */
function brokenOrBad(what: string, err: unknown): Error {
  if (err instanceof DockerApiError && err.status === 404) {
    return new DispatchCloudError("crunchrun.image_missing", `docker ${what}: ${err.daemonMessage}`, {
      cause: err,
    });
  }
  if (err instanceof DockerApiError && err.status < 500) return err;
  if (err instanceof DockerApiError)
    return runtimeFailed(`docker ${what}: ${err.status} ${err.daemonMessage}`, err);
  return brokenDaemon(what, err);
}

function messageOf(text: string): string {
  try {
    const v = JSON.parse(text) as { message?: string };
    if (typeof v.message === "string") return v.message;
  } catch {
    // not JSON
  }
  return text.trim().slice(0, 300);
}

function dockerContainer(
  docker: DockerClient,
  id: string,
  name: string,
  command: string,
  stdout: PassThrough,
  stderr: PassThrough,
): RunningContainer {
  let removed = false;
  return {
    ref: { runtime: "docker", name },
    stdout,
    stderr,
    async wait(): Promise<ContainerExit> {
      const res = await docker.json<{ StatusCode: number; Error?: { Message?: string } | null }>(
        "POST",
        `/containers/${id}/wait`,
      );
      const info = await docker
        .json<{ State?: { OOMKilled?: boolean; Error?: string } }>("GET", `/containers/${id}/json`)
        .catch(() => undefined);
      // The runtime may report a failure only here (an exit status it made up, 127 or 128, and the reason in
      // State.Error): then the exit status is not the command's.
      const error = info?.State?.Error || res.Error?.Message || "";
      if (error !== "") throw classifyStartFailure(error, command);
      return { exitCode: res.StatusCode, oomKilled: info?.State?.OOMKilled === true };
    },
    async stats() {
      const s = await docker.json<DockerStats>(
        "GET",
        `/containers/${id}/stats?stream=false&one-shot=true`,
        undefined,
        {
          timeoutMs: 10_000,
        },
      );
      const mem = s.memory_stats ?? {};
      const cache = mem.stats?.cache ?? mem.stats?.inactive_file ?? 0;
      const memoryBytes = Math.max(0, (mem.usage ?? 0) - cache);
      return {
        cpuSeconds: (s.cpu_stats?.cpu_usage?.total_usage ?? 0) / 1e9,
        memoryBytes,
        maxMemoryBytes: Math.max(memoryBytes, mem.max_usage ?? 0),
      };
    },
    async writableLayerBytes() {
      const info = await docker.json<{ SizeRw?: number }>(
        "GET",
        `/containers/${id}/json?size=true`,
        undefined,
        {
          timeoutMs: 30_000,
        },
      );
      return info.SizeRw ?? 0;
    },
    async stop(graceSeconds: number) {
      const res = await docker.call(
        "POST",
        `/containers/${id}/stop?t=${Math.max(0, Math.round(graceSeconds))}`,
        undefined,
        {
          timeoutMs: (graceSeconds + 30) * 1000,
        },
      );
      if (res.status >= 500) throw brokenDaemon("stop", new Error(messageOf(res.body.toString("utf8"))));
    },
    async remove() {
      if (removed) return;
      const res = await docker.call("DELETE", `/containers/${id}?force=true&v=true`, undefined, {
        timeoutMs: 60_000,
      });
      if (res.status < 300 || res.status === 404) removed = true;
      else throw brokenDaemon("remove", new Error(messageOf(res.body.toString("utf8"))));
    },
  };
}

interface DockerStats {
  cpu_stats?: { cpu_usage?: { total_usage?: number } };
  memory_stats?: { usage?: number; max_usage?: number; stats?: { cache?: number; inactive_file?: number } };
}
