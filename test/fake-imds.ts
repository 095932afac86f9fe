/**
 * A fake EC2 instance metadata service (IMDSv2) for many instances at once: instance X's endpoint is
 * `<url>/i/<X>`, under which `PUT /latest/api/token` (header `X-aws-ec2-metadata-token-ttl-seconds`, 1..21600)
 * hands out a session token and `GET /latest/meta-data/spot/instance-action` (header
 * `X-aws-ec2-metadata-token`) answers 404 until the test calls `interrupt(X)`, then 200 with
 * `{"action":"terminate","time":"..."}` as EC2 does. A GET without a valid token is 401, as on EC2 with IMDSv2
 * required. Every request is recorded.
 *
 * With `{ cloud: "azure" }` it is Azure's service instead: `GET /metadata/instance/compute` (header
 * `Metadata: true`, else 400) answers the VM's name, and `GET /metadata/scheduledevents` answers
 * `{DocumentIncarnation, Events}`, with a `Preempt` event for the VM once the test calls `interrupt(X)`; EC2's
 * paths answer 404 there.
 */
import { randomBytes } from "node:crypto";
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";

export interface ImdsRequest {
  instanceId: string;
  method: string;
  path: string;
  tokenValid: boolean;
}

export class FakeImds {
  readonly requests: ImdsRequest[] = [];
  readonly cloud: "ec2" | "azure";
  private incarnation = 1;

  constructor(opts: { cloud?: "ec2" | "azure" } = {}) {
    this.cloud = opts.cloud ?? "ec2";
  }
  private server: Server | undefined;
  private baseUrl = "";
  private readonly tokens = new Map<string, { instanceId: string; expires: number }>();
  private readonly notices = new Map<string, { action: string; time: string }>();

  /** The service's base URL (after start). */
  get url(): string {
    if (this.baseUrl === "") throw new Error("FakeImds: not started");
    return this.baseUrl;
  }

  async start(host = "127.0.0.1"): Promise<this> {
    const server = createServer((req, res) => this.handle(req, res));
    await new Promise<void>((ok, fail) => {
      server.once("error", fail);
      server.listen(0, host, () => ok());
    });
    this.server = server;
    this.baseUrl = `http://${host}:${(server.address() as AddressInfo).port}`;
    return this;
  }

  async stop(): Promise<void> {
    const s = this.server;
    this.server = undefined;
    if (s === undefined) return;
    s.closeAllConnections();
    await new Promise<void>((ok) => s.close(() => ok()));
  }

  /** The IMDS endpoint one instance must use (what crunch-run reads from its imds-endpoint file). */
  endpointFor(instanceId: string): string {
    return `${this.url}/i/${encodeURIComponent(instanceId)}`;
  }

  /**
   * From now on, instance `instanceId`'s spot/instance-action answers with a notice (Azure: its Scheduled Events
   * list a Preempt event, NotBefore as an HTTP date).
   */
  interrupt(
    instanceId: string,
    action: "terminate" | "stop" | "hibernate" = "terminate",
    inMs = this.cloud === "azure" ? 30_000 : 120_000,
  ): void {
    const at = new Date(Date.now() + inMs);
    const time = this.cloud === "azure" ? at.toUTCString() : at.toISOString().replace(/\.\d{3}Z$/, "Z");
    this.notices.set(instanceId, { action, time });
    this.incarnation++;
  }

  /** Whether `instanceId` has asked for its spot notice (with a valid token, or Azure's header) at least once. */
  polled(instanceId: string): boolean {
    return this.requests.some(
      (r) =>
        r.instanceId === instanceId &&
        r.tokenValid &&
        (r.path.endsWith("/spot/instance-action") || r.path.startsWith("/metadata/scheduledevents")),
    );
  }

  private handle(req: IncomingMessage, res: ServerResponse): void {
    req.resume();
    const [status, body] = this.answer(req, res);
    res.statusCode = status;
    res.end(body);
  }

  /** The status and body of one request (headers of a token answer are set on `res`). */
  private answer(req: IncomingMessage, res: ServerResponse): [number, string] {
    const m = /^\/i\/([^/]+)(\/.*)$/.exec(req.url ?? "");
    if (m === null) return [404, "not found"];
    const instanceId = decodeURIComponent(m[1]!);
    const path = m[2]!;
    const method = req.method ?? "GET";
    if (this.cloud === "azure") return this.azureAnswer(req, res, instanceId, path, method);
    if (method === "PUT" && path === "/latest/api/token") {
      const ttl = Number(req.headers["x-aws-ec2-metadata-token-ttl-seconds"]);
      this.requests.push({ instanceId, method, path, tokenValid: false });
      if (!Number.isInteger(ttl) || ttl < 1 || ttl > 21600) return [400, "bad ttl"];
      const token = randomBytes(24).toString("base64url");
      this.tokens.set(token, { instanceId, expires: Date.now() + ttl * 1000 });
      res.setHeader("X-aws-ec2-metadata-token-ttl-seconds", String(ttl));
      return [200, token];
    }
    const header = req.headers["x-aws-ec2-metadata-token"];
    const t = typeof header === "string" ? this.tokens.get(header) : undefined;
    const tokenValid = t !== undefined && t.instanceId === instanceId && t.expires > Date.now();
    this.requests.push({ instanceId, method, path, tokenValid });
    if (method !== "GET") return [405, "method not allowed"];
    if (!tokenValid) return [401, "unauthorized"];
    if (path === "/latest/meta-data/instance-id") return [200, instanceId];
    if (path === "/latest/meta-data/spot/instance-action") {
      const notice = this.notices.get(instanceId);
      if (notice === undefined) return [404, "not found"];
      res.setHeader("Content-Type", "text/plain");
      return [200, JSON.stringify(notice)];
    }
    return [404, "not found"];
  }

  private azureAnswer(
    req: IncomingMessage,
    res: ServerResponse,
    instanceId: string,
    path: string,
    method: string,
  ): [number, string] {
    const headerOk = req.headers["metadata"] === "true";
    this.requests.push({ instanceId, method, path, tokenValid: headerOk });
    const route = path.split("?")[0];
    if (route !== "/metadata/instance/compute" && route !== "/metadata/scheduledevents")
      return [404, "not found"];
    res.setHeader("Content-Type", "application/json; charset=utf-8");
    if (!headerOk)
      return [400, JSON.stringify({ error: "Bad request. Required metadata header not specified" })];
    if (method !== "GET") return [405, JSON.stringify({ error: "Method not allowed" })];
    if (route === "/metadata/instance/compute") {
      return [200, JSON.stringify({ name: instanceId, location: "westus2", priority: "Spot", vmSize: "x" })];
    }
    const notice = this.notices.get(instanceId);
    const events =
      notice === undefined
        ? []
        : [
            {
              EventId: "602d9444-d2cd-49c7-8624-8643e7171297",
              EventType: "Preempt",
              ResourceType: "VirtualMachine",
              Resources: [instanceId],
              EventStatus: "Scheduled",
              NotBefore: notice.time,
              Description: "",
              EventSource: "Platform",
              DurationInSeconds: -1,
            },
          ];
    return [200, JSON.stringify({ DocumentIncarnation: this.incarnation, Events: events })];
  }
}
