/**
 * Pulling a bundle's image from its registry through the Docker Engine API (`POST /images/create`), with the
 * start document's credentials in the X-Registry-Auth header (never logged, never on disk, never in a message).
 *
 * - Progress: the daemon's JSON lines are summed over layers into "pulling IMAGE: N of M MB", said (the bundle's
 *   stderr and the supervisor's log) when the size is first known, then at most every PROGRESS_INTERVAL_MS, and
 *   once at the end; the same text goes to `status` (the supervisor's heartbeat carries it to the bundle's
 *   status) until the pull ends.
 * - Failures by reaction (classifyPullFailure): the image or tag is not there, the registry's host name does not
 *   exist (DNS: no such host), or the reference is not one -> crunchrun.image_missing; the registry refuses the
 *   credentials -> crunchrun.image_denied; both at once, naming the image. Anything else (refused connection,
 *   timeout, a DNS resolver that does not answer, 5xx, 429, a pull that ends without the image) is retried with
 *   backoff (1 s doubling to 30 s) for `retryBudgetMs`, each retry said, then crunchrun.image_unavailable (the
 *   supervisor requeues the bundle). "no space left on device" is the instance's: crunchrun.docker_error (the
 *   supervisor marks the instance broken).
 * - One pull per image per instance: the puller holds `<lockDir>/<sha256 of the reference>.lock` (lock.ts's
 *   link-based create, with the holder's pid and start time, so a dead holder's lock is removed) and writes its
 *   progress into it; the other supervisors on the instance (separate processes: detached ones and warm spares)
 *   wait for the image to appear or the lock to go, saying the holder's progress, then look again.
 */
import { createHash } from "node:crypto";
import { mkdirSync } from "node:fs";
import http from "node:http";
import path from "node:path";
import { DispatchCloudError } from "../lib/errors.ts";
import { parseImageRef } from "../lib/image-ref.ts";
import type { RegistryAuth } from "../lib/runner-protocol.ts";
import { DOCKER_API_VERSION, type DockerClient } from "./docker-api.ts";
import {
  holderAlive,
  type LockInfo,
  parseLock,
  procStartTime,
  readLockText,
  releaseLock,
  removeDeadLock,
  replaceLock,
  tryCreateLock,
} from "./lock.ts";

export const PROGRESS_INTERVAL_MS = 5000;
const FIRST_RETRY_MS = 1000;
const MAX_RETRY_MS = 30_000;
const WAIT_POLL_MS = 500;
/** A pull whose answer stream is silent this long (the daemon sends progress while it downloads or extracts) is
 * given up and retried like an unavailable registry. */
export const PULL_STALL_MS = 10 * 60_000;

export type PullFailure = "missing" | "denied" | "unavailable" | "broken";

/**
 * What a failed pull means, from the daemon's message (and its HTTP status when it refused at once). Docker
 * answers 404 for an unknown manifest and 500 for most registry errors, so the message decides.
 */
export function classifyPullFailure(message: string, status?: number): PullFailure {
  const m = message.toLowerCase();
  if (m.includes("no space left on device")) return "broken";
  if (
    status === 404 ||
    status === 400 ||
    /manifest unknown|name unknown|not found|repository does not exist|invalid reference format|no matching manifest|repository name must|no such host/.test(
      m,
    )
  ) {
    return "missing";
  }
  if (
    /unauthorized|authentication required|no basic auth credentials|incorrect username or password|access (is )?denied|requested access to the resource is denied|forbidden/.test(
      m,
    )
  ) {
    return "denied";
  }
  return "unavailable";
}

/** The credentials for `image`'s registry among the start document's, if any. */
export function authFor(image: string, auths: readonly RegistryAuth[]): RegistryAuth | undefined {
  const registry = parseImageRef(image)?.registry;
  return registry === undefined ? undefined : auths.find((a) => a.server === registry);
}

