/**
 * A minimal Docker Engine API client over the daemon's unix socket (node:http; no docker CLI). DOCKER_HOST
 * `unix:///path` overrides /var/run/docker.sock. Only what crunch-run needs: JSON calls and raw streams.
 */
import http from "node:http";
import { DispatchCloudError } from "../lib/errors.ts";

export const DOCKER_API_VERSION = "v1.41";

export interface DockerResponse {
  status: number;
  body: Buffer;
}

export interface DockerClient {
  readonly socketPath: string;
  /** One call; the body (object -> JSON) is sent as is. Rejects with crunchrun.docker_error when unreachable. */
  call(method: string, path: string, body?: unknown, opts?: { timeoutMs?: number }): Promise<DockerResponse>;
  /** JSON of a 2xx answer; anything else -> DockerApiError carrying the status and the daemon's message. */
  json<T>(method: string, path: string, body?: unknown, opts?: { timeoutMs?: number }): Promise<T>;
  /** A streaming answer (logs, attach); the caller consumes the response. */
  stream(method: string, path: string, opts?: { signal?: AbortSignal }): Promise<http.IncomingMessage>;
}

/** The daemon answered with a non-2xx status. */
export class DockerApiError extends Error {
  constructor(
    readonly status: number,
    readonly daemonMessage: string,
    what: string,
  ) {
    super(`docker ${what}: ${status} ${daemonMessage}`);
    this.name = "DockerApiError";
  }
}

export function dockerSocketPath(env: NodeJS.ProcessEnv): string {
  const host = env["DOCKER_HOST"];
  if (host?.startsWith("unix://")) return host.slice("unix://".length);
  return "/var/run/docker.sock";
}

const unreachable = (socketPath: string, err: unknown) =>
  new DispatchCloudError(
    "crunchrun.docker_error",
    `cannot reach the Docker daemon at ${socketPath}: ${(err as Error).message}`,
    { cause: err },
  );

export function createDockerClient(env: NodeJS.ProcessEnv): DockerClient {
  const socketPath = dockerSocketPath(env);
  const agent = new http.Agent({ keepAlive: false });

  const send = (method: string, path: string, body: unknown, timeoutMs: number | undefined) =>
    new Promise<http.IncomingMessage>((resolve, reject) => {
      const payload = body === undefined ? undefined : Buffer.from(JSON.stringify(body));
      const req = http.request({
        socketPath,
        agent,
        method,
        path: `/${DOCKER_API_VERSION}${path}`,
        headers: {
          host: "docker",
          ...(payload === undefined
            ? {}
            : { "content-type": "application/json", "content-length": String(payload.length) }),
        },
      });
      if (timeoutMs !== undefined) {
        req.setTimeout(timeoutMs, () => req.destroy(new Error(`no answer within ${timeoutMs} ms`)));
      }
      req.on("error", (err) => reject(unreachable(socketPath, err)));
      req.on("response", resolve);
      req.end(payload);
    });

  const readAll = (res: http.IncomingMessage) =>
    new Promise<Buffer>((resolve, reject) => {
      const chunks: Buffer[] = [];
      res.on("data", (c: Buffer) => chunks.push(c));
      res.on("end", () => resolve(Buffer.concat(chunks)));
      res.on("error", (err) => reject(unreachable(socketPath, err)));
    });

  const client: DockerClient = {
    socketPath,
    async call(method, path, body, opts = {}) {
      const res = await send(method, path, body, opts.timeoutMs);
      return { status: res.statusCode ?? 0, body: await readAll(res) };
    },
    async json<T>(method: string, path: string, body?: unknown, opts: { timeoutMs?: number } = {}) {
      const res = await client.call(method, path, body, opts);
      if (res.status < 200 || res.status >= 300) {
        throw new DockerApiError(res.status, daemonMessage(res.body), `${method} ${path.split("?")[0]}`);
      }
      if (res.body.length === 0) return undefined as T;
      return JSON.parse(res.body.toString("utf8")) as T;
    },
    async stream(method, path, opts = {}) {
      const res = await send(method, path, undefined, undefined);
      if ((res.statusCode ?? 0) >= 300) {
        const body = await readAll(res);
        throw new DockerApiError(res.statusCode ?? 0, daemonMessage(body), `${method} ${path.split("?")[0]}`);
      }
      opts.signal?.addEventListener("abort", () => res.destroy(), { once: true });
      return res;
    },
  };
  return client;
}

function daemonMessage(body: Buffer): string {
  const text = body.toString("utf8");
  try {
    const parsed = JSON.parse(text) as { message?: unknown };
    if (typeof parsed.message === "string") return parsed.message;
  } catch {
    // not JSON
  }
  return text.trim().slice(0, 500);
}

/** Labels crunch-run puts on each container it creates. */
export const LABEL_BUNDLE = "dispatch-cloud.bundle";
export const LABEL_ATTEMPT = "dispatch-cloud.attempt";
export const LABEL_VM_ROOT = "dispatch-cloud.vm-root";

export interface ContainerSummary {
  Id: string;
  Names: string[];
  State: string;
  Labels: Record<string, string>;
}

/** Containers (running only unless all) of this instance root, optionally of one bundle. */
export function listBundleContainers(
  docker: DockerClient,
  root: string,
  opts: { uuid?: string; all?: boolean; timeoutMs?: number } = {},
): Promise<ContainerSummary[]> {
  const labels = [`${LABEL_VM_ROOT}=${root}`];
  if (opts.uuid !== undefined) labels.push(`${LABEL_BUNDLE}=${opts.uuid}`);
  const filters = encodeURIComponent(JSON.stringify({ label: labels }));
  return docker.json<ContainerSummary[]>(
    "GET",
    `/containers/json?all=${opts.all ? "true" : "false"}&filters=${filters}`,
    undefined,
    opts.timeoutMs === undefined ? {} : { timeoutMs: opts.timeoutMs },
  );
}
