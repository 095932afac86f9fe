import { readFile } from "node:fs/promises";
import { resolve } from "node:path";
import { DispatchCloudError } from "../lib/errors.ts";
import { parseJsonBody, responseError } from "./client.ts";
import type { CliIo } from "./io.ts";

export const DEFAULT_MANAGEMENT_URL = "http://127.0.0.1:8901";

/** Flags every management command takes. */
export const MANAGEMENT_OPTIONS = {
  "management-url": { type: "string" },
  "token-file": { type: "string" },
  json: { type: "boolean" },
  help: { type: "boolean", short: "h" },
} as const;

export interface ManagementFlags {
  "management-url"?: string | undefined;
  "token-file"?: string | undefined;
}

/** An instance as `GET /management/v1/instances` returns it. */
export interface ManagementInstance {
  instanceId: string;
  address: string;
  instanceType: string;
  providerType: string;
  price: number;
  state: string;
  idleBehavior: string;
  runningBundles: string[];
  lastBusyAt: string | null;
  stateSince: string;
  secondsInState: number;
  /** A spot interruption notice arrived (absent from dispatchers older than the field). */
  preempted?: boolean;
  /** Why it takes no bundles or is going away (absent from dispatchers older than the field). */
  problem?: string | null;
}

/** A queued bundle as `GET /management/v1/bundles` returns it. */
export interface ManagementBundle {
  uuid: string;
  state: string;
  priority: number;
  resources: Record<string, unknown>;
  eligibleTypes: string[];
  firstSeenAt: string;
  schedulingStatus: string | null;
  instanceId: string | null;
}

/**
 * The management token: `--token-file`, else DISPATCH_CLOUD_MANAGEMENT_TOKEN, else the file named by
 * DISPATCH_CLOUD_MANAGEMENT_TOKEN_FILE, else the token `serve` on the embedded default wrote to
 * `<data dir>/management-token` (DISPATCH_CLOUD_DATA_DIR, default ./data). The token itself never goes on a
 * command line nor into a message.
 */
export async function findManagementToken(io: CliIo, tokenFile: string | undefined): Promise<string> {
  const fromEnv = io.env["DISPATCH_CLOUD_MANAGEMENT_TOKEN"];
  if (tokenFile === undefined && fromEnv !== undefined && fromEnv.trim() !== "") return fromEnv.trim();
  const file = tokenFile ?? io.env["DISPATCH_CLOUD_MANAGEMENT_TOKEN_FILE"];
  if (file === undefined || file === "") {
    const written = resolve(io.cwd, io.env["DISPATCH_CLOUD_DATA_DIR"] ?? "./data", "management-token");
    const text = await readFile(written, "utf8").then(
      (t) => t.trim(),
      () => "",
    );
    if (text !== "") return text;
  }
  if (file !== undefined && file !== "") {
    let text: string;
    try {
      text = (await readFile(resolve(io.cwd, file), "utf8")).trim();
    } catch (err) {
      throw new DispatchCloudError("cli.no_token", `cannot read token file ${file}`, { cause: err });
    }
    if (text !== "") return text;
    throw new DispatchCloudError("cli.no_token", `token file ${file} is empty`);
  }
  throw new DispatchCloudError(
    "cli.no_token",
    "no management token: set DISPATCH_CLOUD_MANAGEMENT_TOKEN, pass --token-file FILE (the value of management.token), or run where `serve` wrote data/management-token",
  );
}

/** A client of the management API; its errors come back as DispatchCloudError with the server's code. */
export class ManagementClient {
  constructor(
    readonly url: string,
    private readonly token: string,
    private readonly signal?: AbortSignal,
  ) {}

  async request<T>(method: string, path: string, query: Record<string, string> = {}): Promise<T> {
    const url = new URL(path, this.url.endsWith("/") ? this.url : `${this.url}/`);
    for (const [k, v] of Object.entries(query)) url.searchParams.set(k, v);
    let res: Response;
    try {
      res = await fetch(url, {
        method,
        headers: { authorization: `Bearer ${this.token}` },
        ...(this.signal === undefined ? {} : { signal: this.signal }),
      });
    } catch (err) {
      throw new DispatchCloudError(
        "cli.unreachable",
        `cannot reach the management API at ${this.url} (is the dispatcher running? --management-url or DISPATCH_CLOUD_MANAGEMENT_URL sets the address)`,
        { cause: err },
      );
    }
    const parsed = parseJsonBody(await res.text());
    if (res.ok) return parsed as T;
    throw responseError(res.status, parsed, url);
  }
}

/** A client for the URL and token the flags and environment name. */
export async function connectManagement(io: CliIo, flags: ManagementFlags): Promise<ManagementClient> {
  const url = flags["management-url"] ?? io.env["DISPATCH_CLOUD_MANAGEMENT_URL"] ?? DEFAULT_MANAGEMENT_URL;
  const token = await findManagementToken(io, flags["token-file"]);
  return new ManagementClient(url, token, io.signal);
}