/** The X-Registry-Auth header's value: base64url of {username, password, serveraddress}. */
export function registryAuthHeader(auth: RegistryAuth): string {
  const json = JSON.stringify({
    username: auth.username,
    password: auth.password,
    serveraddress: auth.server,
  });
  return Buffer.from(json, "utf8").toString("base64url");
}

/** Sums the daemon's per-layer progress records into bytes done and bytes known. */
export class PullProgress {
  private readonly layers = new Map<string, { current: number; total: number }>();

  /** One record of the daemon's stream. */
  add(rec: { status?: string; id?: string; progressDetail?: { current?: number; total?: number } }): void {
    if (rec.id === undefined || rec.status === undefined) return;
    const layer = this.layers.get(rec.id);
    if (rec.status === "Downloading") {
      const total = rec.progressDetail?.total ?? 0;
      const current = rec.progressDetail?.current ?? 0;
      if (total > 0) this.layers.set(rec.id, { current: Math.min(current, total), total });
    } else if (
      (rec.status === "Download complete" || rec.status === "Pull complete") &&
      layer !== undefined
    ) {
      layer.current = layer.total;
    }
  }

  get done(): number {
    let n = 0;
    for (const l of this.layers.values()) n += l.current;
    return n;
  }

  get total(): number {
    let n = 0;
    for (const l of this.layers.values()) n += l.total;
    return n;
  }

  /** "3.1 of 8.4 MB" (decimal megabytes, one decimal); null while no size is known. */
  text(): string | null {
    const total = this.total;
    if (total === 0) return null;
    return `${mb(this.done)} of ${mb(total)} MB`;
  }
}

const mb = (bytes: number): string => (bytes / 1e6).toFixed(1);

export interface PullOptions {
  docker: DockerClient;
  /** The reference to pull (the bundle's pinned reference when it has one). */
  image: string;
  auth: readonly RegistryAuth[];
  say(line: string): void;
  /** The bundle's status while the pull lasts; null when it ends. */
  status?(text: string | null): void;
  signal: AbortSignal;
  retryBudgetMs: number;
  /** Where the per-image pull locks live (shared by every supervisor on the instance). */
  lockDir: string;
  /** The bundle's uuid, for the lock's content. */
  uuid: string;
  progressIntervalMs?: number;
}

const failure = (code: "image_missing" | "image_denied" | "image_unavailable", message: string) =>
  new DispatchCloudError(`crunchrun.${code}`, message);

/** Makes sure `image` is on the daemon: already there, pulled by another supervisor meanwhile, or pulled here. */
export async function pullImage(opts: PullOptions): Promise<void> {
  const { docker, image } = opts;
  const inspect = async (): Promise<boolean> => {
    const res = await docker.call("GET", `/images/${encodeURIComponent(image)}/json`);
    if (res.status >= 500) {
      throw new DispatchCloudError(
        "crunchrun.docker_error",
        `docker image inspect failed: ${res.body.toString("utf8").slice(0, 300)}`,
      );
    }
    return res.status === 200;
  };
  mkdirSync(opts.lockDir, { recursive: true });
  const file = path.join(
    opts.lockDir,
    `${createHash("sha256").update(image).digest("hex").slice(0, 32)}.lock`,
  );
  const self = { uuid: opts.uuid, pid: process.pid, startTime: procStartTime(process.pid) ?? "", image };
  const interval = opts.progressIntervalMs ?? PROGRESS_INTERVAL_MS;
  let lastWaitSaid = 0;
  try {
    for (;;) {
      if (opts.signal.aborted) throw opts.signal.reason;
      if (await inspect()) return;
      const lockInfo: LockInfo & { image: string } = self;
      if (tryCreateLock(file, lockInfo)) {
        try {
          // Another supervisor may have finished between the look and the lock.
          if (await inspect()) return;
          await pullHere(opts, inspect, (progress) =>
            replaceLock(file, { ...self, progress } as LockInfo).catch(() => {}),
          );
          return;
        } finally {
          await releaseLock(file, process.pid);
        }
      }
      const text = await readLockText(file);
      if (text === null) continue;
      const held = parseLock(text);
      if (held === null || !holderAlive(held)) {
        await removeDeadLock(file, text);
        continue;
      }
      const now = Date.now();
      if (now - lastWaitSaid >= interval) {
        lastWaitSaid = now;
        const progress = (JSON.parse(text) as { progress?: unknown }).progress;
        const line = `pulling ${image}: another bundle on this instance is pulling it${typeof progress === "string" ? ` (${progress})` : ""}; waiting for it`;
        opts.say(line);
        opts.status?.(line);
      }
      await sleep(WAIT_POLL_MS, opts.signal);
    }
  } finally {
    opts.status?.(null);
  }
}

