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
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { parseStartDocument } from "../crunch-run/start-doc.ts";
import { routesOf } from "../lib/http-routes.ts";
import { newRunnerToken, newUserToken } from "../lib/tokens.ts";
import { VERSION } from "../lib/version.ts";
import type { CheckinRequest } from "../lib/worker-protocol.ts";
import { usersApiDocument } from "../rest-server/openapi.ts";
import { createRestServer } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";
import { getBundle } from "../store/queries.ts";
import { killBundle, requeueStarting, stageBundle, startBundleOnWorker } from "../store/transitions.ts";
import { WORKER_CHANNEL } from "../store/types.ts";
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

  it("documents every workers route in the OpenAPI document", () => {
    const paths = usersApiDocument()["paths"] as Record<string, Record<string, unknown>>;
    const routes = routesOf(apps[0]!).filter(
      (r) => r.url.startsWith("/api/v1/workers") && r.method !== "HEAD",
    );
    expect(routes.length).toBe(7);
    for (const r of routes) {
      const path = r.url.replace(/:([a-z]+)/g, "{$1}");
      expect(paths[path]?.[r.method.toLowerCase()], `${r.method} ${r.url}`).toBeDefined();
    }
  });

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

    it("gives parallel requests without a name distinct default names", async () => {
      const carol = await createTestUserWithToken(getDb());
      const made = await Promise.all(
        Array.from({ length: 4 }, () => api("POST", "/api/v1/workers", carol.token, {})),
      );
      expect(made.map((r) => r.status)).toEqual([201, 201, 201, 201]);
      expect(made.map((r) => r.body.worker.name).sort()).toEqual([
        "worker-1",
        "worker-2",
        "worker-3",
        "worker-4",
      ]);
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
      // crunch-run --detach takes it as it is.
      expect(parseStartDocument(JSON.stringify(run.startDocument), uuid)).toMatchObject({
        uuid,
        attempt: 1,
        runtimeEngine: "process",
        warmSupervisors: 0,
        registryAuth: [],
      });
      // Once: the next check-in (reporting it) gets nothing more.
      const again = await checkin(w, { running: [{ uuid, attempt: 1 }] });
      expect(again.body.messages).toEqual([]);
      // The runner token is the bundle's.
      const started = await api("POST", "/api/v1/runner/start", run.startDocument.token, {});
      expect(started.status, JSON.stringify(started.body)).toBe(200);
      expect((await getBundle(getDb(), uuid))?.state).toBe("running");
    });

    it("tells it to kill a bundle that was killed, or given back to the queue, and never hands those over", async () => {
      const alice = await createTestUserWithToken(getDb());
      const w = await newWorker(alice);
      const killed = await giveToWorker(alice.uuid, w.id);
      const requeued = await giveToWorker(alice.uuid, w.id);
      const first = await checkin(w);
      const runs = first.body.messages.filter((m: Json) => m.type === "run");
      expect(runs.map((m: Json) => m.uuid).sort()).toEqual([killed, requeued].sort());
      const token = runs.find((m: Json) => m.uuid === killed).startDocument.token;
      expect((await api("POST", "/api/v1/runner/start", token, {})).status).toBe(200);
      await killBundle(getDb(), killed, { actor: "test", reason: "test" });
      expect((await requeueStarting(getDb(), requeued, 1, { actor: "dispatcher", reason: "test" })).ok).toBe(
        true,
      );
      const res = await checkin(w, {
        running: [
          { uuid: killed, attempt: 1 },
          { uuid: requeued, attempt: 1 },
        ],
      });
      expect(res.status, JSON.stringify(res.body)).toBe(200);
      expect(res.body.messages).toEqual([
        { type: "kill", uuid: killed, attempt: 1, reason: "the bundle is killed" },
        { type: "kill", uuid: requeued, attempt: 1, reason: "given back to the queue" },
      ]);
      // A bundle it runs in its current attempt is not killed; an older attempt of it is.
      const current = await giveToWorker(alice.uuid, w.id);
      expect((await checkin(w)).body.messages).toMatchObject([{ type: "run", uuid: current }]);
      const ok = await checkin(w, { running: [{ uuid: current, attempt: 1 }] });
      expect(ok.body.messages).toEqual([]);
      const old = await checkin(w, { running: [{ uuid: current, attempt: 2 }] });
      expect(old.body.messages).toEqual([
        { type: "kill", uuid: current, attempt: 2, reason: "given back to the queue" },
      ]);
    });

    it("never hands it another user's bundle, even one given to it", async () => {
      const alice = await createTestUserWithToken(getDb());
      const bob = await createTestUserWithToken(getDb());
      const w = await newWorker(alice);
      const bobs = await giveToWorker(bob.uuid, w.id);
      const res = await checkin(w);
      expect(res.status).toBe(200);
      expect(res.body.messages).toEqual([]);
      expect(JSON.stringify(res.body)).not.toContain(bobs);
      expect((await getBundle(getDb(), bobs))?.state).toBe("starting");
    });

    it("tells a worker whose artifact differs to drain, and to upgrade once nothing runs on it", async () => {
      const alice = await createTestUserWithToken(getDb());
      const w = await newWorker(alice);
      const busy = await checkin(w, { artifactSha256: OLD_SHA, version: "0.0.9" });
      expect(busy.status).toBe(200);
      expect(busy.body.messages).toEqual([
        {
          type: "drain",
          reason: `version 0.0.9 (${OLD_SHA.slice(0, 12)}) differs from the server's ${VERSION} (${ARTIFACT_SHA.slice(0, 12)})`,
        },
        { type: "upgrade", sha256: ARTIFACT_SHA, bytes: ARTIFACT.length, version: VERSION },
      ]);
      expect((await rowOf(w.id)).state).toBe("draining");
      // Something still runs on it: drain, no upgrade yet.
      const uuid = await giveToWorker(alice.uuid, w.id);
      const withRun = await checkin(w, { artifactSha256: OLD_SHA });
      expect(withRun.body.messages.map((m: Json) => m.type)).toEqual(["run", "drain"]);
      const reporting = await checkin(w, { artifactSha256: OLD_SHA, running: [{ uuid, attempt: 1 }] });
      expect(reporting.body.messages.map((m: Json) => m.type)).toEqual(["drain"]);
      // The same artifact, or one run from sources (""): no drain, active again.
      expect((await checkin(w, { running: [{ uuid, attempt: 1 }] })).body.messages).toEqual([]);
      expect((await rowOf(w.id)).state).toBe("active");
      expect(
        (await checkin(w, { artifactSha256: "", running: [{ uuid, attempt: 1 }] })).body.messages,
      ).toEqual([]);
      // A worker that says it drains (it is stopping) is recorded so.
      await checkin(w, { draining: true, running: [{ uuid, attempt: 1 }] });
      expect((await rowOf(w.id)).state).toBe("draining");
    });

    it("serves the artifact with its digest; a server without one says workers.no_artifact and never drains", async () => {
      const alice = await createTestUserWithToken(getDb());
      const w = await newWorker(alice);
      const res = await api("GET", "/api/v1/workers/artifact", w.token);
      expect(res.status).toBe(200);
      expect(res.headers["x-artifact-sha256"]).toBe(ARTIFACT_SHA);
      expect(createHash("sha256").update(res.raw).digest("hex")).toBe(ARTIFACT_SHA);
      expectApiError(await api("GET", "/api/v1/workers/artifact", alice.token), 401, "auth.invalid_token");
      const { api: bare } = await server({ artifact: false });
      expectApiError(await bare("GET", "/api/v1/workers/artifact", w.token), 404, "workers.no_artifact");
      const c = await checkin(w, { artifactSha256: OLD_SHA }, bare);
      expect(c.body).toMatchObject({ artifactSha256: "", messages: [] });
    });

    it("keeps one LISTEN for all waiting check-ins, and answers them when the server closes", async () => {
      const listens: string[] = [];
      const db = getDb();
      const counting: Db = {
        kind: db.kind,
        query: (sql, params) => db.query(sql, params),
        transaction: (fn) => db.transaction(fn),
        listen: (channel, onPayload) => {
          listens.push(channel);
          return db.listen(channel, onPayload);
        },
        tryAdvisoryLock: (key) => db.tryAdvisoryLock(key),
        close: async () => {},
      };
      const app = await createRestServer({
        db: counting,
        logger: false,
        clusterId: CLUSTER,
        maxRequestBodySize: MiB,
        defaultMaxAttempts: 3,
        dataDir: join(dir, "data"),
        workers: { longPoll: 600_000 },
      });
      const long = injectClient(app);
      const alice = await createTestUserWithToken(getDb());
      const [w1, w2] = [await newWorker(alice), await newWorker(alice)];
      const waiting = [checkin(w1, {}, long), checkin(w1, {}, long), checkin(w2, {}, long)];
      await vi.waitFor(() => expect(app.workerWaiters.size).toBe(3), { timeout: 20_000 });
      // A NOTIFY for w2 answers w2's check-in only.
      const uuid = await giveToWorker(alice.uuid, w2.id);
      expect((await waiting[2])?.body.messages).toMatchObject([{ type: "run", uuid }]);
      await vi.waitFor(() => expect(app.workerWaiters.size).toBe(2), { timeout: 20_000 });
      await app.close();
      for (const res of await Promise.all(waiting.slice(0, 2))) {
        expect(res.status).toBe(200);
        expect(res.body.messages).toEqual([]);
      }
      expect(listens.filter((c) => c === WORKER_CHANNEL)).toHaveLength(1);
    });
  });

  describe("check-out", () => {
    it("stops the worker; with handBack its starting bundles are requeued and running ones lost", async () => {
      const alice = await createTestUserWithToken(getDb());
      const w = await newWorker(alice);
      const starting = await giveToWorker(alice.uuid, w.id);
      const running = await giveToWorker(alice.uuid, w.id);
      const runs = (await checkin(w)).body.messages;
      const token = runs.find((m: Json) => m.uuid === running).startDocument.token;
      expect((await api("POST", "/api/v1/runner/start", token, {})).status).toBe(200);
      expectApiError(
        await api("POST", "/api/v1/workers/checkout", w.token, { workerId: w.id, handBack: "yes" }),
        400,
        "request.invalid_body",
        "handBack",
      );
      const other = await newWorker(alice);
      expectApiError(
        await api("POST", "/api/v1/workers/checkout", w.token, { workerId: other.id }),
        403,
        "workers.wrong_worker",
        "workerId",
      );
      const res = await api("POST", "/api/v1/workers/checkout", w.token, { workerId: w.id, handBack: true });
      expect(res.status, JSON.stringify(res.body)).toBe(200);
      expect([...res.body.requeued].sort()).toEqual([starting, running].sort());
      for (const uuid of [starting, running]) {
        const b = await getBundle(getDb(), uuid);
        expect(b?.state).toBe("staged");
        expect(b?.workerId).toBeUndefined();
      }
      expect((await rowOf(w.id)).state).toBe("stopped");
      // Without handBack its bundles stay as they are.
      const w2 = await newWorker(alice);
      const kept = await giveToWorker(alice.uuid, w2.id);
      const out = await api("POST", "/api/v1/workers/checkout", w2.token, { workerId: w2.id });
      expect(out.body).toEqual({ requeued: [] });
      expect((await getBundle(getDb(), kept))?.state).toBe("starting");
      expect((await rowOf(w2.id)).state).toBe("stopped");
    });
  });

  describe("bad input: refused with a code and a path, nothing stored", () => {
    let alice: { uuid: string; token: string };
    let w: { id: string; token: string };
    let before: Awaited<ReturnType<typeof rowOf>>;
    beforeAll(async () => {
      alice = await createTestUserWithToken(getDb());
      w = await newWorker(alice);
      expect((await checkin(w)).status).toBe(200);
      before = await rowOf(w.id);
    });
    const unchanged = async () => expect(await rowOf(w.id)).toEqual(before);

    it("a worker token on users' routes and runner routes: workers.worker_token; a user token on a worker's: invalid", async () => {
      for (const [method, url, body] of [
        ["GET", "/api/v1/bundles", undefined],
        ["POST", "/api/v1/bundles", { command: ["true"], image: "busybox" }],
        ["GET", "/api/v1/workers", undefined],
        ["POST", "/api/v1/workers", {}],
        ["POST", `/api/v1/workers/${w.id}/disable`, undefined],
        ["POST", "/api/v1/tokens", {}],
        ["GET", "/api/v1/users/current", undefined],
        ["POST", "/api/v1/cas/find-missing", { digests: [] }],
        ["POST", "/api/v1/runner/start", {}],
        ["GET", "/api/v1/runner/spec", undefined],
      ] as const) {
        expectApiError(await api(method, url, w.token, body), 403, "workers.worker_token");
      }
      for (const token of [alice.token, newRunnerToken(), newUserToken(), "dcw_short"]) {
        expectApiError(
          await api("POST", "/api/v1/workers/checkin", token, checkinBody(w.id)),
          401,
          "auth.invalid_token",
        );
        expectApiError(
          await api("POST", "/api/v1/workers/checkout", token, { workerId: w.id }),
          401,
          "auth.invalid_token",
        );
      }
      expect((await api("POST", "/api/v1/workers/checkin", undefined, checkinBody(w.id))).status).toBe(401);
      await unchanged();
    });

    it.each([
      ["resources.vcpus", { vcpus: 0 }],
      ["resources.vcpus", { vcpus: 4097 }],
      ["resources.ram", { ram: 1024 }],
      ["resources.ram", { ram: 2 ** 53 }],
      ["resources.freeDisk", { freeDisk: -1 }],
      ["resources.gpu.deviceCount", { gpu: { stack: "cuda", deviceCount: 0, vram: GiB } }],
      ["resources.gpu.deviceCount", { gpu: { stack: "cuda", deviceCount: 65, vram: GiB } }],
      ["resources.gpu.vram", { gpu: { stack: "rocm", deviceCount: 1, vram: 0 } }],
    ])("forged resources (%s): workers.implausible_resources", async (path, over) => {
      const res = await checkin(w, { resources: { ...checkinBody(w.id).resources, ...over } as never });
      expectApiError(res, 400, "workers.implausible_resources", path);
      await unchanged();
    });

    it("forged slots and running counts: workers.implausible_resources", async () => {
      expectApiError(await checkin(w, { slots: 0 }), 400, "workers.implausible_resources", "slots");
      expectApiError(await checkin(w, { slots: 257 }), 400, "workers.implausible_resources", "slots");
      const many = Array.from({ length: 257 }, (_, i) => ({
        uuid: `zzzzz-bndl-${String(i).padStart(15, "0")}`,
        attempt: 1,
      }));
      expectApiError(await checkin(w, { running: many }), 400, "workers.implausible_resources", "running");
      await unchanged();
    });

    it("another worker's id: workers.wrong_worker", async () => {
      const bob = await createTestUserWithToken(getDb());
      const theirs = await newWorker(bob);
      const theirsBefore = await rowOf(theirs.id);
      expectApiError(
        await api("POST", "/api/v1/workers/checkin", w.token, checkinBody(theirs.id)),
        403,
        "workers.wrong_worker",
        "workerId",
      );
      await unchanged();
      expect(await rowOf(theirs.id)).toEqual(theirsBefore);
    });

    it("running naming another user's bundle, or none: the same workers.not_assigned", async () => {
      const mine = await giveToWorker(alice.uuid, w.id, false);
      const bob = await createTestUserWithToken(getDb());
      const bobs = await createTestBundle(getDb(), bob.uuid);
      const refusals = [];
      for (const other of [bobs.uuid, "zzzzz-bndl-000000000000000"]) {
        const res = await checkin(w, {
          running: [
            { uuid: mine, attempt: 1 },
            { uuid: other, attempt: 1 },
          ],
        });
        expectApiError(res, 403, "workers.not_assigned", "running[1].uuid");
        refusals.push(res.body.error.message.replace(other, "X"));
      }
      expect(refusals[0]).toBe(refusals[1]);
      await unchanged();
      // Nothing was handed over either.
      expect((await checkin(w)).body.messages).toMatchObject([{ type: "run", uuid: mine }]);
      before = await rowOf(w.id);
    });

    const body = (): Record<string, Json> => ({ ...checkinBody(w.id) });
    const malformed: [string, () => unknown, string, string | undefined][] = [
      ["a missing field", () => ({ ...body(), resources: undefined }), "request.invalid_body", "resources"],
      [
        "a missing nested field",
        () => ({ ...body(), resources: { vcpus: 1, ram: GiB, gpu: null } }),
        "request.invalid_body",
        "resources.freeDisk",
      ],
      ["a wrong type", () => ({ ...body(), slots: "2" }), "request.invalid_body", "slots"],
      [
        "a fraction",
        () => ({ ...body(), resources: { ...body().resources, vcpus: 1.5 } }),
        "request.invalid_body",
        "resources.vcpus",
      ],
      [
        "a wrong type deep down",
        () => ({ ...body(), running: [{ uuid: "zzzzz-bndl-000000000000000", attempt: "1" }] }),
        "request.invalid_body",
        "running[0].attempt",
      ],
      [
        "a malformed uuid",
        () => ({
          ...body(),
          running: [0, 1, 2, 3].map((i) => ({
            uuid: i === 3 ? "../etc" : `zzzzz-bndl-00000000000000${i}`,
            attempt: 1,
          })),
        }),
        "request.invalid_body",
        "running[3].uuid",
      ],
      ["an unknown field", () => ({ ...body(), extra: 1 }), "request.unknown_field", "extra"],
      [
        "an unknown nested field",
        () => ({ ...body(), resources: { ...body().resources, cores: 2 } }),
        "request.unknown_field",
        "resources.cores",
      ],
      ["a bad tag", () => ({ ...body(), tags: ["ok", "Not OK"] }), "request.invalid_body", "tags[1]"],
      [
        "too many tags",
        () => ({ ...body(), tags: Array.from({ length: 33 }, (_, i) => `t${i}`) }),
        "request.invalid_body",
        "tags",
      ],
      [
        "a huge cache",
        () => ({ ...body(), cache: Array.from({ length: 10_001 }, () => "0123456789abcdef") }),
        "request.invalid_body",
        "cache",
      ],
      [
        "a huge running list",
        () => ({
          ...body(),
          running: Array.from({ length: 10_001 }, () => ({ uuid: "zzzzz-bndl-000000000000000", attempt: 1 })),
        }),
        "request.invalid_body",
        "running",
      ],
      [
        "a bad artifact digest",
        () => ({ ...body(), artifactSha256: "abc" }),
        "request.invalid_body",
        "artifactSha256",
      ],
      ["a NUL in the version", () => ({ ...body(), version: "1\u0000" }), "request.invalid_body", "version"],
      ["no body", () => undefined, "request.invalid_body", "workerId"],
      ["an array", () => [body()], "request.invalid_body", undefined],
    ];
    it.each(malformed)("a malformed body (%s): its code and path", async (_what, make, code, path) => {
      const res = await api("POST", "/api/v1/workers/checkin", w.token, make() as never);
      expectApiError(res, 400, code, path);
      await unchanged();
    });

    it("not JSON: request.invalid_json", async () => {
      const res = await api("POST", "/api/v1/workers/checkin", w.token, "{not json", {
        "content-type": "application/json",
      });
      expectApiError(res, 400, "request.invalid_json");
      await unchanged();
    });
  });
});
