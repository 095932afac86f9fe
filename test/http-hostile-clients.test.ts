/**
 * Both HTTP servers against clients on real sockets: headers or a body that trickle in are cut off (408
 * request.timeout in the error shape while no answer was sent, else the connection just closes), an answer
 * sent before the body arrived closes the connection, a followed log outlives every timeout, a runner's
 * upload may outlast requestTimeout at restServer.minUploadRate, and what Node's HTTP parser and fastify refuse
 * (malformed HTTP, headers too large, a path that does not decode, too long a parameter, a request during
 * shutdown) is answered in the error shape. Nothing here measures time: each test waits for the connection
 * to end (or for bytes to arrive) and looks at what it got.
 */

import { mkdtemp, rm } from "node:fs/promises";
import http from "node:http";
import net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { Registry } from "prom-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { Config } from "../config/schema.ts";
import { ERROR_CODES } from "../lib/errors.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createManagementServer } from "../management-api/server.ts";
import { createRestServer, type RestServerOptions } from "../rest-server/server.ts";
import { createUser, getBundle, storedLogBytes } from "../store/queries.ts";
import { markRunning, stageBundle } from "../store/transitions.ts";
import { createTestBundle, describeEachDb, startWithRunnerToken } from "./db.ts";
import { stubConfig } from "./dispatcher-harness.ts";

const HEADERS_TIMEOUT = 300;
const REQUEST_TIMEOUT = 500;
/** Bytes per second: a runner's 100 bytes every 50 ms are far above it, a user's are not excused at all. */
const MIN_UPLOAD_RATE = 100;
const MGMT_TOKEN = "dcm-hostile-test-token-0123456789";

interface Response {
  status: number;
  headers: Record<string, string>;
  body: string;
}

/** The HTTP/1.1 responses in what a socket received, in order (bodies by Content-Length). */
function parseResponses(data: Buffer): Response[] {
  const out: Response[] = [];
  let rest = data;
  for (;;) {
    const end = rest.indexOf("\r\n\r\n");
    if (end < 0) return out;
    const [statusLine = "", ...lines] = rest.subarray(0, end).toString("latin1").split("\r\n");
    const headers: Record<string, string> = {};
    for (const line of lines) {
      const i = line.indexOf(":");
      headers[line.slice(0, i).trim().toLowerCase()] = line.slice(i + 1).trim();
    }
    const length = Number(headers["content-length"] ?? "0");
    out.push({
      status: Number(statusLine.split(" ")[1]),
      headers,
      body: rest.subarray(end + 4, end + 4 + length).toString("utf8"),
    });
    rest = rest.subarray(end + 4 + length);
  }
}

/**
 * Connects, writes `head`, then writes `trickle` every 50 ms (`times` times, or until the server closes), and
 * resolves with everything received once the connection has ended.
 */
function exchange(
  port: number,
  head: string,
  trickle?: { chunk: string; times?: number },
): Promise<{ responses: Response[]; writes: number }> {
  return new Promise((resolve) => {
    const socket = net.connect(port, "127.0.0.1");
    const received: Buffer[] = [];
    let writes = 0;
    let timer: NodeJS.Timeout | undefined;
    socket.on("data", (d) => received.push(d));
    // The server may reset a connection it closed while bytes were still coming: what arrived is the answer.
    socket.on("error", () => {});
    socket.on("close", () => {
      clearInterval(timer);
      resolve({ responses: parseResponses(Buffer.concat(received)), writes });
    });
    socket.write(head);
    if (trickle !== undefined) {
      timer = setInterval(() => {
        if (socket.destroyed || !socket.writable || writes === (trickle.times ?? Number.POSITIVE_INFINITY)) {
          clearInterval(timer);
          return;
        }
        writes++;
        socket.write(trickle.chunk);
      }, 50);
    }
  });
}

function expectError(r: Response | undefined, code: keyof typeof ERROR_CODES): void {
  expect(r?.status).toBe(ERROR_CODES[code].status);
  expect(r?.headers["content-type"]).toMatch(/^application\/json/);
  expect(JSON.parse(r?.body ?? "")).toEqual({ error: { code, message: expect.any(String) } });
}

async function listen(app: FastifyInstance): Promise<number> {
  await app.listen({ host: "127.0.0.1", port: 0 });
  return (app.server.address() as net.AddressInfo).port;
}

