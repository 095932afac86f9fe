/**
 * The supervisor of one bundle attempt (`crunch-run --supervise <uuid>`, started by `--detach` in its own
 * session). In order: runner `start` (refused: exit 1, nothing touched); `spec`; the work dir
 * `${ROOT}/tmp/crunch-run/<uuid>-<attempt>/` (out/, in/<name>/, stdout.log, stderr.log); dependencies
 * staged from the runner API; the runtime (auto: docker if the daemon answers /_ping within ~1 s, else
 * process); the container, with its logs pushed while it runs, heartbeats with resource usage, and the time
 * and disk limits checked every second; outputs uploaded as a tar; `finish`; the work dir and the lock
 * removed.
 * One file of ~680 lines because these steps are one attempt's life in order, sharing its work dir, token and
 * cancellation; the runtimes (runtime-*.ts), the API client, log streaming and tar are their own modules.
 *
 * Outcomes without `finish`:
 * - SIGTERM/SIGINT (`--kill`): the container is stopped and removed, nothing is uploaded.
 * - A heartbeat or log push answered 401/409: the bundle is no longer this runner's; same as above.
 * - The Docker daemon is unreachable, or the disk is full (ENOSPC): the instance is broken.
 *   `${ROOT}/var/lock/crunch-run-broken` is written with the reason (`--list` then prints `broken`, the
 *   dispatcher requeues the bundle and drains the instance).
 * - The container runtime cannot start the container for a reason that is not the bundle's command (an OCI hook,
 *   a mount, a cgroup, a daemon 5xx: crunchrun.runtime_failed): the failure is counted against the instance
 *   (runtime-failures.ts; RUNTIME_FAILURES_BEFORE_BROKEN in a row write the broken file), a line for the user
 *   goes to the bundle's stderr, and the runner route `requeue` puts the bundle back in the queue (attempts
 *   permitting). The bundle's command missing or not executable (crunchrun.command_unusable) fails the bundle
 *   with a reason naming the command.
 * - A spot interruption notice (preemptible instance types only; the instance metadata service is polled every
 *   spotCheckIntervalMs from `start` until the container exits, imds.ts): `${ROOT}/var/lock/crunch-run-preempted`
 *   is written with the notice first (`--list` prints `preempted`, no new bundle starts here), a line for the
 *   user goes to the bundle's stderr, the runner route `preempted` requeues the bundle (attempts permitting),
 *   then the container is stopped and removed.
 *
 * The runner token is in the API client's memory only; no log line or message carries it.
 */
import { mkdirSync, writeFileSync } from "node:fs";
import { lstat, readdir, rm } from "node:fs/promises";
import path from "node:path";
import { createCasClient } from "../lib/cas/client.ts";
import { type Digest, formatDigest, parseDigest } from "../lib/cas/digest.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { createLogger, type Logger } from "../lib/logger.ts";
import { extractTar, type PackOptions, packEntries, scanTree } from "../lib/tar.ts";
import { formatDuration, formatSize } from "../lib/units.ts";
import {
  createRunnerClient,
  isNotOurs,
  LONG_RETRY_MS,
  type ResourceUsage,
  RunnerApiError,
  type RunnerClient,
  type RunnerSpec,
  withRetries,
} from "./api-client.ts";
import { createSpotNoticeClient } from "./azure-events.ts";
import { CasCache } from "./cas-cache.ts";
import { removeStagedTree, stageTree } from "./cas-stage.ts";
import { createDockerClient, DockerApiError } from "./docker-api.ts";
import { createStoreImageLoader } from "./image-store.ts";
import { imdsEndpoint, type SpotNotice, type SpotPoller, startSpotPoller } from "./imds.ts";
import { parseLock, procStartTime, readLockText, releaseLock, replaceLock } from "./lock.ts";
import { LogStream } from "./log-stream.ts";
import { lockFile, type RunnerPaths, workDir } from "./paths.ts";
import type { ContainerRuntime, RunningContainer } from "./runtime.ts";
import { createDockerRuntime } from "./runtime-docker.ts";
import {
  clearRuntimeFailures,
  RUNTIME_FAILURES_BEFORE_BROKEN,
  recordRuntimeFailure,
} from "./runtime-failures.ts";
import { createProcessRuntime } from "./runtime-process.ts";
import type { StartDocument } from "./start-doc.ts";

