/**
 * Users' own workers on the REST server (docs/workers.md, lib/worker-protocol.ts), through fastify.inject on
 * PostgreSQL and PGlite: worker tokens (made, listed, disabled), check-ins (recorded; a long poll woken by the
 * dispatcher's NOTIFY; a bundle handed over once with a runner token that works; kill, drain and upgrade
 * messages), check-out with hand-back, the artifact download, and every bad input refused with its code and
 * path with the worker's row unchanged.
 */
import { createHash } from "node:crypto";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { newRunnerToken, newUserToken } from "../lib/tokens.ts";
import { VERSION } from "../lib/version.ts";
import type { CheckinRequest } from "../lib/worker-protocol.ts";
import { createRestServer } from "../rest-server/server.ts";
import { getBundle } from "../store/queries.ts";
import { killBundle, markRunning, stageBundle, startBundleOnWorker } from "../store/transitions.ts";
import { getWorker, notifyWorkers } from "../store/worker-queries.ts";
import { createTestBundle, createTestUserWithToken, describeEachDb } from "./db.ts";
import { expectApiError, injectClient, type Json } from "./rest-client.ts";

const CLUSTER = "zzzzz";
const MiB = 2 ** 20;
const GiB = 2 ** 30;
/** The artifact the server offers in these tests. */
const ARTIFACT = Buffer.from("#!/bin/sh\necho the new runner\n");
const ARTIFACT_SHA = createHash("sha256").update(ARTIFACT).digest("hex");
const OLD_SHA = "0".repeat(64);

type Api = ReturnType<typeof injectClient>;

