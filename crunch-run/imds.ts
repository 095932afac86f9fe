/**
 * Spot interruption notices from the instance metadata service (IMDSv2, as on EC2 with tokens required).
 *
 * - The client asks for a session token (`PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`),
 *   keeps it, and asks for a new one before its TTL runs out; `GET /latest/meta-data/spot/instance-action` with
 *   `X-aws-ec2-metadata-token` answers 404 (no notice) or 200 with `{"action": ..., "time": ...}`. A 401 means
 *   the token is no longer valid (the service restarted, the clock jumped): one new token and one retry.
 * - Every request has a short timeout (1.5 s): the service is on the instance's link, or it is not there at all.
 * - The endpoint is the first line of `${DISPATCH_VM_ROOT:-}/etc/dispatch-cloud/imds-endpoint` when that file
 *   exists (tests, EC2-compatible clouds), else `http://169.254.169.254`.
 * - The poller gives up at once, logging one line, when its client's very first token() fails: no metadata
 *   service here (a local VM, say; the supervisor's client tries EC2's IMDSv2, then Azure's Scheduled Events:
 *   ./azure-events.ts). After a first success, failures are logged at debug and polling goes on. It stops for
 *   good after the first notice.
 *
 * Only node:http/https and node:fs: the supervisor loads this next to its other small modules.
 */
import { readFileSync } from "node:fs";
import http from "node:http";
import https from "node:https";
import type { RunnerPaths } from "./paths.ts";

export const DEFAULT_IMDS_ENDPOINT = "http://169.254.169.254";
/** The longest TTL IMDSv2 grants (6 hours): one token request per 6 hours per supervisor. */
export const DEFAULT_TOKEN_TTL_SECONDS = 21_600;
export const DEFAULT_IMDS_TIMEOUT_MS = 1500;
const MAX_BODY = 64 * 1024;
const TOKEN_PATH = "/latest/api/token";
const NOTICE_PATH = "/latest/meta-data/spot/instance-action";

/** A spot interruption notice: what EC2 will do (`terminate`, `stop`, `hibernate`) and when (ISO 8601). */
export interface SpotNotice {
  action: string;
  time: string;
}

/** An IMDS request failed: no answer (status null), or an answer other than the expected ones. */
export class ImdsError extends Error {
  constructor(
    message: string,
    readonly status: number | null,
  ) {
    super(message);
    this.name = "ImdsError";
  }
}

/**
 * The IMDS base URL for this instance: the endpoint file's first line, or DEFAULT_IMDS_ENDPOINT when there is no
 * such file. Throws ImdsError when the file cannot be read or does not hold an http(s) URL.
 */
export function imdsEndpoint(paths: Pick<RunnerPaths, "imdsEndpointFile">): string {
  let text: string;
  try {
    text = readFileSync(paths.imdsEndpointFile, "utf8");
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") return DEFAULT_IMDS_ENDPOINT;
    throw new ImdsError(`cannot read ${paths.imdsEndpointFile}: ${(err as Error).message}`, null);
  }
  const line = (text.split("\n")[0] ?? "").trim();
  let url: URL;
  try {
    url = new URL(line);
  } catch {
    throw new ImdsError(`${paths.imdsEndpointFile}: the first line is not a URL`, null);
  }
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    throw new ImdsError(`${paths.imdsEndpointFile}: the URL must be http:// or https://`, null);
  }
  return line.replace(/\/+$/, "");
}

export interface ImdsClientOptions {
  /** The service's base URL (no trailing slash needed). */
  endpoint: string;
  /** TTL asked for each token, 1..21600 seconds. */
  tokenTtlSeconds?: number;
  /** Timeout of each request. */
  timeoutMs?: number;
  /** Milliseconds since the epoch (tests). */
  now?: () => number;
}

export interface ImdsClient {
  readonly endpoint: string;
  /** Makes sure a valid token is held (asks for one when there is none or it is about to expire). */
  token(): Promise<void>;
  /** The current spot interruption notice, or null when there is none (404). */
  spotNotice(): Promise<SpotNotice | null>;
  /** Token requests made so far (tests). */
  readonly tokenRequests: number;
}

export interface Answer {
  status: number;
  body: string;
}

/**
 * One request to a metadata service at `base` (its path is `path`, as sent), with one deadline for the whole
 * exchange and a bounded body. Fails with ImdsError (status null) when there is no whole answer in time.
 */
export function metadataRequest(
  base: URL,
  method: "PUT" | "GET",
  path: string,
  headers: Record<string, string>,
  timeoutMs: number,
): Promise<Answer> {
  const lib = base.protocol === "https:" ? https : http;
  return new Promise((resolve, reject) => {
    let settled = false;
    const fail = (message: string) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      req.destroy();
      reject(new ImdsError(`${method} ${path}: ${message}`, null));
    };
    const req = lib.request({
      protocol: base.protocol,
      hostname: base.hostname,
      port: base.port,
      method,
      path,
      headers,
      agent: false,
    });
    // One deadline for the whole exchange (connect, answer, body), not per socket event.
    const timer = setTimeout(() => fail(`no answer within ${timeoutMs} ms`), timeoutMs);
    req.on("error", (err) => fail(err.message));
    req.on("response", (res) => {
      const chunks: Buffer[] = [];
      let size = 0;
      res.on("data", (c: Buffer) => {
        size += c.length;
        if (size > MAX_BODY) fail(`answer larger than ${MAX_BODY} bytes`);
        else chunks.push(c);
      });
      res.on("error", (err) => fail(err.message));
      res.on("end", () => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        resolve({ status: res.statusCode ?? 0, body: Buffer.concat(chunks).toString("utf8") });
      });
    });
    req.end();
  });
}

