/**
 * The runner API client crunch-run's supervisor uses (node:http/https only, so the supervisor can call
 * `start` before loading anything else). The bearer token lives in this closure and in request headers only;
 * no error message or log line built here contains it.
 *
 * Retries: network errors and 5xx answers are retried with backoff (0.2 s doubling to 5 s) for a budget per
 * call (finish, outputs, logs, dependencies: 10 minutes, as the REST server may be restarting); 4xx answers
 * are never retried.
 */

import http from "node:http";
import https from "node:https";
import type { Readable } from "node:stream";
import { CasApiError } from "../lib/cas/client.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { retryWithBackoff } from "../lib/retry.ts";

/** The runner API answered with a non-2xx status. */
export class RunnerApiError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    readonly apiMessage: string,
    what: string,
  ) {
    super(`${what}: ${status} ${code}: ${apiMessage}`);
    this.name = "RunnerApiError";
  }
}

/** 401/409 on a runner call: the bundle is no longer this runner's (killed, requeued, finished elsewhere). */
export const isNotOurs = (err: unknown): boolean =>
  (err instanceof RunnerApiError &&
    (err.status === 401 || (err.status === 409 && err.code !== "runner.log_gap"))) ||
  // The content-addressed store refuses the same token the same way (inputs staged, outputs uploaded with it).
  (err instanceof CasApiError && err.status === 401);

/** Errors of the local filesystem: retrying cannot help (ENOSPC is judged by the supervisor: broken). */
const LOCAL_CODES = new Set([
  "ELOOP",
  "ENAMETOOLONG",
  "EACCES",
  "EPERM",
  "ENOENT",
  "ENOTDIR",
  "EISDIR",
  "EEXIST",
  "EROFS",
  "ENOSPC",
  "EDQUOT",
  "EMFILE",
]);

/** Network failures and 5xx answers are worth retrying; other answers and local errors are not. */
export function isTransient(err: unknown): boolean {
  if (err instanceof RunnerApiError) return err.status >= 500;
  if (err instanceof DispatchCloudError || err instanceof SyntaxError) return false;
  if (LOCAL_CODES.has((err as NodeJS.ErrnoException).code ?? "")) return false;
  return err instanceof Error; // network errors: refused, reset, timed out
}

export interface RetryOptions {
  budgetMs: number;
  signal?: AbortSignal;
  sleep?: (ms: number, signal?: AbortSignal) => Promise<void>;
  onRetry?: (err: unknown, delayMs: number) => void;
}

/** Runs fn until it succeeds, fails permanently, or the budget is spent (then the last error is thrown). */
export function withRetries<T>(fn: () => Promise<T>, opts: RetryOptions): Promise<T> {
  return retryWithBackoff(() => fn(), { ...opts, isTransient });
}

export interface ResourceUsage {
  cpuSeconds: number;
  memoryBytes: number;
  maxMemoryBytes: number;
  diskBytes: number;
}

export interface RunnerSpec {
  uuid: string;
  attempt: number;
  command: string[];
  image: string;
  /**
   * The immutable reference pinned at submit time (docs/images.md "Pinning"): `repo@sha256:<hex>` for a registry
   * image, `sha256:<image id hex>` for an image in our store; null/absent: run `image` as given.
   */
  imagePinned?: string | null;
  /** The image is in our store: its unpacked `docker save` tree's manifest, its id and the tree's bytes. */
  imageStore?: { manifest: string; imageId: string; bytes: number } | null;
  env: Record<string, string>;
  resources: {
    vcpus: number;
    ram: number;
    scratch: number;
    gpu: { stack: string; deviceCount: number } | null;
  };
  limits: { time: number | null; disk: number | null; network: boolean };
  /** `manifest`: the dependency's output manifest in the content-addressed store (null: an archive to fetch). */
  dependencies: { bundle: string; subpath: string; name: string; manifest?: string | null }[];
  /** Most files and bytes the outputs may hold; given by servers with the content-addressed store. */
  outputLimits?: { files: number; bytes: number };
  gpuDevices: number[];
  instanceType: string | null;
}

export interface FinishBody {
  exitCode: number | null;
  reason?: string;
  failed?: boolean;
  resourceUsage?: ResourceUsage & Record<string, number>;
  /** The outputs' manifest in the content-addressed store (`<sha256>/<size>`). */
  outputManifest?: string;
}

/** What `starts` answers for one token: what `start` with it would answer, or its refusal. */
export type StartsItem =
  | { ok: true; body: { uuid: string; state: string; attempt: number } }
  | { ok: false; status: number; code: string; message: string };