export interface SuperviseOptions {
  doc: StartDocument;
  paths: RunnerPaths;
  env: NodeJS.ProcessEnv;
  /** The supervisor's own log (its stderr, appended to ${ROOT}/var/log/crunch-run/<uuid>.log); default pino. */
  logger?: Logger;
  /** A client whose `start` call is already under way (main.ts sends it before loading this module). */
  early?: { client: RunnerClient; abort: AbortController; started: Promise<unknown>; retryHook: RetryHook };
  /**
   * Called once the bundle's command has exited, before its outputs and its final report, unless this supervisor
   * is stopping (a stop signal, the bundle no longer its own, a preemption): a spare's supervisor tells its warm
   * pool then that it will be back soon (spare.ts, notifyEnded).
   */
  onEnded?: () => void;
}

/** Where an early client reports its retries once the supervisor's logger exists. */
export interface RetryHook {
  onRetry?: (what: string, err: unknown, delayMs: number) => void;
}

const LIMIT_CHECK_MS = 1000;
const STOP_GRACE_S = 2;
const KILL_GRACE_S = 1;
const DRAIN_MS = 5000;
/** How long a preempted supervisor waits for its log line to reach the REST server before reporting. */
const PREEMPT_FLUSH_MS = 5000;
/** How long it keeps retrying the `preempted` report (EC2 gives two minutes' notice). */
const PREEMPT_REPORT_MS = 30_000;
/** How long it keeps retrying a `requeue` report (then the dispatcher requeues the bundle as lost). */
const REQUEUE_REPORT_MS = 30_000;
const INPUT_NAME_RE = /^[A-Za-z0-9._-]{1,200}$/;

const isNoSpace = (err: unknown): boolean =>
  err instanceof Error &&
  ((err as NodeJS.ErrnoException).code === "ENOSPC" || /no space left on device/i.test(err.message));

/** Human size with one decimal, for "used 12.3MiB". */
export function humanSize(bytes: number): string {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = bytes;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return i === 0 ? `${bytes}B` : `${Number(v.toFixed(1))}${units[i]}`;
}

const sizeText = (bytes: number): string => {
  try {
    return formatSize(bytes);
  } catch {
    return humanSize(bytes);
  }
};

/** Bytes of regular files under dir (symlinks not followed). */
export async function diskUsage(dir: string): Promise<number> {
  let total = 0;
  let entries: string[];
  try {
    entries = await readdir(dir);
  } catch {
    return 0;
  }
  for (const name of entries) {
    const p = path.join(dir, name);
    const st = await lstat(p).catch(() => null);
    if (st === null) continue;
    if (st.isDirectory()) total += await diskUsage(p);
    else if (st.isFile()) total += st.size;
  }
  return total;
}

