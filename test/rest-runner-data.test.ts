/**
 * The runner API's data routes (heartbeat, logs, outputs, dependencies, finish) and the users' logs and outputs
 * routes, on PostgreSQL and PGlite, with real files under a temporary data directory.
 */
import { mkdir, mkdtemp, readdir, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Readable } from "node:stream";
import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { extractTar, packTar } from "../lib/tar.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { type BundleManager, createBundleManager } from "../rest-server/bundle-manager.ts";
import { parseOutputPath } from "../rest-server/outputs.ts";
import { createRestServer } from "../rest-server/server.ts";
import { appendLogChunk, createUser, getBundle, recordHeartbeat } from "../store/queries.ts";
import { requeueStarting } from "../store/transitions.ts";
import { describeEachDb, startWithRunnerToken } from "./db.ts";
import { silentLogger as silent } from "./fixtures.ts";
import { injectClient, type Json } from "./rest-client.ts";

const CLUSTER = "zzzzz";
const MAX_OUTPUT = 64 * 1024;

const client = injectClient;

const BIN = { "content-type": "application/octet-stream" };
const TAR = { "content-type": "application/x-tar" };

/** A ustar header, for archives packTar would never write. */
function tarHeader(name: string, type: string, size: number, linkName = ""): Buffer {
  const b = Buffer.alloc(512);
  b.write(name, 0, 100, "utf8");
  b.write("0000644\0", 100, "ascii");
  b.write("0000000\0", 108, "ascii");
  b.write("0000000\0", 116, "ascii");
  b.write(`${size.toString(8).padStart(11, "0")}\0`, 124, "ascii");
  b.write("00000000000\0", 136, "ascii");
  b.write("        ", 148, "ascii");
  b.write(type, 156, "ascii");
  b.write(linkName, 157, 100, "utf8");
  b.write("ustar\0", 257, "ascii");
  b.write("00", 263, "ascii");
  let sum = 0;
  for (const byte of b) sum += byte;
  b.write(`${sum.toString(8).padStart(6, "0")}\0 `, 148, "ascii");
  return b;
}

function tarOf(entries: { name: string; type?: string; data?: string; link?: string }[]): Buffer {
  const parts: Buffer[] = [];
  for (const e of entries) {
    const data = Buffer.from(e.data ?? "");
    parts.push(tarHeader(e.name, e.type ?? "0", data.length, e.link ?? ""));
    if (data.length > 0) parts.push(data, Buffer.alloc((512 - (data.length % 512)) % 512));
  }
  parts.push(Buffer.alloc(1024));
  return Buffer.concat(parts);
}

async function streamToBuffer(s: Readable): Promise<Buffer> {
  const parts: Buffer[] = [];
  for await (const c of s) parts.push(c as Buffer);
  return Buffer.concat(parts);
}