describeEachDb("REST workers", (getDb) => {
  let dir: string;
  const apps: FastifyInstance[] = [];
  const server = async (
    over: { longPoll?: number; artifact?: boolean } = {},
  ): Promise<{ app: FastifyInstance; api: Api }> => {
    const app = await createRestServer({
      db: getDb(),
      logger: false,
      clusterId: CLUSTER,
      maxRequestBodySize: 4 * MiB,
      defaultMaxAttempts: 3,
      dataDir: join(dir, "data"),
      workers: {
        longPoll: over.longPoll ?? 50,
        runtimeEngine: "process",
        artifact: over.artifact === false ? null : { sha256: ARTIFACT_SHA, content: ARTIFACT },
      },
    });
    apps.push(app);
    return { app, api: injectClient(app) };
  };
  let api: Api;

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "dc-rest-workers-"));
    ({ api } = await server());
  });
  afterAll(async () => {
    for (const app of apps) await app.close();
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  /** A worker of `user`, made through the API: its view and token. */
  const newWorker = async (
    user: { token: string },
    name?: string,
  ): Promise<{ id: string; token: string; view: Json }> => {
    const res = await api("POST", "/api/v1/workers", user.token, name === undefined ? {} : { name });
    expect(res.status, JSON.stringify(res.body)).toBe(201);
    return { id: res.body.worker.id, token: res.body.token, view: res.body.worker };
  };
  /** The worker's row without the age of its last check-in (which grows by itself). */
  const rowOf = async (id: string) => {
    const row = await getWorker(getDb(), id);
    if (row === null) throw new Error(`no worker ${id}`);
    const { checkinAgeMs: _, ...rest } = row;
    return rest;
  };
  const checkinBody = (id: string, over: Partial<CheckinRequest> = {}): CheckinRequest => ({
    workerId: id,
    version: VERSION,
    artifactSha256: ARTIFACT_SHA,
    resources: { vcpus: 4, ram: 8 * GiB, freeDisk: 100 * GiB, gpu: null },
    slots: 2,
    tags: ["gpu-less"],
    cache: ["0123456789abcdef"],
    running: [],
    draining: false,
    ...over,
  });
  const checkin = (w: { id: string; token: string }, over: Partial<CheckinRequest> = {}, client: Api = api) =>
    client("POST", "/api/v1/workers/checkin", w.token, checkinBody(w.id, over));
  /** A staged bundle of owner's given to the worker as the dispatcher does (startBundleOnWorker + NOTIFY). */
  const giveToWorker = async (owner: string, workerId: string, notify = true) => {
    const b = await createTestBundle(getDb(), owner);
    expect((await stageBundle(getDb(), b.uuid, { actor: "test" })).ok).toBe(true);
    const r = await startBundleOnWorker(getDb(), b.uuid, { workerId, gpuDevices: [], actor: "dispatcher" });
    expect(r.ok).toBe(true);
    if (notify) await notifyWorkers(getDb(), [workerId]);
    return b.uuid;
  };

  describe("worker tokens", () => {
    it("makes a worker and its token, shown once; lists the caller's own, everyone's only for an admin", async () => {
      const alice = await createTestUserWithToken(getDb());
      const bob = await createTestUserWithToken(getDb());
      const admin = await createTestUserWithToken(getDb(), { isAdmin: true });
      const a1 = await newWorker(alice);
      expect(a1.token).toMatch(/^dcw_[A-Za-z0-9_-]{43}$/);
      expect(a1.id).toMatch(/^zzzzz-wrkr-[a-z0-9]{15}$/);
      expect(a1.view).toMatchObject({
        ownerUuid: alice.uuid,
        name: "worker-1",
        state: "new",
        disabled: false,
      });
      const a2 = await newWorker(alice, "lab-server");
      expect(a2.view.name).toBe("lab-server");
      expectApiError(
        await api("POST", "/api/v1/workers", alice.token, { name: "lab-server" }),
        409,
        "workers.name_taken",
        "name",
      );
      expectApiError(
        await api("POST", "/api/v1/workers", alice.token, { name: "../x" }),
        400,
        "request.invalid_body",
        "name",
      );
      expectApiError(
        await api("POST", "/api/v1/workers", alice.token, { nme: "x" }),
        400,
        "request.unknown_field",
        "nme",
      );
      const b1 = await newWorker(bob);
      expect(b1.view.name).toBe("worker-1");

      const own = await api("GET", "/api/v1/workers", alice.token);
      expect(own.status).toBe(200);
      expect(own.body.items.map((w: Json) => w.id)).toEqual([a1.id, a2.id]);
      // Never the token, nor its hash.
      expect(JSON.stringify(own.body)).not.toContain(a1.token);
      expect(JSON.stringify(own.body)).not.toMatch(/token/i);
      expectApiError(await api("GET", "/api/v1/workers?all=true", alice.token), 403, "auth.forbidden");
      expectApiError(
        await api("GET", "/api/v1/workers?everyone=1", alice.token),
        400,
        "request.invalid_query",
        "everyone",
      );
      const all = await api("GET", "/api/v1/workers?all=true", admin.token);
      expect(all.body.items.map((w: Json) => w.id)).toEqual(expect.arrayContaining([a1.id, a2.id, b1.id]));
    });

    it("disables and enables (owner or admin; anyone else: not found); a disabled worker cannot check in", async () => {
      const alice = await createTestUserWithToken(getDb());
      const bob = await createTestUserWithToken(getDb());
      const admin = await createTestUserWithToken(getDb(), { isAdmin: true });
      const w = await newWorker(alice);
      expectApiError(
        await api("POST", `/api/v1/workers/${w.id}/disable`, bob.token),
        404,
        "workers.not_found",
        "id",
      );
      expectApiError(
        await api("POST", "/api/v1/workers/not-an-id/disable", alice.token),
        400,
        "request.invalid_param",
        "id",
      );
      const off = await api("POST", `/api/v1/workers/${w.id}/disable`, alice.token);
      expect(off.status).toBe(200);
      expect(off.body.disabled).toBe(true);
      const before = await rowOf(w.id);
      expectApiError(await checkin(w), 403, "workers.disabled");
      expect(await rowOf(w.id)).toEqual(before);
      const on = await api("POST", `/api/v1/workers/${w.id}/enable`, admin.token);
      expect(on.body.disabled).toBe(false);
      expect((await checkin(w)).status).toBe(200);
    });
  });

  describe("check-in", () => {
    it("records what the worker reports and answers with no message when there is none", async () => {
      const alice = await createTestUserWithToken(getDb());
      const w = await newWorker(alice);
      const res = await checkin(w);
      expect(res.status, JSON.stringify(res.body)).toBe(200);
      expect(res.body).toEqual({
        workerId: w.id,
        serverVersion: VERSION,
        artifactSha256: ARTIFACT_SHA,
        messages: [],
      });
      const row = await getWorker(getDb(), w.id);
      expect(row).toMatchObject({
        state: "active",
        tags: ["gpu-less"],
        resources: { vcpus: 4, ram: 8 * GiB, freeDisk: 100 * GiB, gpu: null },
        slots: 2,
        version: VERSION,
        artifactSha256: ARTIFACT_SHA,
        cache: ["0123456789abcdef"],
        running: [],
      });
      expect(row?.checkedInAt).not.toBeNull();
      const listed = await api("GET", "/api/v1/workers", alice.token);
      expect(listed.body.items[0]).toMatchObject({ id: w.id, state: "active", cachedTrees: 1, slots: 2 });
      expect(typeof listed.body.items[0].checkinAgeMs).toBe("number");
    });

    it("hands a bundle given to it over once, woken in its long poll; the runner token works on the runner routes", async () => {
      // A long poll far longer than any test: only the NOTIFY can end it in time.
      const { api: slow } = await server({ longPoll: 600_000 });
      const alice = await createTestUserWithToken(getDb());
      const w = await newWorker(alice);
      expect((await checkin(w)).status).toBe(200);
      const waiting = checkin(w, {}, slow);
      // Given while the check-in waits (or just before it registered: either way it answers with it).
      const uuid = await giveToWorker(alice.uuid, w.id);
      const res = await waiting;
      expect(res.status, JSON.stringify(res.body)).toBe(200);
      expect(res.body.messages).toHaveLength(1);
      const run = res.body.messages[0];
      expect(run).toMatchObject({ type: "run", uuid, attempt: 1 });
      expect(run.startDocument).toMatchObject({
        uuid,
        attempt: 1,
        instanceType: "worker",
        gpuDevices: [],
        runtimeEngine: "process",
        warmSupervisors: 0,
      });
      expect(run.startDocument.token).toMatch(/^dcr_/);
      expect(run.startDocument.apiUrl).toMatch(/^http:\/\//);
      expect(run.startDocument).not.toHaveProperty("registryAuth");
      // Once: the next check-in (reporting it) gets nothing more.
      const again = await checkin(w, { running: [{ uuid, attempt: 1 }] });
      expect(again.body.messages).toEqual([]);
      // The runner token is the bundle's.
      const started = await api("POST", "/api/v1/runner/start", run.startDocument.token, {});
      expect(started.status, JSON.stringify(started.body)).toBe(200);
      expect((await getBundle(getDb(), uuid))?.state).toBe("running");
    });
  });
});