export interface RunnerClient {
  start(opts?: Partial<RetryOptions>): Promise<{ uuid: string; state: string; attempt: number }>;
  /**
   * The `start` calls of several runners at once, each by its own token (`POST /runner/starts`, one try; the
   * warm pool's, for the bundles it was handed together): one item per token, in their order.
   */
  starts(tokens: readonly string[]): Promise<StartsItem[]>;
  spec(opts?: Partial<RetryOptions>): Promise<RunnerSpec>;
  /** Resource usage, and what the bundle waits for before its container runs (`status`; null = nothing). */
  heartbeat(usage: ResourceUsage, status?: string | null): Promise<{ state: string }>;
  /** Sends one chunk of a log stream at its byte offset; answers the server's stored total. */
  /** Sends a log chunk; `truncated`: the stream reached the server's limit, later chunks are dropped. */
  logs(
    stream: "stdout" | "stderr",
    offset: number,
    chunk: Buffer,
    opts?: Partial<RetryOptions>,
  ): Promise<{ stored: number; truncated: boolean }>;
  /** Uploads a tar made fresh by makeBody on each try. */
  putOutputs(
    makeBody: () => Readable,
    opts?: Partial<RetryOptions>,
  ): Promise<{ files: number; bytes: number }>;
  /** The tar stream of dependency index (one try; callers retry the whole staging). */
  dependency(index: number): Promise<http.IncomingMessage>;
  finish(body: FinishBody, opts?: Partial<RetryOptions>): Promise<unknown>;
  /** Reports a spot interruption notice: the bundle goes back to staged (attempts permitting), else failed. */
  preempted(
    notice: { action: string; time: string },
    opts?: Partial<RetryOptions>,
  ): Promise<{ uuid: string; state: string; attempt: number }>;
  /** The instance, not the bundle, failed it: back to staged (attempts permitting), else failed. */
  requeue(
    reason: string,
    opts?: Partial<RetryOptions> & {
      /** crunchrun.image_unavailable: the image's registry was unavailable (not counted as an attempt). */
      code?: "crunchrun.image_unavailable";
    },
  ): Promise<{ uuid: string; state: string; attempt: number }>;
}

export const LONG_RETRY_MS = 10 * 60_000;
const SHORT_RETRY_MS = 60_000;