export async function supervise(opts: SuperviseOptions): Promise<number> {
  const { doc, paths, env } = opts;
  const log = (opts.logger ?? createLogger({ level: "info", format: "json" })).child({
    component: "crunch-run",
    uuid: doc.uuid,
    attempt: doc.attempt,
  });
  const lock = lockFile(paths, doc.uuid);
  const abort = opts.early?.abort ?? new AbortController();
  let stopSignal: string | null = null;
  let container: RunningContainer | null = null;
  let lost = false;
  /** The spot interruption notice this supervisor acted on, and its handling (awaited before exiting). */
  let preempted: SpotNotice | null = null;
  let preemption: Promise<void> | null = null;
  /** Stopping without finish: a signal, the bundle is no longer ours, or the instance is being preempted. */
  const stopping = (): boolean => stopSignal !== null || lost || preempted !== null;

  const onSignal = (sig: NodeJS.Signals) => {
    if (stopSignal !== null) return;
    stopSignal = sig;
    log.info({ signal: sig }, "stop requested: stopping the container; no upload, no finish");
    abort.abort(new Error(`stopped by ${sig}`));
    void container
      ?.stop(KILL_GRACE_S)
      .catch((err: unknown) => log.warn({ err }, "stopping the container failed"));
  };
  process.on("SIGTERM", onSignal);
  process.on("SIGINT", onSignal);

  const logRetry = (what: string, err: unknown, delayMs: number) =>
    log.warn({ what, err: (err as Error).message, delayMs }, "runner API call retried");
  if (opts.early !== undefined) opts.early.retryHook.onRetry = logRetry;
  const client =
    opts.early?.client ??
    createRunnerClient({
      apiUrl: doc.apiUrl,
      token: doc.token,
      signal: abort.signal,
      onRetry: logRetry,
    });

  /** The content-addressed store, with the same runner token: inputs by manifest, outputs by digest. */
  const cas = createCasClient({
    url: doc.apiUrl,
    token: doc.token,
    signal: abort.signal,
    onRetry: (err: unknown) => log.warn({ err: (err as Error).message }, "CAS call retried"),
  });
  const pinId = `${doc.uuid}-${doc.attempt}`;
  let cache = null as CasCache | null;
  /** The instance's cache, opened on first use (dependencies staged by manifest, images from the store). */
  const openCache = async (): Promise<CasCache> => {
    if (cache === null) {
      const c = new CasCache(paths.casCacheDir);
      await c.init();
      cache = c;
    }
    return cache;
  };

  try {
    try {
      const started = (await (opts.early?.started ?? client.start())) as { state: string };
      log.info({ state: started.state }, "started");
    } catch (err) {
      log.error({ err: (err as Error).message }, "runner start refused; exiting");
      return 1;
    }
    return await runAttempt();
  } finally {
    process.off("SIGTERM", onSignal);
    process.off("SIGINT", onSignal);
    cas.close();
    await cache?.unpin(pinId).catch((err: unknown) => log.warn({ err }, "unpinning the cache failed"));
    await releaseLock(lock, process.pid);
  }

  async function runAttempt(): Promise<number> {
    let spec: RunnerSpec;
    try {
      spec = await client.spec();
    } catch (err) {
      log.error({ err: (err as Error).message }, "cannot read the bundle's spec; exiting");
      return 1;
    }
    const dir = workDir(paths, doc.uuid, doc.attempt);
    const outDir = path.join(dir, "out");
    const inDir = path.join(dir, "in");
    let stdout: LogStream | null = null;
    let stderr: LogStream | null = null;
    const heartbeat = { timer: null as NodeJS.Timeout | null, stopped: false };
    /** What the bundle waits for before its container runs (an image pull), for its status; null = nothing. */
    let statusText: string | null = null;
    const usage: ResourceUsage = { cpuSeconds: 0, memoryBytes: 0, maxMemoryBytes: 0, diskBytes: 0 };

    const markLost = (err: unknown) => {
      if (stopping()) return;
      lost = true;
      log.warn({ err: (err as Error).message }, "the bundle is no longer this runner's: stopping, no finish");
      abort.abort(new Error("bundle no longer ours"));
      void container?.stop(KILL_GRACE_S).catch(() => {});
    };
    const onLogFailure = (err: unknown) => {
      if (isNotOurs(err)) markLost(err);
      else log.error({ err: (err as Error).message }, "log push failed for good");
    };
    /** A line for the user: the supervisor's log and the bundle's stderr, prefixed [crunch-run]. */
    const say = (line: string) => {
      log.info(line);
      stderr?.write(`[crunch-run] ${line}\n`);
    };
    /** What staging inputs by manifest cost, for the bundle's resource usage (and the server's metrics). */
    const staging = { ms: 0, blobsHit: 0, blobsFetched: 0, bytesFetched: 0, manifests: 0 };
    let outputManifest: Digest | null = null;
    const stageByManifest = async (
      digest: Digest,
      dep: { subpath: string },
      target: string,
    ): Promise<{
      files: number;
      bytes: number;
      blobsHit: number;
      blobsFetched: number;
      bytesFetched: number;
      ms: number;
    }> => {
      const t0 = performance.now();
      const c = await openCache();
      // Only the blobs of the subpath are fetched (and pinned).
      const fetched = await c.fetchManifest(cas, digest, {
        pin: { id: pinId, lockFile: lock },
        subpath: dep.subpath,
      });
      const part = fetched.part;
      if (part === null) throw new Error(`the dependency's outputs have no ${JSON.stringify(dep.subpath)}`);
      await removeStagedTree(target);
      const r = await stageTree(c, part, target);
      const ms = Math.round(performance.now() - t0);
      staging.ms += ms;
      staging.blobsHit += fetched.blobsHit;
      staging.blobsFetched += fetched.blobsFetched;
      staging.bytesFetched += fetched.bytesFetched;
      staging.manifests++;
      const bytes = part.entries.reduce((n, e) => n + (e.type === "file" ? e.digest.size : 0), 0);
      return { files: r.files, bytes, ...fetched, ms };
    };
    const finish = async (exitCode: number | null, reason: string | null, failed: boolean) => {
      await Promise.all([stdout?.flush(), stderr?.flush()]);
      if (lost || preempted !== null) return;
      try {
        const body = {
          exitCode,
          ...(reason === null ? {} : { reason: reason.slice(0, 1000) }),
          ...(failed ? { failed: true } : {}),
          ...(outputManifest === null ? {} : { outputManifest: formatDigest(outputManifest) }),
          resourceUsage: {
            ...usage,
            ...(staging.manifests === 0
              ? {}
              : {
                  stagingSeconds: staging.ms / 1000,
                  casBlobsHit: staging.blobsHit,
                  casBlobsFetched: staging.blobsFetched,
                  casBytesFetched: staging.bytesFetched,
                }),
          },
        };
        await client.finish(body);
        log.info({ exitCode, reason, failed }, "finished");
      } catch (err) {
        log.error({ err: (err as Error).message }, "finish failed");
      }
    };
    const markBroken = (reason: string) => {
      log.error({ reason }, "marking this instance broken; no finish (the dispatcher requeues the bundle)");
      try {
        mkdirSync(paths.lockDir, { recursive: true });
        writeFileSync(paths.brokenFile, `${reason}\n`);
      } catch (err) {
        log.error({ err: (err as Error).message }, "cannot write the broken file");
      }
    };

    /**
     * A spot interruption notice: the preempted file first (so no new bundle starts here, whatever happens
     * next), the user's line, the report (the bundle goes back to staged), then the container is stopped.
     */
    const onPreempted = async (notice: SpotNotice): Promise<void> => {
      if (stopping()) return;
      preempted = notice;
      try {
        mkdirSync(paths.lockDir, { recursive: true });
        writeFileSync(paths.preemptedFile, `${JSON.stringify(notice)}\n`);
      } catch (err) {
        log.error({ err: (err as Error).message }, "cannot write the preempted file");
      }
      log.warn({ action: notice.action, time: notice.time }, "spot interruption notice: stopping the bundle");
      stderr?.write(
        `[crunch-run] spot interruption notice (${notice.action} at ${notice.time}): this instance is being preempted; the bundle is stopped and requeued\n`,
      );
      // The token stops working once the report is in: the line must reach the server first.
      let flushTimer: NodeJS.Timeout | undefined;
      await Promise.race([
        Promise.all([stdout?.flush(), stderr?.flush()]).catch(() => {}),
        new Promise<void>((r) => {
          flushTimer = setTimeout(r, PREEMPT_FLUSH_MS);
        }),
      ]);
      clearTimeout(flushTimer);
      try {
        const res = await client.preempted(notice, { budgetMs: PREEMPT_REPORT_MS });
        log.info(
          { state: res.state, attempt: res.attempt },
          `preemption reported: the bundle is ${res.state}`,
        );
      } catch (err) {
        if (isNotOurs(err)) {
          log.info({ err: (err as Error).message }, "preemption not recorded: the bundle is no longer ours");
        } else {
          log.error(
            { err: (err as Error).message },
            "cannot report the preemption; the dispatcher requeues the bundle once this runner is gone",
          );
        }
      }
      abort.abort(new Error("preempted"));
      await container
        ?.stop(KILL_GRACE_S)
        .catch((err: unknown) => log.warn({ err }, "stopping the container failed"));
    };
    /**
     * The runtime failed to start the container (not the bundle's fault): count it against the instance (a run
     * of them marks it broken, before the report, so the bundle is not put straight back here), tell the user,
     * and have the bundle requeued. The token stops working once the report is in: the line goes out first.
     */
    const requeueForRuntime = async (err: DispatchCloudError): Promise<number> => {
      heartbeat.stopped = true;
      // The image's registry being unavailable is neither the bundle's fault nor this instance's: not counted
      // against the instance, and the server does not count it as an attempt either (up to a limit).
      const imageUnavailable = err.code === "crunchrun.image_unavailable";
      let failures = 0;
      if (!imageUnavailable) {
        try {
          failures = recordRuntimeFailure(paths, doc.uuid, err.message);
        } catch (e) {
          log.error({ err: (e as Error).message }, "cannot record the runtime failure");
        }
      }
      if (failures >= RUNTIME_FAILURES_BEFORE_BROKEN) {
        markBroken(`${failures} container starts in a row failed in the runtime; the last: ${err.message}`);
      }
      const reason = imageUnavailable
        ? err.message
        : `${err.message} (this instance's fault, not the bundle's)`;
      say(`${reason}: the bundle is requeued`);
      let flushTimer: NodeJS.Timeout | undefined;
      await Promise.race([
        Promise.all([stdout?.flush(), stderr?.flush()]).catch(() => {}),
        new Promise<void>((r) => {
          flushTimer = setTimeout(r, PREEMPT_FLUSH_MS);
        }),
      ]);
      clearTimeout(flushTimer);
      try {
        const res = await client.requeue(reason, {
          budgetMs: REQUEUE_REPORT_MS,
          ...(imageUnavailable ? { code: "crunchrun.image_unavailable" as const } : {}),
        });
        log.info(
          { state: res.state, attempt: res.attempt, failures },
          `requeue reported: the bundle is ${res.state}`,
        );
      } catch (e) {
        if (isNotOurs(e)) {
          log.info({ err: (e as Error).message }, "requeue not recorded: the bundle is no longer ours");
        } else {
          log.error(
            { err: (e as Error).message },
            "cannot report the requeue; the dispatcher requeues the bundle once this runner is gone",
          );
        }
      }
      return 1;
    };
    /** Polls for spot interruption notices on preemptible instances (null: not watched). */
    const watchSpot = (): SpotPoller | null => {
      if (!doc.preemptible || doc.spotCheckIntervalMs === 0) return null;
      let endpoint: string;
      try {
        endpoint = imdsEndpoint(paths);
      } catch (err) {
        log.warn({ err: (err as Error).message }, "spot interruption notices are not watched");
        return null;
      }
      return startSpotPoller({
        client: createSpotNoticeClient(endpoint),
        intervalMs: doc.spotCheckIntervalMs,
        log,
        onNotice: (notice) => {
          preemption = onPreempted(notice);
        },
      });
    };
    let spotPoller: SpotPoller | null = null;

    try {
      // The work dir is root's alone until the runtime hands it over (the process runtime's uid needs the way
      // to it open, not the dir itself: inputs staged into it must not be readable by other bundles).
      mkdirSync(paths.workRoot, { recursive: true, mode: 0o711 });
      mkdirSync(dir, { recursive: true, mode: 0o700 });
      mkdirSync(outDir, { recursive: true });
      mkdirSync(inDir, { recursive: true });
      stdout = new LogStream("stdout", path.join(dir, "stdout.log"), client, onLogFailure);
      stderr = new LogStream("stderr", path.join(dir, "stderr.log"), client, onLogFailure);

      // Heartbeats from here on, with the latest usage.
      const beat = async () => {
        if (heartbeat.stopped) return;
        if (doc.workerPid > 0 && !workerAlive(doc.workerPid, doc.workerPidStart)) {
          say("the worker process that started this bundle is gone: stopping it (it goes back to the queue)");
          markLost(new Error(`worker process ${doc.workerPid} is gone`));
          return;
        }
        try {
          if (container !== null) await sampleUsage(container, outDir, usage);
          await client.heartbeat({ ...usage }, statusText);
        } catch (err) {
          if (isNotOurs(err)) markLost(err);
          else if (!heartbeat.stopped) log.warn({ err: (err as Error).message }, "heartbeat failed");
        }
        if (!heartbeat.stopped) heartbeat.timer = setTimeout(beat, doc.heartbeatIntervalMs);
      };
      heartbeat.timer = setTimeout(beat, doc.heartbeatIntervalMs);
      spotPoller = watchSpot();

      // Dependencies.
      const inputs: string[] = [];
      for (const [i, dep] of spec.dependencies.entries()) {
        const what = `dependency ${i} (${dep.bundle}${dep.subpath === "" ? "" : `/${dep.subpath}`})`;
        if (!INPUT_NAME_RE.test(dep.name) || dep.name === "." || dep.name === "..") {
          say(`${what} has an unusable mount name ${JSON.stringify(dep.name)}`);
          await finish(null, `${what} has an unusable mount name ${JSON.stringify(dep.name)}`, true);
          return 0;
        }
        const target = path.join(inDir, dep.name);
        const manifest = dep.manifest ?? null;
        const stageArchive = async () => {
          const summary = await withRetries(
            async () => {
              await rm(target, { recursive: true, force: true });
              mkdirSync(target, { recursive: true });
              return extractTar(await client.dependency(i), target);
            },
            {
              budgetMs: LONG_RETRY_MS,
              signal: abort.signal,
              onRetry: (err) =>
                log.warn({ what, err: (err as Error).message }, "dependency download retried"),
            },
          );
          return `${summary.files} files, ${humanSize(summary.bytes)}`;
        };
        const stageManifest = async (m: string) => {
          const staged = await stageByManifest(parseDigest(m, `dependencies[${i}].manifest`), dep, target);
          return (
            `${staged.files} files, ${humanSize(staged.bytes)}; from the instance's cache ${staged.blobsHit} ` +
            `blobs, fetched ${staged.blobsFetched} (${humanSize(staged.bytesFetched)}) in ${staged.ms} ms`
          );
        };
        try {
          const summary = manifest === null ? await stageArchive() : await stageManifest(manifest);
          say(`staged ${what} at /in/${dep.name}: ${summary}`);
        } catch (err) {
          if (stopping()) return 1;
          if (isNotOurs(err)) {
            markLost(err);
            return 1;
          }
          if (isNoSpace(err)) throw err;
          const reason = `${what} could not be staged: ${(err as Error).message}`;
          say(reason);
          await finish(null, reason, true);
          return 0;
        }
        inputs.push(dep.name);
      }
      if (stopping()) return 1;

      // Runtime.
      const runtime = await chooseRuntime(doc, paths, env, log);
      say(`runtime: ${runtime.name}`);
      for (const w of runtime.warnings) {
        log.warn(w);
        stderr.write(`[crunch-run] WARNING: ${w}\n`);
      }
      try {
        await runtime.prepare(spec, {
          say,
          status: (text) => {
            statusText = text;
          },
          registryAuth: doc.registryAuth,
          signal: abort.signal,
          pullRetryMs: doc.imagePullRetryMs,
          // An image in our store is loaded from the instance's cache (fetched into it first) when Docker lacks it.
          ...(runtime.name === "docker" && spec.imageStore != null
            ? {
                loadFromStore: createStoreImageLoader({
                  cache: openCache,
                  cas,
                  docker: createDockerClient(env),
                  pin: { id: pinId, lockFile: lock },
                  lockDir: paths.lockDir,
                  image: spec.image,
                  say,
                  signal: abort.signal,
                  onLoaded: (r) => {
                    if (r.fetch === null) return;
                    staging.ms += r.ms;
                    staging.blobsHit += r.fetch.blobsHit;
                    staging.blobsFetched += r.fetch.blobsFetched;
                    staging.bytesFetched += r.fetch.bytesFetched;
                    staging.manifests++;
                  },
                }),
              }
            : {}),
        });
        if (stopping()) return 1;
        container = await runtime.start({
          uuid: doc.uuid,
          attempt: doc.attempt,
          spec,
          outDir,
          inDir,
          inputs,
          gpuDevices: doc.gpuDevices,
          vmRoot: paths.root,
          logMaxBytes: doc.containerLogMaxBytes,
        });
        clearRuntimeFailures(paths);
      } catch (err) {
        if (stopping()) return 1;
        if (isNotOurs(err)) {
          markLost(err);
          return 1;
        }
        if (
          err instanceof DispatchCloudError &&
          (err.code === "crunchrun.image_missing" ||
            err.code === "crunchrun.image_denied" ||
            err.code === "crunchrun.command_unusable")
        ) {
          say(err.message);
          await finish(null, err.message, true);
          return 0;
        }
        if (err instanceof DispatchCloudError && err.code === "crunchrun.image_unavailable") {
          return await requeueForRuntime(err);
        }
        if (err instanceof DockerApiError && err.status < 500) {
          const reason = `docker refused the container: ${err.daemonMessage}`;
          say(reason);
          await finish(null, reason, true);
          return 0;
        }
        throw err;
      }
      const startedAt = Date.now();
      // Record what runs the bundle in the lock, so --list can tell "stale" from "dead" if we die.
      const lockText = await readLockText(lockFile(paths, doc.uuid)).catch(() => null);
      const lockInfo = lockText === null ? null : parseLock(lockText);
      if (lockInfo !== null && lockInfo.pid === process.pid) {
        await replaceLock(lockFile(paths, doc.uuid), { ...lockInfo, container: container.ref }).catch(
          () => {},
        );
      }
      if (stopping()) void container.stop(KILL_GRACE_S).catch(() => {});
      const running = container;
      const streamsDone = Promise.all([pipeInto(running.stdout, stdout), pipeInto(running.stderr, stderr)]);

      // Limits, checked every second.
      let limitReason: string | null = null;
      let diskExceeded = false;
      const stopFor = (reason: string) => {
        if (limitReason !== null) return;
        limitReason = reason;
        say(reason);
        void running
          .stop(STOP_GRACE_S)
          .catch((err: unknown) => log.warn({ err }, "stopping the container failed"));
      };
      const limits = spec.limits;
      let limitTimer: NodeJS.Timeout | null = null;
      let checking = false;
      const checkLimits = async () => {
        if (checking) return;
        checking = true;
        try {
          if (limits.time !== null && Date.now() - startedAt > limits.time) {
            stopFor(`time limit of ${formatDuration(limits.time)} exceeded`);
          }
          if (limits.disk !== null && limitReason === null) {
            const used = (await diskUsage(outDir)) + (await running.writableLayerBytes().catch(() => 0));
            usage.diskBytes = used;
            if (used > limits.disk) {
              diskExceeded = true;
              stopFor(`disk limit of ${sizeText(limits.disk)} exceeded: used ${humanSize(used)}`);
            }
          }
        } finally {
          checking = false;
        }
      };
      if (limits.time !== null || limits.disk !== null) {
        limitTimer = setInterval(() => void checkLimits(), LIMIT_CHECK_MS);
        if (limits.time !== null) {
          // Also exactly at the deadline, not up to a second after it.
          const t = setTimeout(() => void checkLimits(), limits.time + 1);
          abort.signal.addEventListener("abort", () => clearTimeout(t), { once: true });
          void running.wait().finally(() => clearTimeout(t));
        }
      }

      let exit: Awaited<ReturnType<RunningContainer["wait"]>>;
      try {
        exit = await running.wait();
        if (!stopping()) opts.onEnded?.();
      } finally {
        if (limitTimer !== null) clearInterval(limitTimer);
        // The work is done: a notice from now on is left to the dispatcher (outputs and finish go on).
        spotPoller?.stop();
      }
      await Promise.race([streamsDone, new Promise((r) => setTimeout(r, DRAIN_MS).unref())]);
      heartbeat.stopped = true;
      if (heartbeat.timer !== null) clearTimeout(heartbeat.timer);
      await sampleUsage(running, outDir, usage).catch(() => {});

      if (stopping()) {
        await running.remove().catch((err: unknown) => log.warn({ err }, "removing the container failed"));
        return 1;
      }
      let failed = false;
      let reason: string | null = limitReason;
      let exitCode: number | null = exit.exitCode;
      if (reason === null && exit.oomKilled) {
        reason = `memory limit of ${sizeText(spec.resources.ram)} exceeded`;
        say(reason);
      }
      if (reason !== null) {
        failed = true;
        exitCode = null;
      } else if (exit.exitCode !== 0) {
        say(`the command exited with code ${exit.exitCode}`);
      }
      await running.remove().catch((err: unknown) => log.warn({ err }, "removing the container failed"));

      // Outputs (not after a disk limit: they are what was too large).
      if (!diskExceeded) {
        try {
          // Checked before any byte leaves: a link out of the tree, a FIFO or an unreadable entry fails the
          // bundle at once, named as the command saw it (never a host path, never retried).
          const shown: PackOptions =
            runtime.name === "docker"
              ? { shownAs: "/out" }
              : { shownAs: "$DISPATCH_OUTPUT_DIR", absoluteRoot: outDir };
          if (spec.outputLimits === undefined) {
            // A REST server without the content-addressed store: the outputs travel as one archive.
            const entries = await scanTree(outDir, shown);
            const up = await client.putOutputs(() => packEntries(outDir, entries, shown));
            say(`uploaded outputs: ${up.files} files, ${humanSize(up.bytes)}`);
          } else {
            const up = await cas.uploadTree(outDir, {
              ...shown,
              maxEntries: spec.outputLimits.files,
              maxBytes: spec.outputLimits.bytes,
            });
            outputManifest = up.digest;
            say(
              `uploaded outputs: ${up.files} files, ${humanSize(up.bytes)}; sent ${humanSize(up.bytesSent)}, ` +
                `${up.blobsSkipped} blobs already stored`,
            );
          }
        } catch (err) {
          if (isNotOurs(err)) {
            markLost(err);
            return 1;
          }
          if (isNoSpace(err)) throw err;
          const why =
            err instanceof RunnerApiError
              ? `${err.code}: ${err.apiMessage}`
              : // The server's limits (checked here first) read as they did when the server refused the upload.
                err instanceof DispatchCloudError && err.code.startsWith("runner.")
                ? `${err.code}: ${err.message}`
                : (err as Error).message;
          say(`uploading the outputs failed: ${why}`);
          failed = true;
          reason = reason ?? `uploading the outputs failed: ${why}`;
        }
      }
      await finish(exitCode, reason, failed);
      return 0;
    } catch (err) {
      if (stopping()) return 1;
      // Reported only once the container ended (docker's State.Error): the same outcomes as at start.
      if (err instanceof DispatchCloudError && err.code === "crunchrun.command_unusable") {
        say(err.message);
        await finish(null, err.message, true);
        return 0;
      }
      if (err instanceof DispatchCloudError && err.code === "crunchrun.runtime_failed" && !isNoSpace(err)) {
        return await requeueForRuntime(err);
      }
      if (isNoSpace(err)) {
        markBroken(`no space left on device: ${(err as Error).message}`);
      } else if (err instanceof DispatchCloudError && err.code === "crunchrun.docker_error") {
        markBroken(err.message);
      } else {
        // Anything else is a bug or an unexpected failure: fail the attempt with the reason.
        log.error({ err }, "supervisor failed");
        await finish(null, `crunch-run failed: ${(err as Error).message}`, true).catch(() => {});
        return 1;
      }
      stderr?.write(`[crunch-run] this instance is broken: ${(err as Error).message}\n`);
      await Promise.all([stdout?.flush(), stderr?.flush()]).catch(() => {});
      return 1;
    } finally {
      spotPoller?.stop();
      // A preemption being handled: its report and the container's stop come first.
      if (preemption !== null) await preemption;
      heartbeat.stopped = true;
      if (heartbeat.timer !== null) clearTimeout(heartbeat.timer);
      if (container !== null) await container.remove().catch(() => {});
      stdout?.close();
      stderr?.close();
      // Staged inputs are read-only trees (cas-stage.ts): made writable again before they go.
      await removeStagedTree(inDir).catch(() => {});
      await rm(dir, { recursive: true, force: true }).catch(() => {});
    }
  }
}