export function createImdsClient(opts: ImdsClientOptions): ImdsClient {
  const base = new URL(opts.endpoint.replace(/\/+$/, ""));
  const basePath = base.pathname.replace(/\/+$/, "");
  const ttl = opts.tokenTtlSeconds ?? DEFAULT_TOKEN_TTL_SECONDS;
  if (!Number.isInteger(ttl) || ttl < 1 || ttl > 21_600) throw new Error("tokenTtlSeconds must be 1..21600");
  const timeoutMs = opts.timeoutMs ?? DEFAULT_IMDS_TIMEOUT_MS;
  const now = opts.now ?? Date.now;
  /** Renew this long before the token expires: a minute, or half the TTL for short ones. */
  const margin = Math.min(60_000, (ttl * 1000) / 2);
  let held: { value: string; renewAt: number } | null = null;
  let tokenRequests = 0;

  const request = (method: "PUT" | "GET", path: string, headers: Record<string, string>) =>
    metadataRequest(base, method, `${basePath}${path}`, headers, timeoutMs);

  async function token(): Promise<string> {
    if (held !== null && now() < held.renewAt) return held.value;
    tokenRequests++;
    const askedAt = now();
    const res = await request("PUT", TOKEN_PATH, { "X-aws-ec2-metadata-token-ttl-seconds": String(ttl) });
    const value = res.body.trim();
    if (res.status !== 200 || value === "" || value.length > 1000 || /[\r\n]/.test(value)) {
      held = null;
      throw new ImdsError(`PUT ${TOKEN_PATH}: answered ${res.status}`, res.status);
    }
    held = { value, renewAt: askedAt + ttl * 1000 - margin };
    return value;
  }

  async function spotNotice(): Promise<SpotNotice | null> {
    let res = await request("GET", NOTICE_PATH, { "X-aws-ec2-metadata-token": await token() });
    if (res.status === 401) {
      held = null;
      res = await request("GET", NOTICE_PATH, { "X-aws-ec2-metadata-token": await token() });
    }
    if (res.status === 404) return null;
    if (res.status !== 200) throw new ImdsError(`GET ${NOTICE_PATH}: answered ${res.status}`, res.status);
    return parseNotice(res.body);
  }

  return {
    endpoint: opts.endpoint,
    async token() {
      await token();
    },
    spotNotice,
    get tokenRequests() {
      return tokenRequests;
    },
  };
}

/** `{"action": "...", "time": "..."}`, as EC2 answers; anything else is an ImdsError. */
export function parseNotice(body: string): SpotNotice {
  let v: unknown;
  try {
    v = JSON.parse(body);
  } catch {
    throw new ImdsError(`${NOTICE_PATH}: the answer is not JSON`, 200);
  }
  const o = (typeof v === "object" && v !== null ? v : {}) as Record<string, unknown>;
  const text = (key: string): string => {
    const s = o[key];
    // Printable ASCII only: it ends up in a log line and the bundle's state reason.
    if (typeof s !== "string" || s.length > 100 || !/^[ -~]+$/.test(s)) {
      throw new ImdsError(`${NOTICE_PATH}: the answer has no usable ${key}`, 200);
    }
    return s;
  };
  return { action: text("action"), time: text("time") };
}

/** The few logger methods the poller uses (a pino Logger fits). */
export interface PollLogger {
  info(obj: object, msg: string): void;
  debug(obj: object, msg: string): void;
}

export interface SpotPollerOptions {
  client: Pick<ImdsClient, "endpoint" | "token" | "spotNotice">;
  intervalMs: number;
  log: PollLogger;
  /** Called once, with the first notice; polling has stopped by then. */
  onNotice: (notice: SpotNotice) => void;
}

export interface SpotPoller {
  stop(): void;
  /** Resolves when polling has ended: stopped, given up (no IMDS), or after a notice. */
  readonly done: Promise<void>;
}

/** Polls at once, then every intervalMs (never two requests at a time). */
export function startSpotPoller(opts: SpotPollerOptions): SpotPoller {
  let stopped = false;
  let timer: NodeJS.Timeout | null = null;
  let wake: (() => void) | null = null;
  const stop = () => {
    stopped = true;
    if (timer !== null) clearTimeout(timer);
    wake?.();
  };
  const sleep = (ms: number) =>
    new Promise<void>((resolve) => {
      wake = resolve;
      timer = setTimeout(resolve, ms);
      timer.unref();
    });
  const done = (async () => {
    try {
      await opts.client.token();
    } catch (err) {
      opts.log.info(
        { endpoint: opts.client.endpoint, err: (err as Error).message },
        "no instance metadata service answers: spot interruption notices are not watched",
      );
      return;
    }
    opts.log.debug(
      { endpoint: opts.client.endpoint, intervalMs: opts.intervalMs },
      "watching for spot notices",
    );
    while (!stopped) {
      let notice: SpotNotice | null = null;
      try {
        notice = await opts.client.spotNotice();
      } catch (err) {
        opts.log.debug({ err: (err as Error).message }, "spot notice poll failed");
      }
      if (stopped) return;
      if (notice !== null) {
        stopped = true;
        opts.onNotice(notice);
        return;
      }
      await sleep(opts.intervalMs);
    }
  })();
  return { stop, done };
}