describeEachDb("REST runner data", (getDb) => {
  let app: FastifyInstance;
  let api: ReturnType<typeof client>;
  let manager: BundleManager;
  let dataDir: string;
  let scratch: string;
  let alice: string;
  let bob: string;

  const newUser = async (name: string, isAdmin = false): Promise<string> => {
    const token = newUserToken();
    await createUser(getDb(), {
      uuid: newUserUuid(CLUSTER),
      name: `${name}-${Math.random().toString(36).slice(2)}`,
      isAdmin,
      tokenHash: hashToken(token),
    });
    return token;
  };
  const create = async (token: string, body: object = {}): Promise<Json> => {
    const res = await api("POST", "/api/v1/bundles", token, {
      command: ["echo", "hi"],
      image: "busybox",
      ...body,
    });
    expect(res.status, JSON.stringify(res.body)).toBe(201);
    return res.body;
  };
  /** Stages the bundle (dependencies permitting), moves it to starting, and returns its runner token. */
  const dispatch = async (uuid: string): Promise<string> => {
    await manager.runOnce();
    return (await startWithRunnerToken(getDb(), uuid)).token;
  };
  /** A bundle of alice's, running, and its runner token. */
  const running = async (owner = alice, body: object = {}): Promise<{ uuid: string; token: string }> => {
    const b = await create(owner, body);
    const token = await dispatch(b.uuid);
    expect((await api("POST", "/api/v1/runner/start", token, {})).status).toBe(200);
    return { uuid: b.uuid, token };
  };
  const log = (token: string, stream: string, offset: number | string, data: string | Buffer) =>
    api("POST", `/api/v1/runner/logs?stream=${stream}&offset=${offset}`, token, Buffer.from(data), BIN);
  const finish = async (token: string, body: object = { exitCode: 0 }) => {
    const res = await api("POST", "/api/v1/runner/finish", token, body);
    expect(res.status, JSON.stringify(res.body)).toBe(200);
    return res.body;
  };
  /** A tar archive of a fresh directory holding `files` (path -> content; a path ending in / is a directory). */
  const archive = async (files: Record<string, string>): Promise<Buffer> => {
    const dir = await mkdtemp(join(scratch, "src-"));
    for (const [p, content] of Object.entries(files)) {
      if (p.endsWith("/")) await mkdir(join(dir, p), { recursive: true });
      else {
        await mkdir(join(dir, p, ".."), { recursive: true });
        await writeFile(join(dir, p), content);
      }
    }
    return streamToBuffer(packTar(dir));
  };
  const upload = (token: string, tar: Buffer, headers: Record<string, string> = TAR) =>
    api("PUT", "/api/v1/runner/outputs", token, tar, headers);

  beforeAll(async () => {
    const db = getDb();
    dataDir = await mkdtemp(join(tmpdir(), "dc-rest-data-"));
    scratch = await mkdtemp(join(tmpdir(), "dc-rest-scratch-"));
    app = await createRestServer({
      db,
      logger: false,
      clusterId: CLUSTER,
      maxRequestBodySize: 64 * 1024,
      defaultMaxAttempts: 3,
      dataDir,
      maxOutputSize: MAX_OUTPUT,
      // Followers must be woken by NOTIFY: the fallback poll is far longer than any test.
      logPollInterval: 600_000,
    });
    api = client(app);
    manager = createBundleManager({ db, logger: silent });
    alice = await newUser("alice");
    bob = await newUser("bob");
  });
  afterAll(async () => {
    await app?.close();
    if (dataDir) await rm(dataDir, { recursive: true, force: true });
    if (scratch) await rm(scratch, { recursive: true, force: true });
  });

  describe("heartbeat", () => {
    it("stores resource usage and the time on the bundle without waking the dispatcher's queue", async () => {
      const b = await create(alice);
      const token = await dispatch(b.uuid);
      const before = await getBundle(getDb(), b.uuid);
      const early = await api("POST", "/api/v1/runner/heartbeat", token, {
        resourceUsage: { cpuSeconds: 0 },
      });
      expect(early).toMatchObject({ status: 200, body: { state: "starting" } });
      expect((await api("POST", "/api/v1/runner/start", token, {})).status).toBe(200);
      const afterStart = await getBundle(getDb(), b.uuid);
      const usage = { cpuSeconds: 2.5, memoryBytes: 1024, maxMemoryBytes: 4096, diskBytes: 0, gpuSeconds: 1 };
      const hb = await api("POST", "/api/v1/runner/heartbeat", token, { resourceUsage: usage });
      expect(hb).toEqual(expect.objectContaining({ status: 200, body: { state: "running" } }));
      const after = await getBundle(getDb(), b.uuid);
      expect(after?.resourceUsage).toEqual(usage);
      expect(after?.lastHeartbeatAt).toBeInstanceOf(Date);
      // Only a state change moves change_seq; heartbeats do not.
      expect(afterStart!.changeSeq).toBeGreaterThan(before!.changeSeq);
      expect(after?.changeSeq).toBe(afterStart?.changeSeq);
      const view = await api("GET", `/api/v1/bundles/${b.uuid}`, alice);
      expect(view.body.resourceUsage).toEqual(usage);
      expect(view.body.timings.lastHeartbeatAt).toBe(after?.lastHeartbeatAt?.toISOString());
      // finish without resourceUsage keeps the last heartbeat's.
      await finish(token, { exitCode: 0 });
      expect((await getBundle(getDb(), b.uuid))?.resourceUsage).toEqual(usage);
      const late = await api("POST", "/api/v1/runner/heartbeat", token, { resourceUsage: usage });
      expect(late).toMatchObject({ status: 401, body: { error: { code: "auth.invalid_token" } } });
    });

    it("shows the runner's status (an image pull) as the bundle's schedulingStatus until it clears it", async () => {
      const { uuid, token } = await running();
      const line = "pulling 127.0.0.1:5000/x/y:1: 3.1 of 8.4 MB";
      const hb = (status: string | null | undefined) =>
        api("POST", "/api/v1/runner/heartbeat", token, {
          resourceUsage: {},
          ...(status === undefined ? {} : { status }),
        });
      const seq = async () => (await getBundle(getDb(), uuid))?.changeSeq;
      const before = await seq();
      expect((await hb(line)).status).toBe(200);
      expect((await api("GET", `/api/v1/bundles/${uuid}`, alice)).body.schedulingStatus).toBe(line);
      // A new status is news for the dispatcher's queue (change_seq moves); the same status again, or none, is not.
      const afterStatus = await seq();
      expect(afterStatus).toBeGreaterThan(before as number);
      expect((await hb(line)).status).toBe(200);
      expect((await hb(undefined)).status).toBe(200);
      expect(await seq()).toBe(afterStatus);
      expect((await getBundle(getDb(), uuid))?.schedulingStatus).toBe(line);
      expect((await hb(null)).status).toBe(200);
      expect((await api("GET", `/api/v1/bundles/${uuid}`, alice)).body.schedulingStatus).toBeNull();
      const bad = await hb("pulling\nx");
      expect(bad).toMatchObject({ status: 400, body: { error: { path: "status" } } });
    });

    it("refuses bad bodies with the path of the bad field", async () => {
      const { token } = await running();
      const many = Object.fromEntries(Array.from({ length: 101 }, (_, i) => [`k${i}`, 1]));
      for (const [body, code, path] of [
        [{}, "request.invalid_body", "resourceUsage"],
        [{ resourceUsage: { cpuSeconds: -1 } }, "request.invalid_body", "resourceUsage.cpuSeconds"],
        [{ resourceUsage: { cpuSeconds: "1" } }, "request.invalid_body", "resourceUsage.cpuSeconds"],
        [{ resourceUsage: many }, "request.invalid_body", "resourceUsage"],
        [{ resourceUsage: {}, extra: 1 }, "request.unknown_field", "extra"],
      ] as const) {
        const res = await api("POST", "/api/v1/runner/heartbeat", token, body);
        expect(res, JSON.stringify(body)).toMatchObject({ status: 400, body: { error: { code, path } } });
      }
    });

    it("costs one statement when the token is current (a log chunk over 64 KiB two); a bad or stale token is refused as before", async () => {
      // The same routes on a Db that counts its statements.
      let statements: string[] = [];
      const db = getDb();
      const counting = new Proxy(db, {
        get(target, key) {
          const v = Reflect.get(target, key, target) as unknown;
          if (key === "query")
            return (sql: string, params?: readonly unknown[]) => {
              statements.push(typeof sql === "string" ? sql : String(sql));
              return db.query(sql, params);
            };
          return typeof v === "function" ? v.bind(target) : v;
        },
      });
      const counted = await createRestServer({
        db: counting,
        logger: false,
        clusterId: CLUSTER,
        maxRequestBodySize: 64 * 1024,
        defaultMaxAttempts: 3,
        dataDir,
        logPollInterval: 600_000,
      });
      try {
        const capi = client(counted);
        const { uuid, token } = await running();
        statements = [];
        const hb = await capi("POST", "/api/v1/runner/heartbeat", token, {
          resourceUsage: { cpuSeconds: 7 },
        });
        expect(hb).toMatchObject({ status: 200, body: { state: "running" } });
        expect(statements).toHaveLength(1);
        expect((await getBundle(db, uuid))?.resourceUsage).toEqual({ cpuSeconds: 7 });
        statements = [];
        const chunk = await capi(
          "POST",
          "/api/v1/runner/logs?stream=stdout&offset=0",
          token,
          Buffer.from("hi\n"),
          BIN,
        );
        expect(chunk).toMatchObject({ status: 200, body: { stored: 3 } });
        expect(statements).toHaveLength(1);
        // Past 64 KiB its token is looked up before its body is read (only a runner's upload may be slow), then
        // the chunk is stored in one statement.
        statements = [];
        const big = Buffer.alloc(64 * 1024 + 1, "x");
        const bigChunk = await capi("POST", "/api/v1/runner/logs?stream=stdout&offset=3", token, big, BIN);
        expect(bigChunk).toMatchObject({ status: 200, body: { stored: 3 + big.length } });
        expect(statements).toHaveLength(2);
        expect((await api("GET", `/api/v1/bundles/${uuid}/logs?stream=stdout`, alice)).body).toBe(
          `hi\n${big.toString()}`,
        );
        // A bad token is told so before a bad body or query; a malformed one costs no statement.
        const unknown = "dcr_" + "a".repeat(43);
        const invalidToken = { status: 401, body: { error: { code: "auth.invalid_token" } } };
        expect(await capi("POST", "/api/v1/runner/heartbeat", unknown, { resourceUsage: "x" })).toMatchObject(
          invalidToken,
        );
        for (const query of ["stream=stdin&offset=0", "stream=stdout&offset=-1"]) {
          const bad = await capi("POST", `/api/v1/runner/logs?${query}`, unknown, Buffer.from("x"), BIN);
          expect(bad).toMatchObject(invalidToken);
        }
        expect(
          await capi("POST", "/api/v1/runner/logs?stream=stdout&offset=0", unknown, Buffer.from("x"), BIN),
        ).toMatchObject(invalidToken);
        statements = [];
        expect(
          await capi("POST", "/api/v1/runner/heartbeat", "nonsense", { resourceUsage: {} }),
        ).toMatchObject({
          status: 401,
        });
        const malformed = await capi(
          "POST",
          "/api/v1/runner/logs?stream=stdout&offset=0",
          "nonsense",
          Buffer.from("x"),
          BIN,
        );
        expect(malformed.status).toBe(401);
        expect(statements).toHaveLength(0);
        // Tokens that are no longer current (a requeued attempt's, a finished bundle's): the refusal every
        // runner route gives them, and the bundle's heartbeat is left alone.
        const requeued = await running();
        const rq = await capi("POST", "/api/v1/runner/requeue", requeued.token, { reason: "disk full" });
        expect(rq.status, JSON.stringify(rq.body)).toBe(200);
        const finished = await running();
        await finish(finished.token, { exitCode: 0 });
        for (const stale of [requeued, finished]) {
          const spec = await capi("GET", "/api/v1/runner/spec", stale.token);
          expect(spec.status).toBeGreaterThanOrEqual(400);
          const late = await capi("POST", "/api/v1/runner/heartbeat", stale.token, {
            resourceUsage: { x: 1 },
          });
          expect(late).toEqual(expect.objectContaining({ status: spec.status, body: spec.body }));
          expect((await getBundle(db, stale.uuid))?.resourceUsage).not.toEqual({ x: 1 });
          const path = "/api/v1/runner/logs?stream=stderr&offset=0";
          for (const late of [Buffer.from("late\n"), Buffer.alloc(64 * 1024 + 1, "l")]) {
            const lateLog = await capi("POST", path, stale.token, late, BIN);
            expect(lateLog).toEqual(expect.objectContaining({ status: spec.status, body: spec.body }));
          }
        }
      } finally {
        await counted.close();
      }
    });

    it("is refused by the store for an attempt that is not current", async () => {
      const { uuid } = await running();
      expect(await recordHeartbeat(getDb(), uuid, 2, { cpuSeconds: 1 })).toBeNull();
      expect(await recordHeartbeat(getDb(), uuid, 1, { cpuSeconds: 1 })).toBe("running");
    });
  });

  describe("logs", () => {
    it("stores chunks once by offset: retries and overlaps are harmless, gaps are refused", async () => {
      const { uuid, token } = await running();
      expect(await log(token, "stdout", 0, "hello ")).toMatchObject({ status: 200, body: { stored: 6 } });
      expect(await log(token, "stdout", 0, "hello ")).toMatchObject({ status: 200, body: { stored: 6 } });
      expect(await log(token, "stdout", 3, "lo world")).toMatchObject({ status: 200, body: { stored: 11 } });
      expect(await log(token, "stdout", 6, "")).toMatchObject({ status: 200, body: { stored: 11 } });
      const gap = await log(token, "stdout", 20, "!");
      expect(gap).toMatchObject({ status: 409, body: { error: { code: "runner.log_gap", path: "offset" } } });
      expect(gap.body.error.message).toContain("expectedOffset 11");
      expect(await log(token, "stdout", 11, "\n")).toMatchObject({ status: 200, body: { stored: 12 } });
      expect(await log(token, "stderr", 0, "oops\n")).toMatchObject({ status: 200, body: { stored: 5 } });
      const binary = Buffer.from([0, 255, 10, 13, 0x80]);
      expect(await log(token, "stderr", 5, binary)).toMatchObject({ status: 200, body: { stored: 10 } });

      const out = await api("GET", `/api/v1/bundles/${uuid}/logs`, alice);
      expect(out.status).toBe(200);
      expect(out.headers["content-type"]).toBe("text/plain; charset=utf-8");
      expect(out.headers["x-dispatch-cloud-attempt"]).toBe("1");
      expect(out.raw.toString()).toBe("hello world\n");
      const err = await api("GET", `/api/v1/bundles/${uuid}/logs?stream=stderr&attempt=1`, alice);
      expect(err.raw).toEqual(Buffer.concat([Buffer.from("oops\n"), binary]));
      const none = await api("GET", `/api/v1/bundles/${uuid}/logs?attempt=2`, alice);
      expect(none).toMatchObject({ status: 200, raw: Buffer.alloc(0) });
      expect(await api("GET", `/api/v1/bundles/${uuid}/logs`, bob)).toMatchObject({
        status: 404,
        body: { error: { code: "bundle.not_found" } },
      });
      const { rows } = await getDb().query<{ n: number }>(
        "SELECT count(*)::int AS n FROM bundle_logs WHERE bundle_uuid = $1",
        [uuid],
      );
      expect(rows[0]?.n).toBe(5);
    });

    it("refuses bad stream names, offsets, media types and oversized chunks", async () => {
      const { uuid, token } = await running();
      for (const [query, path] of [
        ["stream=stdin&offset=0", "stream"],
        ["stream=stdout&offset=-1", "offset"],
        ["stream=stdout&offset=1.5", "offset"],
        ["stream=stdout&offset=x", "offset"],
        ["stream=stdout&offset=00", "offset"],
        ["stream=stdout&offset=99999999999999999999", "offset"],
        ["stream=stdout", "offset"],
        ["offset=0", "stream"],
        ["stream=stdout&offset=0&offset=1", "offset"],
        ["stream=stdout&offset=0&color=red", "color"],
      ]) {
        const res = await api("POST", `/api/v1/runner/logs?${query}`, token, Buffer.from("x"), BIN);
        expect(res, query).toMatchObject({
          status: 400,
          body: { error: { code: "request.invalid_query", path } },
        });
      }
      const json = await api("POST", "/api/v1/runner/logs?stream=stdout&offset=0", token, { x: 1 });
      expect(json).toMatchObject({
        status: 415,
        body: { error: { code: "request.unsupported_media_type" } },
      });
      const text = await api("POST", "/api/v1/runner/logs?stream=stdout&offset=0", token, "hi", {
        "content-type": "text/plain",
      });
      expect(text).toMatchObject({
        status: 415,
        body: { error: { code: "request.unsupported_media_type" } },
      });
      const big = await log(token, "stdout", 0, Buffer.alloc(2 ** 20 + 1, 97));
      expect(big).toMatchObject({ status: 413, body: { error: { code: "request.body_too_large" } } });
      // The same size streamed without a Content-Length is refused too.
      const streamed = await app.inject({
        method: "POST",
        url: "/api/v1/runner/logs?stream=stdout&offset=0",
        headers: { authorization: `Bearer ${token}`, ...BIN },
        payload: Readable.from([Buffer.alloc(2 ** 19, 97), Buffer.alloc(2 ** 19, 97), Buffer.from("a")]),
      });
      expect(streamed.statusCode).toBe(413);
      expect(streamed.json().error.code).toBe("request.body_too_large");
      expect(await log(token, "stdout", 0, Buffer.alloc(2 ** 20, 97))).toMatchObject({
        status: 200,
        body: { stored: 2 ** 20 },
      });
      for (const query of ["stream=stdin", "follow=2", "attempt=0", "attempt=x", "color=red"]) {
        const res = await api("GET", `/api/v1/bundles/${uuid}/logs?${query}`, alice);
        expect(res, query).toMatchObject({ status: 400, body: { error: { code: "request.invalid_query" } } });
      }
    });

    it("refuses other bundles' tokens, a finished, a killed and a requeued attempt's token", async () => {
      const a = await running();
      const b = await running(bob);
      expect((await log(b.token, "stdout", 0, "bob's")).status).toBe(200);
      expect((await api("GET", `/api/v1/bundles/${a.uuid}/logs`, alice)).raw.toString()).toBe("");
      expect((await api("GET", `/api/v1/bundles/${b.uuid}/logs`, bob)).raw.toString()).toBe("bob's");

      await finish(a.token, { exitCode: 1 });
      const afterFinish = await log(a.token, "stdout", 0, "late");
      expect(afterFinish).toMatchObject({ status: 401, body: { error: { code: "auth.invalid_token" } } });

      expect((await api("POST", `/api/v1/bundles/${b.uuid}/kill`, bob)).status).toBe(200);
      for (const res of [
        await log(b.token, "stdout", 5, "late"),
        await api("POST", "/api/v1/runner/heartbeat", b.token, { resourceUsage: {} }),
        await upload(b.token, await archive({ "x.txt": "x" })),
        await api("GET", "/api/v1/runner/dependencies/0", b.token),
        await api("POST", "/api/v1/runner/finish", b.token, { exitCode: 0 }),
      ]) {
        expect(res).toMatchObject({ status: 401, body: { error: { code: "auth.invalid_token" } } });
      }

      const c = await create(alice);
      const old = await dispatch(c.uuid);
      expect((await requeueStarting(getDb(), c.uuid, 1, { actor: "test", reason: "lost" })).ok).toBe(true);
      const fresh = await dispatch(c.uuid);
      expect((await log(old, "stdout", 0, "old")).status).toBe(401);
      expect((await log(fresh, "stdout", 0, "new")).status).toBe(200);
      // The store refuses an attempt that is not current, whatever the caller.
      await expect(
        appendLogChunk(getDb(), {
          uuid: c.uuid,
          attempt: 1,
          stream: "stdout",
          offset: 0,
          data: Buffer.from("x"),
        }),
      ).resolves.toMatchObject({
        ok: false,
        reason: "not_current",
        current: { state: "starting", attempt: 2 },
      });
      const view = await api("GET", `/api/v1/bundles/${c.uuid}/logs?attempt=2`, alice);
      expect(view.raw.toString()).toBe("new");
    });

    it("follows: chunks sent while the request is open arrive before the bundle ends, then the response ends", async () => {
      const address = await app.listen({ host: "127.0.0.1", port: 0 });
      const b = await create(alice);
      // Followed before it even starts: attempt 0 has no log, the follower moves on to attempt 1.
      const res = await fetch(`${address}/api/v1/bundles/${b.uuid}/logs?follow=1`, {
        headers: { authorization: `Bearer ${alice}` },
      });
      expect(res.status).toBe(200);
      const reader = res.body!.getReader();
      let got = "";
      const readUntil = async (want: string) => {
        while (!got.includes(want)) {
          const { value, done } = await reader.read();
          if (done)
            throw new Error(`stream ended with ${JSON.stringify(got)} before ${JSON.stringify(want)}`);
          got += Buffer.from(value).toString();
        }
      };
      const token = await dispatch(b.uuid);
      expect((await api("POST", "/api/v1/runner/start", token, {})).status).toBe(200);
      expect((await log(token, "stdout", 0, "one\n")).status).toBe(200);
      await readUntil("one\n");
      expect((await log(token, "stdout", 4, "two\n")).status).toBe(200);
      await readUntil("two\n");
      expect((await log(token, "stdout", 8, "three\n")).status).toBe(200);
      await finish(token, { exitCode: 0 });
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        got += Buffer.from(value).toString();
      }
      expect(got).toBe("one\ntwo\nthree\n");

      // A follower of a final bundle gets everything and the end at once.
      const again = await fetch(`${address}/api/v1/bundles/${b.uuid}/logs?follow=1`, {
        headers: { authorization: `Bearer ${alice}` },
      });
      expect(await again.text()).toBe("one\ntwo\nthree\n");
    });

    it("ends an open follower when the server closes", async () => {
      const other = await createRestServer({
        db: getDb(),
        logger: false,
        clusterId: CLUSTER,
        maxRequestBodySize: 1024,
        defaultMaxAttempts: 3,
        dataDir,
        logPollInterval: 600_000,
      });
      const { uuid, token } = await running();
      expect((await log(token, "stdout", 0, "partial")).status).toBe(200);
      const address = await other.listen({ host: "127.0.0.1", port: 0 });
      const res = await fetch(`${address}/api/v1/bundles/${uuid}/logs?follow=1`, {
        headers: { authorization: `Bearer ${alice}` },
      });
      const reader = res.body!.getReader();
      const first = await reader.read();
      expect(Buffer.from(first.value!).toString()).toBe("partial");
      await other.close();
      const rest = await reader.read().catch(() => ({ done: true }));
      expect(rest.done).toBe(true);
    });
  });

  describe("outputs", () => {
    it("round trip: upload, list, download, list a directory, replace", async () => {
      const { uuid, token } = await running();
      expect(await api("GET", `/api/v1/bundles/${uuid}/outputs`, alice)).toMatchObject({
        status: 200,
        body: { files: [] },
      });
      const tar = await archive({
        "result.txt": "42\n",
        "sub/deeper/b.bin": "\u0000\u0001binary",
        "sub/a.txt": "a",
        "empty/": "",
      });
      const up = await upload(token, tar);
      expect(up).toMatchObject({ status: 200, body: { files: 3, bytes: 3 + 8 + 1 } });
      const list = await api("GET", `/api/v1/bundles/${uuid}/outputs`, alice);
      expect(list).toMatchObject({
        status: 200,
        body: {
          files: [
            { path: "result.txt", size: 3 },
            { path: "sub/a.txt", size: 1 },
            { path: "sub/deeper/b.bin", size: 8 },
          ],
        },
      });
      const file = await api("GET", `/api/v1/bundles/${uuid}/outputs/sub/deeper/b.bin`, alice);
      expect(file.status).toBe(200);
      expect(file.headers["content-type"]).toBe("application/octet-stream");
      expect(file.raw).toEqual(Buffer.from("\u0000\u0001binary"));
      const sub = await api("GET", `/api/v1/bundles/${uuid}/outputs/sub/`, alice);
      expect(sub.body).toEqual({
        files: [
          { path: "sub/a.txt", size: 1 },
          { path: "sub/deeper/b.bin", size: 8 },
        ],
        nextCursor: null,
      });
      expect((await api("GET", `/api/v1/bundles/${uuid}/outputs/empty`, alice)).body).toEqual({
        files: [],
        nextCursor: null,
      });
      expect(await api("GET", `/api/v1/bundles/${uuid}/outputs/result.txt`, bob)).toMatchObject({
        status: 404,
        body: { error: { code: "bundle.not_found" } },
      });
      for (const missing of ["nope", "result.txt/x", "sub/nope.txt"]) {
        const res = await api("GET", `/api/v1/bundles/${uuid}/outputs/${missing}`, alice);
        expect(res, missing).toMatchObject({ status: 404, body: { error: { code: "output.not_found" } } });
      }

      // A second upload replaces the first as a whole; the old directory is gone from the disk.
      expect((await upload(token, await archive({ "new.txt": "new" }))).body).toEqual({ files: 1, bytes: 3 });
      expect((await api("GET", `/api/v1/bundles/${uuid}/outputs`, alice)).body).toEqual({
        files: [{ path: "new.txt", size: 3 }],
        nextCursor: null,
      });
      const onDisk = (await readdir(join(dataDir, "outputs"))).filter((n) => n.includes(uuid));
      expect(onDisk).toHaveLength(2); // the symlink and the one directory it names
      await finish(token);
      expect((await api("GET", `/api/v1/bundles/${uuid}/outputs/new.txt`, alice)).raw.toString()).toBe("new");
    });

    it("never serves a path outside the bundle's outputs", async () => {
      const { uuid, token } = await running();
      expect((await upload(token, await archive({ "a/b.txt": "b" }))).status).toBe(200);
      for (const path of [
        "a/..%2f..%2fx",
        "%2Fetc%2Fpasswd",
        "/etc/passwd",
        "a//b.txt",
        "a/b.txt%00",
        "a/%2e%2e%2fb.txt",
      ]) {
        const res = await api("GET", `/api/v1/bundles/${uuid}/outputs/${path}`, alice);
        expect(res.status, path).toBe(400);
        expect(res.body.error, path).toMatchObject({ code: "request.invalid_param", path: "path" });
      }
      // Dot segments that the URL parser resolves before routing land on other routes (or none): never a file.
      for (const path of [
        "%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "a/%2e%2e/%2e%2e/x",
        "a/../../x",
        "a/../../../../etc/passwd",
      ]) {
        const res = await api("GET", `/api/v1/bundles/${uuid}/outputs/${path}`, alice);
        expect(res.status, path).toBe(404);
        expect(res.body.error.code, path).toMatch(/^(request|output)\.not_found$/);
      }
      expect(parseOutputPath("a/b.txt")).toBe("a/b.txt");
      for (const raw of ["..", "a/..", "../a", "a/./b", ".", "/a", "a\u0000"]) {
        expect(() => parseOutputPath(raw), raw).toThrow(/path:/);
      }
    });

    it("refuses bad archives, oversized outputs and other media types, keeping the last good upload", async () => {
      const { uuid, token } = await running();
      expect((await upload(token, await archive({ "keep.txt": "keep" }))).status).toBe(200);
      const bad: [string, Buffer][] = [
        ["garbage", Buffer.from("this is not a tar archive at all".repeat(20))],
        ["dot-dot", tarOf([{ name: "../escape.txt", data: "x" }])],
        ["nested dot-dot", tarOf([{ name: "a/../../escape.txt", data: "x" }])],
        ["absolute", tarOf([{ name: "/tmp/escape.txt", data: "x" }])],
        ["symlink", tarOf([{ name: "link", type: "2", link: "/etc/passwd" }])],
        ["hard link", tarOf([{ name: "link", type: "1", link: "keep.txt" }])],
        ["device", tarOf([{ name: "dev", type: "3" }])],
        ["truncated", (await archive({ "f.txt": "y".repeat(2000) })).subarray(0, 1024)],
      ];
      for (const [what, tar] of bad) {
        const res = await upload(token, tar);
        expect(res.status, what).toBe(400);
        expect(res.body.error.code, what).toBe("runner.bad_archive");
      }
      const big = await upload(token, await archive({ "big.bin": "z".repeat(MAX_OUTPUT + 1) }));
      expect(big).toMatchObject({ status: 413, body: { error: { code: "runner.output_too_large" } } });
      const json = await api("PUT", "/api/v1/runner/outputs", token, { files: [] });
      expect(json).toMatchObject({
        status: 415,
        body: { error: { code: "request.unsupported_media_type" } },
      });
      const octet = await upload(token, await archive({ "x.txt": "x" }), BIN);
      expect(octet).toMatchObject({
        status: 415,
        body: { error: { code: "request.unsupported_media_type" } },
      });
      expect((await api("GET", `/api/v1/bundles/${uuid}/outputs`, alice)).body).toEqual({
        files: [{ path: "keep.txt", size: 4 }],
        nextCursor: null,
      });
      // Nothing is left behind by the refused uploads.
      const leftovers = (await readdir(join(dataDir, "outputs"))).filter((n) => n.includes(uuid));
      expect(leftovers).toHaveLength(2);
    });
  });

  describe("dependencies", () => {
    it("serves a ready dependency's outputs under its subpath as tar; refuses what it cannot serve", async () => {
      const dep = await running();
      expect(
        (
          await upload(
            dep.token,
            await archive({ "top.txt": "top", "sub/one.txt": "1", "sub/two/2.txt": "22" }),
          )
        ).status,
      ).toBe(200);
      await finish(dep.token);
      const bare = await running();
      await finish(bare.token);
      const failed = await running();
      await finish(failed.token, { exitCode: 3 });
      const user = await running(alice, {
        dependencies: [
          { bundle: dep.uuid, subpath: "sub", name: "sub" },
          { bundle: dep.uuid, name: "all" },
          { bundle: bare.uuid },
          { bundle: failed.uuid },
          { bundle: dep.uuid, subpath: "missing", name: "missing" },
          { bundle: dep.uuid, subpath: "top.txt", name: "file" },
        ],
        allowFailedDependencies: true,
      });
      const fetchDep = async (i: number): Promise<Record<string, string>> => {
        const res = await api("GET", `/api/v1/runner/dependencies/${i}`, user.token);
        expect(res.status, JSON.stringify(res.body)).toBe(200);
        expect(res.headers["content-type"]).toBe("application/x-tar");
        const dir = await mkdtemp(join(scratch, "dep-"));
        await extractTar(Readable.from([res.raw]), dir);
        const out: Record<string, string> = {};
        const walk = async (rel: string) => {
          for (const e of await readdir(join(dir, rel), { withFileTypes: true })) {
            const p = rel === "" ? e.name : `${rel}/${e.name}`;
            if (e.isDirectory()) await walk(p);
            else out[p] = await readFile(join(dir, p), "utf8");
          }
        };
        await walk("");
        return out;
      };
      expect(await fetchDep(0)).toEqual({ "one.txt": "1", "two/2.txt": "22" });
      expect(await fetchDep(1)).toEqual({ "top.txt": "top", "sub/one.txt": "1", "sub/two/2.txt": "22" });
      expect(await fetchDep(2)).toEqual({});
      expect(await fetchDep(5)).toEqual({ "top.txt": "top" });
      for (const i of ["3", "4", "6", "99"]) {
        const res = await api("GET", `/api/v1/runner/dependencies/${i}`, user.token);
        expect(res, i).toMatchObject({
          status: 404,
          body: { error: { code: "runner.dependency_unavailable", path: "index" } },
        });
      }
      for (const i of ["-1", "x", "1.0", "01"]) {
        const res = await api("GET", `/api/v1/runner/dependencies/${i}`, user.token);
        expect(res, i).toMatchObject({ status: 400, body: { error: { code: "request.invalid_param" } } });
      }
      // Another bundle's token reaches its own dependencies only (it has none).
      const stranger = await running(bob);
      expect((await api("GET", "/api/v1/runner/dependencies/0", stranger.token)).status).toBe(404);
      // No scratch directories of single-file archives are left behind.
      const entries = await readdir(join(dataDir, "outputs"));
      expect(entries.filter((n) => n.startsWith(".pack-"))).toEqual([]);
    });
  });

  describe("finish", () => {
    it("takes a null exit code, failed and reason", async () => {
      const cases: [object, string, number | null, string | null][] = [
        [{ exitCode: 0 }, "ready", 0, null],
        [{ exitCode: 0, reason: "note" }, "ready", 0, "note"],
        [{ exitCode: 0, failed: true, reason: "disk limit exceeded" }, "failed", 0, "disk limit exceeded"],
        [{ exitCode: 137, reason: "time limit exceeded" }, "failed", 137, "time limit exceeded"],
        [{ exitCode: null, reason: "image not found" }, "failed", null, "image not found"],
        [{ exitCode: null }, "failed", null, "the runner reported no exit code"],
        [{ exitCode: 2 }, "failed", 2, "exited with code 2"],
      ];
      for (const [body, state, exitCode, reason] of cases) {
        const { uuid, token } = await running();
        expect(await finish(token, body), JSON.stringify(body)).toMatchObject({ state, exitCode });
        expect((await getBundle(getDb(), uuid))?.stateReason, JSON.stringify(body)).toBe(reason);
      }
      const { token } = await running();
      for (const [body, code, path] of [
        [{}, "request.invalid_body", "exitCode"],
        [{ exitCode: -1 }, "request.invalid_body", "exitCode"],
        [{ exitCode: "0" }, "request.invalid_body", "exitCode"],
        [{ exitCode: 0, failed: "yes" }, "request.invalid_body", "failed"],
        [{ exitCode: 0, reason: 5 }, "request.invalid_body", "reason"],
        [{ exitCode: 0, signal: 9 }, "request.unknown_field", "signal"],
      ] as const) {
        const res = await api("POST", "/api/v1/runner/finish", token, body);
        expect(res, JSON.stringify(body)).toMatchObject({ status: 400, body: { error: { code, path } } });
      }
    });
  });
});