/** The pull itself, retried while the registry is unavailable. */
async function pullHere(
  opts: PullOptions,
  inspect: () => Promise<boolean>,
  share: (progress: string) => Promise<void>,
): Promise<void> {
  const { image } = opts;
  const ref = parseImageRef(image);
  if (ref === null) throw failure("image_missing", `image ${image} is not a valid image reference`);
  const auth = authFor(image, opts.auth);
  const interval = opts.progressIntervalMs ?? PROGRESS_INTERVAL_MS;
  const deadline = Date.now() + opts.retryBudgetMs;
  let delay = FIRST_RETRY_MS;
  const t0 = Date.now();
  opts.say(`pulling ${image} from ${ref.registry}${auth === undefined ? "" : ` as ${auth.username}`}`);
  opts.status?.(`pulling ${image}`);
  for (;;) {
    const progress = new PullProgress();
    let lastSaid = 0;
    let saidText: string | null = null;
    const tell = (force: boolean) => {
      const text = progress.text();
      if (text === null || text === saidText) return;
      const now = Date.now();
      if (!force && saidText !== null && now - lastSaid < interval) return;
      lastSaid = now;
      saidText = text;
      const line = `pulling ${image}: ${text}`;
      opts.say(line);
      opts.status?.(line);
      void share(text);
    };
    const result = await pullOnce(opts.docker.socketPath, image, auth, opts.signal, (rec) => {
      progress.add(rec);
      tell(false);
    });
    tell(true);
    let why = result.error;
    if (why === null) {
      if (await inspect()) {
        opts.say(`pulled ${image} in ${((Date.now() - t0) / 1000).toFixed(1)} s`);
        return;
      }
      why = "the pull ended but the daemon does not have the image";
    }
    const kind = classifyPullFailure(why, result.status);
    if (kind === "broken") {
      throw new DispatchCloudError("crunchrun.docker_error", `docker could not pull ${image}: ${why}`);
    }
    if (kind === "missing") {
      throw failure("image_missing", `image ${image} could not be pulled: no such image (${why})`);
    }
    if (kind === "denied") {
      throw failure(
        "image_denied",
        `image ${image} could not be pulled: registry ${ref.registry} refused ${auth === undefined ? "an anonymous pull" : `the credentials of ${auth.username}`} (${why})`,
      );
    }
    if (Date.now() + delay > deadline) {
      throw failure(
        "image_unavailable",
        `image ${image} could not be pulled: registry ${ref.registry} is unavailable (${why}); gave up after ${Math.round((Date.now() - t0) / 1000)} s`,
      );
    }
    const line = `pulling ${image}: registry ${ref.registry} is unavailable (${why}); retrying in ${delay / 1000} s`;
    opts.say(line);
    opts.status?.(line);
    await sleep(delay, opts.signal);
    delay = Math.min(delay * 2, MAX_RETRY_MS);
  }
}

interface PullRecord {
  status?: string;
  id?: string;
  progressDetail?: { current?: number; total?: number };
  error?: string;
  errorDetail?: { message?: string };
}

