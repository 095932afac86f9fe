/**
 * The worker's client of the REST server's worker routes (lib/worker-protocol.ts): check-in, check-out and the
 * artifact. Every call goes out from the worker; nothing ever calls in (a worker needs no inbound port).
 */
import { DispatchCloudError, ERROR_CODES, type ErrorCode } from "../../lib/errors.ts";
import type { CheckinRequest, CheckinResponse } from "../../lib/worker-protocol.ts";

/** A failed call: its HTTP status (0: no answer at all) and whether trying again later may work. */
export class WorkerApiError extends DispatchCloudError {
  constructor(
    code: ErrorCode,
    message: string,
    readonly httpStatus: number,
    opts: { path?: string; cause?: unknown } = {},
  ) {
    super(code, message, opts);
  }

  /** Network errors, timeouts, 5xx and 429 pass; a refusal (other 4xx) stays until someone changes something. */
  get transient(): boolean {
    return this.httpStatus === 0 || this.httpStatus >= 500 || this.httpStatus === 429;
  }
}

/** A check-in's answer comes within the server's long poll (about 2 s); this is the most it may take. */
const CHECKIN_TIMEOUT_MS = 60_000;
const ARTIFACT_TIMEOUT_MS = 30 * 60_000;

export class WorkerApi {
  private readonly base: string;

  constructor(
    apiUrl: string,
    private readonly token: string,
  ) {
    this.base = apiUrl.endsWith("/") ? apiUrl : `${apiUrl}/`;
  }

  checkin(body: CheckinRequest, signal?: AbortSignal): Promise<CheckinResponse> {
    return this.json<CheckinResponse>("api/v1/workers/checkin", body, signal);
  }

  checkout(
    body: { workerId: string; handBack?: boolean },
    signal?: AbortSignal,
  ): Promise<{ requeued: string[] }> {
    return this.json<{ requeued: string[] }>("api/v1/workers/checkout", body, signal);
  }

  /** The server's runner artifact: its bytes and the sha256 its header announces. */
  async artifact(signal?: AbortSignal): Promise<{ content: Buffer; headerSha256: string }> {
    const res = await this.send("GET", "api/v1/workers/artifact", undefined, ARTIFACT_TIMEOUT_MS, signal);
    let content: Buffer;
    try {
      content = Buffer.from(await res.arrayBuffer());
    } catch (err) {
      throw new WorkerApiError(
        "worker.checkin_failed",
        `the artifact download broke off: ${message(err)}`,
        0,
        {
          cause: err,
        },
      );
    }
    return { content, headerSha256: res.headers.get("x-artifact-sha256") ?? "" };
  }

  private async json<T>(path: string, body: unknown, signal?: AbortSignal): Promise<T> {
    const res = await this.send("POST", path, body, CHECKIN_TIMEOUT_MS, signal);
    try {
      return (await res.json()) as T;
    } catch (err) {
      throw new WorkerApiError("worker.checkin_failed", `${path}: the answer is not JSON`, res.status, {
        cause: err,
      });
    }
  }

  private async send(
    method: string,
    path: string,
    body: unknown,
    timeoutMs: number,
    signal?: AbortSignal,
  ): Promise<Response> {
    const url = new URL(path, this.base);
    const timeout = AbortSignal.timeout(timeoutMs);
    let res: Response;
    try {
      res = await fetch(url, {
        method,
        headers: {
          authorization: `Bearer ${this.token}`,
          ...(body === undefined ? {} : { "content-type": "application/json" }),
        },
        ...(body === undefined ? {} : { body: JSON.stringify(body) }),
        signal: signal === undefined ? timeout : AbortSignal.any([signal, timeout]),
      });
    } catch (err) {
      if (signal?.aborted) throw err;
      throw new WorkerApiError(
        "worker.checkin_failed",
        `cannot reach the REST server at ${url.origin}: ${message(err)}`,
        0,
        { cause: err },
      );
    }
    if (res.ok) return res;
    const text = await res.text().catch(() => "");
    let e: { code?: string; message?: string; path?: string } | undefined;
    try {
      e = (JSON.parse(text) as { error?: typeof e }).error;
    } catch {
      e = undefined;
    }
    const code: ErrorCode =
      e?.code !== undefined && e.code in ERROR_CODES ? (e.code as ErrorCode) : "worker.checkin_failed";
    throw new WorkerApiError(code, e?.message ?? `HTTP ${res.status} from ${url.pathname}`, res.status, {
      ...(e?.path === undefined ? {} : { path: e.path }),
    });
  }
}

function message(err: unknown): string {
  const cause = (err as { cause?: { code?: string; message?: string } }).cause;
  const base = err instanceof Error ? err.message : String(err);
  return cause?.code !== undefined ? `${base} (${cause.code})` : base;
}