export function createRunnerClient(opts: {
  apiUrl: string;
  /** The runner's token; null for a client that only makes `starts` calls (whose tokens are in the body). */
  token: string | null;
  signal?: AbortSignal;
  onRetry?: (what: string, err: unknown, delayMs: number) => void;
  /** Which crunch-run process calls (its User-Agent): a bundle's supervisor, or the warm pool for it. */
  caller?: "supervisor" | "warm pool";
}): RunnerClient {
  const base = new URL(opts.apiUrl);
  const lib = base.protocol === "https:" ? https : http;
  const basePath = base.pathname.replace(/\/+$/, "");
  const auth = opts.token === null ? null : `Bearer ${opts.token}`;
  const userAgent = `crunch-run (${opts.caller ?? "supervisor"})`;

  function send(
    method: string,
    path: string,
    what: string,
    body?: { type: string; data: Buffer | Readable },
  ): Promise<http.IncomingMessage> {
    return new Promise((resolve, reject) => {
      const headers: Record<string, string> = { accept: "application/json", "user-agent": userAgent };
      if (auth !== null) headers["authorization"] = auth;
      if (body !== undefined) {
        headers["content-type"] = body.type;
        if (Buffer.isBuffer(body.data)) headers["content-length"] = String(body.data.length);
      }
      const req = lib.request({
        protocol: base.protocol,
        hostname: base.hostname,
        port: base.port,
        method,
        path: `${basePath}${path}`,
        headers,
        timeout: 60_000,
      });
      req.on("timeout", () => req.destroy(new Error(`${what}: timed out`)));
      /** The body's own failure (packing the outputs): the caller's to judge, not a network error. */
      let bodyError: unknown = null;
      req.on("error", (err) => {
        if (bodyError !== null) return reject(bodyError);
        const e = new Error(`${what}: ${err.message}`) as NodeJS.ErrnoException;
        e.code = (err as NodeJS.ErrnoException).code ?? "ENETWORK";
        reject(e);
      });
      req.on("response", async (res) => {
        const status = res.statusCode ?? 0;
        if (status >= 200 && status < 300) return resolve(res);
        const text = await readText(res).catch(() => "");
        let code = "http.error";
        let message = text.slice(0, 500);
        try {
          const parsed = JSON.parse(text) as { error?: { code?: string; message?: string } };
          if (parsed.error?.code) code = parsed.error.code;
          if (parsed.error?.message) message = parsed.error.message;
        } catch {
          // not JSON
        }
        reject(new RunnerApiError(status, code, message, what));
      });
      if (body === undefined) req.end();
      else if (Buffer.isBuffer(body.data)) req.end(body.data);
      else {
        body.data.on("error", (err) => {
          bodyError = err;
          req.destroy(err);
        });
        body.data.pipe(req);
      }
    });
  }

  async function json<T>(
    method: string,
    path: string,
    what: string,
    body: { type: string; data: Buffer | (() => Readable) } | undefined,
    budgetMs: number,
    retry: Partial<RetryOptions> = {},
  ): Promise<T> {
    return withRetries(
      async () => {
        const res = await send(
          method,
          path,
          what,
          body === undefined
            ? undefined
            : { type: body.type, data: Buffer.isBuffer(body.data) ? body.data : body.data() },
        );
        const text = await readText(res);
        return (text === "" ? undefined : JSON.parse(text)) as T;
      },
      {
        budgetMs,
        ...(opts.signal === undefined ? {} : { signal: opts.signal }),
        onRetry: (err, delay) => opts.onRetry?.(what, err, delay),
        ...retry,
      },
    );
  }
  const jsonBody = (v: unknown) => ({ type: "application/json", data: Buffer.from(JSON.stringify(v)) });

  return {
    start: (r) => json("POST", "/api/v1/runner/start", "start", jsonBody({}), SHORT_RETRY_MS, r),
    async starts(tokens) {
      const answer = await json<unknown>("POST", "/api/v1/runner/starts", "starts", jsonBody({ tokens }), 0);
      const items = (answer as { items?: unknown } | null)?.items;
      if (!Array.isArray(items) || items.length !== tokens.length) {
        throw new Error(`starts: the server's answer has no item for each of the ${tokens.length} tokens`);
      }
      return items.map((item, i) => {
        const parsed = startsItem(item);
        if (parsed === null)
          throw new Error(`starts: item ${i} of the server's answer is not a start's answer`);
        return parsed;
      });
    },
    spec: (r) => json("GET", "/api/v1/runner/spec", "spec", undefined, SHORT_RETRY_MS, r),
    heartbeat: (usage, status) =>
      json(
        "POST",
        "/api/v1/runner/heartbeat",
        "heartbeat",
        jsonBody({ resourceUsage: usage, ...(status === undefined ? {} : { status }) }),
        0,
      ),
    async logs(stream, offset, chunk, r) {
      const res = await json<{ stored: number; truncated?: boolean }>(
        "POST",
        `/api/v1/runner/logs?stream=${stream}&offset=${offset}`,
        `logs (${stream})`,
        { type: "application/octet-stream", data: chunk },
        LONG_RETRY_MS,
        r,
      );
      return { stored: res.stored, truncated: res.truncated === true };
    },
    putOutputs: (makeBody, r) =>
      json(
        "PUT",
        "/api/v1/runner/outputs",
        "outputs",
        { type: "application/x-tar", data: makeBody },
        LONG_RETRY_MS,
        r,
      ),
    dependency: (index) => send("GET", `/api/v1/runner/dependencies/${index}`, `dependency ${index}`),
    finish: (body, r) => json("POST", "/api/v1/runner/finish", "finish", jsonBody(body), LONG_RETRY_MS, r),
    preempted: (notice, r) =>
      json("POST", "/api/v1/runner/preempted", "preempted", jsonBody(notice), SHORT_RETRY_MS, r),
    requeue: (reason, r = {}) => {
      const { code, ...retry } = r;
      return json(
        "POST",
        "/api/v1/runner/requeue",
        "requeue",
        jsonBody({ reason, ...(code === undefined ? {} : { code }) }),
        SHORT_RETRY_MS,
        retry,
      );
    },
  };
}

/** An item of a `starts` answer, or null when it is neither a bundle nor an error. */
function startsItem(v: unknown): StartsItem | null {
  if (typeof v !== "object" || v === null) return null;
  const o = v as Record<string, unknown>;
  if (typeof o["uuid"] === "string" && typeof o["state"] === "string" && typeof o["attempt"] === "number") {
    return { ok: true, body: { uuid: o["uuid"], state: o["state"], attempt: o["attempt"] } };
  }
  const e = o["error"] as Record<string, unknown> | null | undefined;
  if (
    typeof o["status"] === "number" &&
    typeof e?.["code"] === "string" &&
    typeof e["message"] === "string"
  ) {
    return { ok: false, status: o["status"], code: e["code"], message: e["message"] };
  }
  return null;
}

function readText(res: http.IncomingMessage): Promise<string> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    res.on("data", (c: Buffer) => chunks.push(c));
    res.on("end", () => resolve(Buffer.concat(chunks).toString("utf8")));
    res.on("error", reject);
  });
}