/** One `POST /images/create`: the daemon's error (null when the stream ended without one) and HTTP status. */
function pullOnce(
  socketPath: string,
  image: string,
  auth: RegistryAuth | undefined,
  signal: AbortSignal,
  onRecord: (rec: PullRecord) => void,
): Promise<{ error: string | null; status: number }> {
  const { fromImage, tag } = splitForPull(image);
  return new Promise((resolve, reject) => {
    const req = http.request({
      socketPath,
      method: "POST",
      path: `/${DOCKER_API_VERSION}/images/create?fromImage=${encodeURIComponent(fromImage)}&tag=${encodeURIComponent(tag)}`,
      headers: {
        host: "docker",
        ...(auth === undefined ? {} : { "x-registry-auth": registryAuthHeader(auth) }),
      },
    });
    let stalled = false;
    req.setTimeout(PULL_STALL_MS, () => {
      stalled = true;
      req.destroy(new Error(`no progress from the daemon for ${PULL_STALL_MS / 60_000} minutes`));
    });
    const onAbort = () => req.destroy(signal.reason instanceof Error ? signal.reason : new Error("aborted"));
    signal.addEventListener("abort", onAbort, { once: true });
    const done = () => signal.removeEventListener("abort", onAbort);
    req.on("error", (err) => {
      done();
      if (signal.aborted) reject(signal.reason);
      else if (stalled) resolve({ error: err.message, status: 0 });
      else
        reject(
          new DispatchCloudError(
            "crunchrun.docker_error",
            `cannot reach the Docker daemon at ${socketPath}: ${err.message}`,
            { cause: err },
          ),
        );
    });
    req.on("response", (res) => {
      const status = res.statusCode ?? 0;
      let pending = "";
      let error: string | null = null;
      const chunks: Buffer[] = [];
      res.on("data", (chunk: Buffer) => {
        if (status !== 200) {
          chunks.push(chunk);
          return;
        }
        pending += chunk.toString("utf8");
        let nl = pending.indexOf("\n");
        while (nl >= 0) {
          const line = pending.slice(0, nl).trim();
          pending = pending.slice(nl + 1);
          nl = pending.indexOf("\n");
          if (line === "") continue;
          try {
            const rec = JSON.parse(line) as PullRecord;
            if (rec.error !== undefined) error = rec.errorDetail?.message ?? rec.error;
            else onRecord(rec);
          } catch {
            // not a JSON line: ignored
          }
        }
      });
      res.on("end", () => {
        done();
        if (status !== 200) {
          const text = Buffer.concat(chunks).toString("utf8");
          let message = text.trim().slice(0, 500);
          try {
            const v = JSON.parse(text) as { message?: unknown };
            if (typeof v.message === "string") message = v.message;
          } catch {
            // not JSON
          }
          resolve({ error: message || `HTTP ${status}`, status });
        } else {
          resolve({ error, status });
        }
      });
      // A stream destroyed mid-way (stalled, stopped, the daemon gone) may end with an error or only a close.
      const brokeOff = (why: string) => {
        done();
        if (signal.aborted) reject(signal.reason);
        else resolve({ error: `the daemon's answer broke off: ${why}`, status: 0 });
      };
      res.on("error", (err) =>
        brokeOff(stalled ? `no progress for ${PULL_STALL_MS / 60_000} minutes` : err.message),
      );
      res.on("close", () => {
        if (!res.complete) brokeOff(stalled ? `no progress for ${PULL_STALL_MS / 60_000} minutes` : "closed");
      });
    });
    req.end();
  });
}

/** Repository and tag (or digest) for the pull API's fromImage and tag parameters. */
export function splitForPull(image: string): { fromImage: string; tag: string } {
  const at = image.indexOf("@");
  if (at >= 0) return { fromImage: image.slice(0, at), tag: image.slice(at + 1) };
  const slash = image.lastIndexOf("/");
  const colon = image.lastIndexOf(":");
  if (colon > slash) return { fromImage: image.slice(0, colon), tag: image.slice(colon + 1) };
  return { fromImage: image, tag: "latest" };
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) {
      reject(signal.reason);
      return;
    }
    const t = setTimeout(() => {
      signal.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(t);
      reject(signal.reason);
    };
    signal.addEventListener("abort", onAbort, { once: true });
  });
}