async function sampleUsage(container: RunningContainer, outDir: string, usage: ResourceUsage): Promise<void> {
  const s = await container.stats().catch(() => null);
  if (s !== null) {
    usage.cpuSeconds = Math.max(usage.cpuSeconds, s.cpuSeconds);
    usage.memoryBytes = s.memoryBytes;
    usage.maxMemoryBytes = Math.max(usage.maxMemoryBytes, s.maxMemoryBytes, s.memoryBytes);
  }
  usage.diskBytes = Math.max(
    usage.diskBytes,
    (await diskUsage(outDir)) + (await container.writableLayerBytes().catch(() => 0)),
  );
}

function pipeInto(source: NodeJS.ReadableStream, target: LogStream): Promise<void> {
  return new Promise((resolve) => {
    source.on("data", (chunk: Buffer) => target.write(chunk));
    source.on("end", () => resolve());
    source.on("close", () => resolve());
    source.on("error", () => resolve());
  });
}

async function chooseRuntime(
  doc: StartDocument,
  paths: RunnerPaths,
  env: NodeJS.ProcessEnv,
  log: Logger,
): Promise<ContainerRuntime> {
  const engine = doc.runtimeEngine;
  const processRuntime = () =>
    createProcessRuntime({
      uids: { first: doc.processUidFirst, count: doc.processUidCount },
      workRoot: paths.workRoot,
      uidLeaseDir: paths.uidLeaseDir,
      bundleLock: (uuid) => lockFile(paths, uuid),
    });
  if (engine === "process") return processRuntime();
  const docker = createDockerClient(env);
  let ok = false;
  try {
    const res = await docker.call("GET", "/_ping", undefined, { timeoutMs: 1000 });
    ok = res.status === 200;
    if (!ok && engine === "docker") {
      throw new DispatchCloudError(
        "crunchrun.docker_error",
        `the Docker daemon answered /_ping with ${res.status}`,
      );
    }
  } catch (err) {
    if (engine === "docker") throw err;
  }
  if (!ok) {
    log.warn(
      { socket: docker.socketPath },
      "runtime auto: no Docker daemon answers; using the process runtime",
    );
    return processRuntime();
  }
  return createDockerRuntime(docker, { pullLockDir: path.join(paths.lockDir, "crunch-run-pulls") });
}

/** The worker process that started a bundle is still there: pid alive, and the same process (start time). */
function workerAlive(pid: number, start: string): boolean {
  const now = procStartTime(pid);
  return now !== null && (start === "" || now === start);
}
