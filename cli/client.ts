import { readFile } from "node:fs/promises";
import { resolve } from "node:path";
import { DispatchCloudError, ERROR_CODES, type ErrorCode } from "../lib/errors.ts";
import type { CliIo } from "./io.ts";

export const DEFAULT_API_URL = "http://127.0.0.1:8900";

export interface ClientOptions {
  apiUrl: string;
  token: string;
}

/**
 * Finds the API token: `--token-file`, then DISPATCH_CLOUD_TOKEN, then DISPATCH_CLOUD_TOKEN_FILE, then the
 * admin token `serve` wrote to `<data dir>/admin-token`. The token itself never goes on a command line.
 */
export async function findToken(io: CliIo, flags: { tokenFile?: string; dataDir?: string }): Promise<string> {
  const fromEnv = io.env["DISPATCH_CLOUD_TOKEN"];
  if (flags.tokenFile === undefined && fromEnv !== undefined && fromEnv !== "") return fromEnv.trim();
  const candidates = [
    flags.tokenFile,
    io.env["DISPATCH_CLOUD_TOKEN_FILE"],
    resolve(io.cwd, flags.dataDir ?? io.env["DISPATCH_CLOUD_DATA_DIR"] ?? "./data", "admin-token"),
  ].filter((p): p is string => p !== undefined && p !== "");
  for (const path of candidates) {
    try {
      const text = (await readFile(resolve(io.cwd, path), "utf8")).trim();
      if (text !== "") return text;
    } catch (err) {
      if (path === flags.tokenFile) {
        throw new DispatchCloudError("cli.no_token", `cannot read token file ${path}`, { cause: err });
      }
    }
  }
  throw new DispatchCloudError(
    "cli.no_token",
    "no API token: set DISPATCH_CLOUD_TOKEN, pass --token-file FILE, or run where `serve` wrote data/admin-token",
  );
}

/** A small client of the users' REST API; API errors come back as DispatchCloudError with the server's code. */
export class ApiClient {
  constructor(
    private readonly opts: ClientOptions,
    private readonly signal?: AbortSignal,
  ) {}

  async request<T>(
    method: string,
    path: string,
    body?: unknown,
    headers: Record<string, string> = {},
  ): Promise<T> {
    const res = await this.send(method, path, body, headers);
    const text = await res.text();
    try {
      return (text === "" ? undefined : JSON.parse(text)) as T;
    } catch {
      return undefined as T;
    }
  }

  /** The response of a request whose answer is not (only) JSON, once its status says it succeeded. */
  async raw(method: string, path: string): Promise<Response> {
    return this.send(method, path, undefined, {});
  }

  private async send(
    method: string,
    path: string,
    body: unknown,
    headers: Record<string, string>,
  ): Promise<Response> {
    const url = new URL(path, this.opts.apiUrl.endsWith("/") ? this.opts.apiUrl : `${this.opts.apiUrl}/`);
    let res: Response;
    try {
      res = await fetch(url, {
        method,
        headers: {
          ...headers,
          authorization: `Bearer ${this.opts.token}`,
          ...(body === undefined ? {} : { "content-type": "application/json" }),
        },
        ...(body === undefined ? {} : { body: JSON.stringify(body) }),
        ...(this.signal === undefined ? {} : { signal: this.signal }),
      });
    } catch (err) {
      throw new DispatchCloudError(
        "cli.unreachable",
        `cannot reach the REST server at ${this.opts.apiUrl} (is \`dispatch-cloud serve\` running? --api-url sets the address)`,
        { cause: err },
      );
    }
    if (res.ok) return res;
    throw responseError(res.status, parseJsonBody(await res.text()), url);
  }
}

/** A response body as JSON; undefined when it is empty or not JSON. */
export function parseJsonBody(text: string): unknown {
  try {
    return text === "" ? undefined : JSON.parse(text);
  } catch {
    return undefined;
  }
}

/** The error an API answered with (`{error: {code, message, path}}`), keeping its code when it is one of ours. */
export function responseError(status: number, body: unknown, url: URL): DispatchCloudError {
  const e = (body as { error?: { code?: string; message?: string; path?: string } } | undefined)?.error;
  const code: ErrorCode =
    e?.code !== undefined && e.code in ERROR_CODES ? (e.code as ErrorCode) : "internal.error";
  return new DispatchCloudError(
    code,
    e?.message ?? `HTTP ${status} from ${url.pathname}`,
    e?.path === undefined ? {} : { path: e.path },
  );
}

/** A CliIo that may also write raw bytes to stdout. */
export type ByteIo = CliIo & { write?: (bytes: Uint8Array) => void };

/**
 * Copies a response body to stdout: as bytes when the io can write bytes, else as UTF-8 lines through
 * io.out (a last line without a newline gets one).
 */
export async function copyToStdout(io: ByteIo, res: Response): Promise<number> {
  let bytes = 0;
  if (res.body === null) return 0;
  const write = io.write;
  const decoder = new TextDecoder("utf-8");
  let partial = "";
  for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
    bytes += chunk.length;
    if (write !== undefined) {
      write(chunk);
      continue;
    }
    const lines = (partial + decoder.decode(chunk, { stream: true })).split("\n");
    partial = lines.pop() ?? "";
    for (const line of lines) io.out(line);
  }
  if (write === undefined) {
    partial += decoder.decode();
    if (partial !== "") io.out(partial);
  }
  return bytes;
}