describeEachDb("hostile HTTP clients on real sockets", (getDb) => {
  describe("the REST server", () => {
    let app: FastifyInstance;
    let port: number;
    let dataDir: string;
    let alice: string;
    let aliceUuid: string;
    const options = (): RestServerOptions => ({
      db: getDb(),
      logger: false,
      clusterId: "zzzzz",
      maxRequestBodySize: 64 * 1024,
      defaultMaxAttempts: 3,
      dataDir,
      headersTimeout: HEADERS_TIMEOUT,
      requestTimeout: REQUEST_TIMEOUT,
      minUploadRate: MIN_UPLOAD_RATE,
      logPollInterval: 200,
    });
    /** A running bundle of alice's and its runner token. */
    const running = async () => {
      const db = getDb();
      const b = await createTestBundle(db, aliceUuid);
      await stageBundle(db, b.uuid, { actor: "test" });
      const { token, bundle } = await startWithRunnerToken(db, b.uuid);
      await markRunning(db, b.uuid, bundle.attempt, { actor: "test" });
      return { uuid: b.uuid, token };
    };

    beforeAll(async () => {
      dataDir = await mkdtemp(join(tmpdir(), "dc-hostile-"));
      alice = newUserToken();
      aliceUuid = newUserUuid("zzzzz");
      await createUser(getDb(), {
        uuid: aliceUuid,
        name: `alice-${Math.random()}`,
        isAdmin: false,
        tokenHash: hashToken(alice),
      });
      app = await createRestServer(options());
      port = await listen(app);
    });
    afterAll(async () => {
      await app?.close();
      if (dataDir !== undefined) await rm(dataDir, { recursive: true, force: true });
    });

    it("closes a connection whose headers trickle in, answering 408 request.timeout", async () => {
      const { responses } = await exchange(port, "GET /_health/ping HTTP/1.1\r\nHost: x\r\n", {
        chunk: "X-Slow: y\r\n",
      });
      expect(responses).toHaveLength(1);
      expectError(responses[0], "request.timeout");
    });

    it("closes a connection whose body trickles in, answering 408 request.timeout", async () => {
      const head =
        "POST /api/v1/bundles HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
        `Authorization: Bearer ${alice}\r\nContent-Length: 2000\r\n\r\n{`;
      // 100 bytes every 50 ms: the pace at which a runner's upload is let through below.
      const { responses, writes } = await exchange(port, head, { chunk: " ".repeat(100), times: 19 });
      expect(responses).toHaveLength(1);
      expectError(responses[0], "request.timeout");
      expect(writes).toBeLessThan(19);
    });

    it("closes the connection right after answering a request whose body has not arrived (401), with no 408 after", async () => {
      const head =
        "POST /api/v1/bundles HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{";
      const { responses } = await exchange(port, head, { chunk: " " });
      expect(responses).toHaveLength(1);
      expectError(responses[0], "auth.missing_token");
      expect(responses[0]?.headers["connection"]).toBe("close");
    });

    it("lets a runner's upload outlast requestTimeout while its bytes keep coming at minUploadRate", async () => {
      const { token } = await running();
      const head =
        "POST /api/v1/runner/logs?stream=stdout&offset=0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" +
        `Content-Type: application/octet-stream\r\nAuthorization: Bearer ${token}\r\nContent-Length: 2000\r\n\r\n`;
      // 20 writes 50 ms apart: at least 950 ms, well past requestTimeout (500 ms).
      const { responses, writes } = await exchange(port, head, { chunk: "y".repeat(100), times: 20 });
      expect(writes).toBe(20);
      expect(responses.map((r) => [r.status, r.body])).toEqual([[200, JSON.stringify({ stored: 2000 })]]);
    });

    it("holds a runner's heartbeat to requestTimeout: its body is small, only uploads may trickle", async () => {
      const { uuid, token } = await running();
      const head =
        "POST /api/v1/runner/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
        `Authorization: Bearer ${token}\r\nContent-Length: 2000\r\n\r\n{`;
      // The same pace as the upload above, which is let through.
      const { responses, writes } = await exchange(port, head, { chunk: " ".repeat(100), times: 19 });
      expect(responses).toHaveLength(1);
      expectError(responses[0], "request.timeout");
      expect(writes).toBeLessThan(19);
      expect((await getBundle(getDb(), uuid))?.lastHeartbeatAt).toBeNull();
    });

    it("holds a log chunk that arrives within requestTimeout at minUploadRate to requestTimeout", async () => {
      const { uuid, token } = await running();
      // requestTimeout 500 ms at 100 bytes/s: 50 bytes. Its token is checked with its body, so it is not let
      // through slowly: 42 bytes, 3 every 50 ms (about 700 ms), which a runner's upload would be allowed
      // (500 ms + 42 bytes at 100 bytes/s), is cut at 500 ms.
      const head =
        "POST /api/v1/runner/logs?stream=stdout&offset=0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" +
        `Content-Type: application/octet-stream\r\nAuthorization: Bearer ${token}\r\nContent-Length: 42\r\n\r\n`;
      const { responses, writes } = await exchange(port, head, { chunk: "yyy", times: 14 });
      expect(responses).toHaveLength(1);
      expectError(responses[0], "request.timeout");
      expect(writes).toBeLessThan(14);
      const attempt = (await getBundle(getDb(), uuid))?.attempt ?? -1;
      expect(await storedLogBytes(getDb(), uuid, attempt, "stdout")).toBe(0);
    });

    it("keeps a followed log open past every timeout and sends what the runner stores", async () => {
      const { uuid, token } = await running();
      const received: Buffer[] = [];
      let onData = () => {};
      const ended = new Promise<number>((resolve, reject) => {
        http
          .get(
            `http://127.0.0.1:${port}/api/v1/bundles/${uuid}/logs?follow=1`,
            { headers: { authorization: `Bearer ${alice}` } },
            (res) => {
              res.on("data", (d: Buffer) => {
                received.push(d);
                onData();
              });
              res.on("end", () => resolve(res.statusCode ?? 0));
              res.on("error", reject);
            },
          )
          .on("error", reject);
      });
      // A trickling request opened after the follower is cut off: more than requestTimeout has passed since.
      const slow = await exchange(
        port,
        `POST /api/v1/bundles HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer ${alice}\r\nContent-Length: 10\r\n\r\n{`,
      );
      expectError(slow.responses[0], "request.timeout");

      const arrived = new Promise<void>((resolve) => {
        onData = () => {
          if (Buffer.concat(received).toString() === "hello\n") resolve();
        };
      });
      const runner = { authorization: `Bearer ${token}` };
      const chunk = await app.inject({
        method: "POST",
        url: "/api/v1/runner/logs?stream=stdout&offset=0",
        headers: { ...runner, "content-type": "application/octet-stream" },
        payload: Buffer.from("hello\n"),
      });
      expect(chunk.statusCode).toBe(200);
      await arrived;
      const finish = await app.inject({
        method: "POST",
        url: "/api/v1/runner/finish",
        headers: runner,
        payload: { exitCode: 0 },
      });
      expect(finish.statusCode).toBe(200);
      expect(await ended).toBe(200);
      expect(Buffer.concat(received).toString()).toBe("hello\n");
    });

    it("answers malformed HTTP and oversized headers in the error shape, and closes", async () => {
      const malformed = await exchange(port, "BL@H / HTTP/1.1\r\nHost: x\r\n\r\n");
      expect(malformed.responses).toHaveLength(1);
      expectError(malformed.responses[0], "request.malformed_http");
      const big = await exchange(
        port,
        `GET /_health/ping HTTP/1.1\r\nHost: x\r\nX-Big: ${"a".repeat(20_000)}\r\n\r\n`,
      );
      expect(big.responses).toHaveLength(1);
      expectError(big.responses[0], "request.headers_too_large");
    });

    it("answers a path that does not decode and too long a parameter in the error shape", async () => {
      for (const [url, code] of [
        ["/api/v1/bundles/%ff", "request.invalid_url"],
        ["/api/v1/bundles/%E0%A4%A", "request.invalid_url"],
        [`/api/v1/bundles/${"a".repeat(101)}`, "request.uri_too_long"],
        [`/api/v1/bundles/${"a".repeat(101)}/outputs/x`, "request.uri_too_long"],
      ] as const) {
        const res = await app.inject({ url, headers: { authorization: `Bearer ${alice}` } });
        expect([url, res.statusCode, res.json()]).toEqual([
          url,
          ERROR_CODES[code].status,
          { error: { code, message: expect.any(String) } },
        ]);
      }
      const socket = await exchange(
        port,
        "GET /api/v1/bundles/%ff HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
      );
      expectError(socket.responses[0], "request.invalid_url");
    });

    it("answers 503 request.server_closing to a request that arrives while it shuts down", async () => {
      const closing = await createRestServer({ ...options(), requestTimeout: 60_000 });
      const closingPort = await listen(closing);
      const body = JSON.stringify({ command: ["true"], image: "busybox" });
      const socket = net.connect(closingPort, "127.0.0.1");
      socket.on("error", () => {});
      const received: Buffer[] = [];
      socket.on("data", (d) => received.push(d));
      const done = new Promise<void>((resolve) => socket.on("close", () => resolve()));
      const got = new Promise((resolve) => closing.server.once("request", resolve));
      socket.write(
        `POST /api/v1/bundles HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer ${alice}\r\n` +
          `Content-Length: ${body.length}\r\n\r\n${body.slice(0, 5)}`,
      );
      await got;
      const closed = closing.close();
      // server.close() runs after the preClose hooks: from then on the server is shutting down.
      while (closing.server.listening) await new Promise((r) => setImmediate(r));
      socket.write(`${body.slice(5)}GET /_health/ping HTTP/1.1\r\nHost: x\r\n\r\n`);
      await done;
      await closed;
      const [created, refused] = parseResponses(Buffer.concat(received));
      expect(created?.status).toBe(201);
      expectError(refused, "request.server_closing");
    });
  });

  describe("the management API", () => {
    let app: FastifyInstance;
    let port: number;
    const auth = `Authorization: Bearer ${MGMT_TOKEN}\r\n`;

    beforeAll(async () => {
      const c = stubConfig();
      const config = {
        ...c,
        management: {
          ...c.management,
          token: MGMT_TOKEN,
          headersTimeout: HEADERS_TIMEOUT,
          requestTimeout: REQUEST_TIMEOUT,
        },
      } as Config;
      app = await createManagementServer({
        config,
        dispatcher: { active: false, parts: null },
        db: getDb(),
        registry: new Registry(),
        logger: false,
        env: {},
      });
      port = await listen(app);
    });
    afterAll(async () => {
      await app?.close();
    });

    it("closes connections whose headers or body trickle in, answering 408 request.timeout", async () => {
      const headers = await exchange(port, `GET /_health/ping HTTP/1.1\r\nHost: x\r\n${auth}`, {
        chunk: "X-Slow: y\r\n",
      });
      expect(headers.responses).toHaveLength(1);
      expectError(headers.responses[0], "request.timeout");
      const body = await exchange(
        port,
        `POST /management/v1/bundles/kill?uuid=zzzzz-bndl-000000000000000 HTTP/1.1\r\nHost: x\r\n${auth}` +
          "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{",
        { chunk: " " },
      );
      expect(body.responses).toHaveLength(1);
      expectError(body.responses[0], "request.timeout");
    });

    it("closes the connection right after a 401 to a request whose body has not arrived", async () => {
      const { responses } = await exchange(
        port,
        "POST /management/v1/bundles/kill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{",
        { chunk: " " },
      );
      expect(responses).toHaveLength(1);
      expectError(responses[0], "auth.missing_token");
    });

    it("answers malformed HTTP, oversized headers, bad URL encoding and too long a parameter in the error shape", async () => {
      expectError((await exchange(port, "BL@H / HTTP/1.1\r\n\r\n")).responses[0], "request.malformed_http");
      expectError(
        (await exchange(port, `GET / HTTP/1.1\r\nHost: x\r\nX-Big: ${"a".repeat(20_000)}\r\n\r\n`))
          .responses[0],
        "request.headers_too_large",
      );
      for (const [url, code] of [
        ["/management/v1/bundles/%ff", "request.invalid_url"],
        [`/management/v1/bundles/${"b".repeat(101)}`, "request.uri_too_long"],
      ] as const) {
        const res = await app.inject({ url, headers: { authorization: `Bearer ${MGMT_TOKEN}` } });
        expect([url, res.statusCode, res.json().error.code]).toEqual([url, ERROR_CODES[code].status, code]);
      }
    });
  });
});
