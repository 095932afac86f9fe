import http from "node:http";
import type { AddressInfo } from "node:net";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createRunnerClient, isNotOurs, RunnerApiError } from "./api-client.ts";

const TOKEN = `dcr_${"s".repeat(43)}`;
let server: http.Server;
let url = "";
/** Answers queued per path; each request takes the next one. */
const answers = new Map<string, { status: number; body: unknown }[]>();
const seen: { path: string; auth: string | undefined; body: string }[] = [];

beforeAll(async () => {
  server = http.createServer((req, res) => {
    let body = "";
    req.on("data", (d: Buffer) => {
      body += d.toString();
    });
    req.on("end", () => {
      const path = (req.url ?? "").split("?")[0] as string;
      seen.push({ path, auth: req.headers.authorization, body });
      const next = answers.get(path)?.shift() ?? {
        status: 404,
        body: { error: { code: "request.not_found", message: "no" } },
      };
      res.writeHead(next.status, { "content-type": "application/json" }).end(JSON.stringify(next.body));
    });
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});
afterAll(() => new Promise<void>((r) => server.close(() => r())));

describe("runner API client", () => {
  it("retries 5xx answers and sends the bearer token", async () => {
    answers.set("/api/v1/runner/finish", [
      { status: 503, body: { error: { code: "internal.error", message: "restarting" } } },
      { status: 502, body: "bad gateway" },
      { status: 200, body: { state: "ready" } },
    ]);
    const client = createRunnerClient({ apiUrl: url, token: TOKEN });
    expect(await client.finish({ exitCode: 0 })).toEqual({ state: "ready" });
    const calls = seen.filter((s) => s.path === "/api/v1/runner/finish");
    expect(calls).toHaveLength(3);
    expect(calls.every((c) => c.auth === `Bearer ${TOKEN}`)).toBe(true);
    expect(JSON.parse(calls[0]?.body ?? "")).toEqual({ exitCode: 0 });
  });

  it("never retries a 4xx, and keeps the token out of the error", async () => {
    answers.set("/api/v1/runner/heartbeat", [
      {
        status: 409,
        body: { error: { code: "runner.not_current", message: "attempt 1 no longer owns it" } },
      },
    ]);
    const client = createRunnerClient({ apiUrl: url, token: TOKEN });
    const err = await client
      .heartbeat({ cpuSeconds: 1, memoryBytes: 2, maxMemoryBytes: 3, diskBytes: 4 })
      .catch((e) => e);
    expect(err).toBeInstanceOf(RunnerApiError);
    expect(err.code).toBe("runner.not_current");
    expect(isNotOurs(err)).toBe(true);
    expect(String(err.message)).not.toContain(TOKEN);
    expect(isNotOurs(new RunnerApiError(409, "runner.log_gap", "expectedOffset 5", "logs"))).toBe(false);
  });

  it("gives up on an unreachable server once the budget is spent", async () => {
    const client = createRunnerClient({ apiUrl: "http://127.0.0.1:1", token: TOKEN });
    const err = await client.start({ budgetMs: 300 }).catch((e) => e);
    expect(String(err.message)).toMatch(/start: .*ECONNREFUSED/);
    expect(String(err.message)).not.toContain(TOKEN);
  });
});
