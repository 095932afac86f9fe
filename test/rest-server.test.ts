import { tmpdir } from "node:os";
import { join } from "node:path";
import { Writable } from "node:stream";
import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { createLogger } from "../lib/logger.ts";
import { hashToken, newRunnerToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { type BundleManager, createBundleManager } from "../rest-server/bundle-manager.ts";
import { createRestServer } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";
import { openDb } from "../store/db.ts";
import { migrate } from "../store/migrate.ts";
import { createUser, getBundle } from "../store/queries.ts";
import { finishBundle, markRunning, requeueStarting, stageBundle } from "../store/transitions.ts";
import { describeEachDb, startWithRunnerToken } from "./db.ts";
import { silentLogger as silent } from "./fixtures.ts";
import { injectClient, type Json } from "./rest-client.ts";

const CLUSTER = "zzzzz";
const BODY_LIMIT = 64 * 1024;

const client = injectClient;

/** An admin made directly in the database (how the CLI bootstraps the first one). */
async function makeAdmin(db: Db): Promise<string> {
  const token = newUserToken();
  await createUser(db, {
    uuid: newUserUuid(CLUSTER),
    name: `admin-${Math.random().toString(36).slice(2, 10)}`,
    isAdmin: true,
    tokenHash: hashToken(token),
  });
  return token;
}

const minimal = { command: ["echo", "hi"], image: "busybox" };

describeEachDb("REST server", (getDb) => {
  let app: FastifyInstance;
  let api: ReturnType<typeof client>;
  let manager: BundleManager;
  let admin: string;
  let alice: string;
  let bob: string;

  const newUser = async (name: string, isAdmin = false): Promise<string> => {
    const res = await api("POST", "/api/v1/users", admin, {
      name: `${name}-${Math.random().toString(36).slice(2)}`,
      isAdmin,
    });
    expect(res.status).toBe(201);
    return res.body.token;
  };
  const create = async (token: string, body: object = minimal): Promise<Json> => {
    const res = await api("POST", "/api/v1/bundles", token, body);
    expect(res.status, JSON.stringify(res.body)).toBe(201);
    return res.body;
  };
  /** Takes a created bundle with no pending dependencies to `starting` and returns its runner token. */
  const dispatch = async (uuid: string): Promise<string> => {
    await manager.runOnce();
    return (await startWithRunnerToken(getDb(), uuid)).token;
  };
  const finishAs = async (uuid: string, exitCode: number) => {
    const token = await dispatch(uuid);
    expect((await api("POST", "/api/v1/runner/start", token, {})).status).toBe(200);
    expect((await api("POST", "/api/v1/runner/finish", token, { exitCode })).status).toBe(200);
  };

  beforeAll(async () => {
    const db = getDb();
    app = await createRestServer({
      db,
      logger: false,
      clusterId: CLUSTER,
      maxRequestBodySize: BODY_LIMIT,
      defaultMaxAttempts: 3,
      // No outputs are uploaded here (test/rest-runner-data.test.ts does that): nothing is written there.
      dataDir: join(tmpdir(), "dispatch-cloud-rest-server-test"),
    });
    api = client(app);
    manager = createBundleManager({ db, logger: silent });
    admin = await makeAdmin(db);
    alice = await newUser("alice");
    bob = await newUser("bob");
  });
  afterAll(async () => {
    await app?.close();
  });

  it("answers the health check", async () => {
    expect(await api("GET", "/_health/ping").then((r) => ({ status: r.status, body: r.body }))).toEqual({
      status: 200,
      body: { health: "OK" },
    });
  });

  describe("users", () => {
    it("lets an admin create a user; the token is shown once and only its hash is stored", async () => {
      const res = await api("POST", "/api/v1/users", admin, { name: "carol" });
      expect(res.status).toBe(201);
      expect(res.body).toMatchObject({ name: "carol", isAdmin: false });
      expect(res.body.uuid).toMatch(/^zzzzz-user-[a-z0-9]{15}$/);
      const token: string = res.body.token;
      expect(token).toMatch(/^dcu_/);
      const me = await api("GET", "/api/v1/users/current", token);
      expect(me.body).toMatchObject({ uuid: res.body.uuid, name: "carol" });
      expect(me.body.token).toBeUndefined();
      const { rows } = await getDb().query(
        "SELECT * FROM users u LEFT JOIN api_tokens t ON t.user_uuid = u.uuid",
      );
      const dump = JSON.stringify(rows);
      expect(dump).not.toContain(token);
      expect(dump).not.toContain(token.slice(4));
      expect(dump).toContain(hashToken(token));
      expect((await api("POST", "/api/v1/users", admin, { name: "carol" })).body.error.code).toBe(
        "user.exists",
      );
    });

    it("refuses non-admins, missing, unknown and malformed tokens", async () => {
      const forbidden = await api("POST", "/api/v1/users", alice, { name: "mallory" });
      expect(forbidden).toMatchObject({ status: 403, body: { error: { code: "auth.forbidden" } } });
      const missing = await api("GET", "/api/v1/bundles");
      expect(missing).toMatchObject({ status: 401, body: { error: { code: "auth.missing_token" } } });
      for (const token of [newUserToken(), newRunnerToken(), "garbage", "dcu_short"]) {
        const res = await api("GET", "/api/v1/bundles", token);
        expect(res).toMatchObject({ status: 401, body: { error: { code: "auth.invalid_token" } } });
      }
      const basic = await api("GET", "/api/v1/bundles", undefined, undefined, {
        authorization: "Basic YTpi",
      });
      expect(basic).toMatchObject({ status: 401, body: { error: { code: "auth.missing_token" } } });
    });

    it("checks the new user's body", async () => {
      for (const [body, code, path] of [
        [{ name: "" }, "request.invalid_body", "name"],
        [{ name: "x", isAdmin: "yes" }, "request.invalid_body", "isAdmin"],
        [{ name: "x", role: "admin" }, "request.unknown_field", "role"],
      ] as const) {
        const res = await api("POST", "/api/v1/users", admin, body);
        expect(res).toMatchObject({ status: 400, body: { error: { code, path } } });
      }
    });
  });

  describe("bundles", () => {
    it("creates a bundle with defaults and shows it to its owner only", async () => {
      const b = await create(alice, { ...minimal, name: "first", resources: { ram: "1GiB" } });
      // Without dependencies it is staged by its own insert (docs/decisions.md).
      expect(b).toMatchObject({
        name: "first",
        state: "staged",
        attempt: 0,
        maxAttempts: 3,
        priority: 500,
        resources: { vcpus: 1, ram: 2 ** 30, scratch: 0, gpu: null },
        limits: { time: null, disk: null, network: false },
      });
      expect(b.uuid).toMatch(/^zzzzz-bndl-[a-z0-9]{15}$/);
      expect(b.timings.createdAt).toBe(b.createdAt);
      expect(JSON.stringify(b)).not.toMatch(/token/i);
      expect((await api("GET", `/api/v1/bundles/${b.uuid}`, alice)).body.uuid).toBe(b.uuid);
      for (const [method, path] of [
        ["GET", ""],
        ["POST", "/kill"],
        ["GET", "/events"],
      ] as const) {
        const res = await api(method, `/api/v1/bundles/${b.uuid}${path}`, bob);
        expect(res).toMatchObject({ status: 404, body: { error: { code: "bundle.not_found" } } });
      }
      const missing = await api("GET", "/api/v1/bundles/zzzzz-bndl-000000000000000", alice);
      expect(missing).toMatchObject({ status: 404, body: { error: { code: "bundle.not_found" } } });
      const malformed = await api("GET", "/api/v1/bundles/nope", alice);
      expect(malformed).toMatchObject({
        status: 400,
        body: { error: { code: "request.invalid_param", path: "uuid" } },
      });
    });

    it("refuses bad bodies with a code and the path of the bad field", async () => {
      const other = await create(bob);
      const cases: [unknown, string, string | undefined][] = [
        [{ ...minimal, extra: true }, "request.unknown_field", "extra"],
        [{ ...minimal, resources: { ram: "1GiB", gpus: 1 } }, "request.unknown_field", "resources.gpus"],
        [{ ...minimal, command: "echo hi" }, "request.invalid_body", "command"],
        [{ ...minimal, priority: "5" }, "request.invalid_body", "priority"],
        [{ ...minimal, priority: 2.5 }, "request.invalid_body", "priority"],
        [{ ...minimal, priority: -1 }, "request.invalid_body", "priority"],
        [{ ...minimal, resources: { vcpus: 1e300 } }, "request.invalid_body", "resources.vcpus"],
        [{ ...minimal, resources: { ram: 2 ** 60 } }, "request.invalid_body", "resources.ram"],
        [{ ...minimal, resources: { ram: -5 } }, "request.invalid_body", "resources.ram"],
        [{ ...minimal, resources: { ram: "4XB" } }, "request.invalid_body", "resources.ram"],
        [{ ...minimal, limits: { disk: "4XB" } }, "request.invalid_body", "limits.disk"],
        [{ ...minimal, maxAttempts: 11 }, "request.invalid_body", "maxAttempts"],
        [
          { ...minimal, dependencies: [{ bundle: "zzzzz-bndl-000000000000000" }] },
          "bundle.invalid_dependency",
          "dependencies[0].bundle",
        ],
        [
          { ...minimal, dependencies: [{ bundle: other.uuid }] },
          "bundle.invalid_dependency",
          "dependencies[0].bundle",
        ],
        [[], "request.invalid_body", undefined],
        ["just a string", "request.invalid_body", undefined],
      ];
      for (const [body, code, path] of cases) {
        const res = await api("POST", "/api/v1/bundles", alice, JSON.stringify(body), {
          "content-type": "application/json",
        });
        expect(res.status, JSON.stringify(body)).toBe(400);
        expect(res.body.error.code, JSON.stringify(body)).toBe(code);
        expect(res.body.error.path, JSON.stringify(body)).toBe(path);
        expect(res.body.error.message).toEqual(expect.any(String));
      }
    });

    it("refuses malformed JSON, other media types, missing bodies and oversized bodies", async () => {
      const json = { "content-type": "application/json" };
      const bad = await api("POST", "/api/v1/bundles", alice, '{"command": ["x"', json);
      expect(bad).toMatchObject({ status: 400, body: { error: { code: "request.invalid_json" } } });
      const text = await api("POST", "/api/v1/bundles", alice, "hello", { "content-type": "text/plain" });
      expect(text).toMatchObject({
        status: 415,
        body: { error: { code: "request.unsupported_media_type" } },
      });
      const none = await api("POST", "/api/v1/bundles", alice);
      expect(none).toMatchObject({ status: 400, body: { error: { code: "request.invalid_body" } } });
      const big = { ...minimal, env: { A: "x".repeat(BODY_LIMIT), B: "y" } };
      const tooLarge = await api("POST", "/api/v1/bundles", alice, big);
      expect(tooLarge).toMatchObject({ status: 413, body: { error: { code: "request.body_too_large" } } });
      const proto = await api("POST", "/api/v1/bundles", alice, '{"__proto__": {"x": 1}}', json);
      expect(proto).toMatchObject({ status: 400, body: { error: { code: "request.invalid_body" } } });
      const nul = await api("POST", "/api/v1/bundles", alice, { ...minimal, image: "a\u0000b" });
      expect(nul).toMatchObject({
        status: 400,
        body: { error: { code: "request.invalid_body", path: "image" } },
      });
    });

    it("refuses what no layer below may coerce or misread, with the field's path (issue 14)", async () => {
      const json = { "content-type": "application/json" };
      const cases: [string, string, string | undefined][] = [
        // Below the server's smallest resources: Docker would take a 0 as "no limit".
        [JSON.stringify({ ...minimal, resources: { ram: 0 } }), "request.invalid_body", "resources.ram"],
        [
          JSON.stringify({ ...minimal, resources: { vcpus: 1e-300 } }),
          "request.invalid_body",
          "resources.vcpus",
        ],
        // A lone surrogate escape: JSON.parse keeps it, UTF-8 cannot hold it.
        ['{"command":["x"],"image":"busybox\\ud800"}', "request.invalid_body", "image"],
        ['{"command":["x\\udc00"],"image":"busybox"}', "request.invalid_body", "command[0]"],
        // Control characters and line breaks where they make no sense.
        [
          JSON.stringify({ ...minimal, image: "busybox\nINFO forged log line" }),
          "request.invalid_body",
          "image",
        ],
        [JSON.stringify({ ...minimal, name: "a\u2028b" }), "request.invalid_body", "name"],
        [
          JSON.stringify({
            ...minimal,
            dependencies: [{ bundle: "zzzzz-bndl-000000000000000", subpath: "x".repeat(256) }],
          }),
          "request.invalid_body",
          "dependencies[0].subpath",
        ],
      ];
      for (const [body, code, path] of cases) {
        const res = await api("POST", "/api/v1/bundles", alice, body, json);
        expect([body.slice(0, 60), res.status, res.body.error?.code, res.body.error?.path]).toEqual([
          body.slice(0, 60),
          400,
          code,
          path,
        ]);
      }
      // Bytes that are not UTF-8 are refused, not decoded to U+FFFD.
      const latin1 = Buffer.from('{"command":["x"],"image":"caf\xe9"}', "latin1");
      const bytes = await api("POST", "/api/v1/bundles", alice, latin1, json);
      expect(bytes).toMatchObject({ status: 400, body: { error: { code: "request.invalid_json" } } });
      // Command and env values are the user's own bytes: kept as they are.
      const kept = await create(alice, { ...minimal, command: ["printf", "a\tb\n"], env: { X: "1\n2" } });
      expect([kept.command, kept.env]).toEqual([["printf", "a\tb\n"], { X: "1\n2" }]);
      const reason = await api("POST", `/api/v1/bundles/${kept.uuid}/kill`, alice, { reason: "a\nb" });
      expect(reason).toMatchObject({
        status: 400,
        body: { error: { code: "request.invalid_body", path: "reason" } },
      });
      // Query numbers and cursors within what PostgreSQL holds.
      const attempt = await api("GET", `/api/v1/bundles/${kept.uuid}/logs?attempt=2147483648`, alice);
      expect(attempt).toMatchObject({
        status: 400,
        body: { error: { code: "request.invalid_query", path: "attempt" } },
      });
      const far = Buffer.from(
        JSON.stringify({ createdAt: "+275760-09-13T00:00:00.000Z", uuid: kept.uuid }),
      ).toString("base64url");
      const cursor = await api("GET", `/api/v1/bundles?cursor=${far}`, alice);
      expect(cursor).toMatchObject({
        status: 400,
        body: { error: { code: "request.invalid_query", path: "cursor" } },
      });
      const long = await api("GET", `/api/v1/bundles/${kept.uuid}/outputs/${"n".repeat(256)}`, alice);
      expect(long).toMatchObject({
        status: 400,
        body: { error: { code: "request.invalid_param", path: "path" } },
      });
    });

    it("answers unknown routes with request.not_found", async () => {
      for (const [method, url] of [
        ["GET", "/nope"],
        ["DELETE", "/api/v1/bundles"],
        ["GET", "/api/v2/bundles"],
      ] as const) {
        const res = await api(method, url, alice);
        expect(res).toMatchObject({ status: 404, body: { error: { code: "request.not_found" } } });
      }
    });

    it("lists with a state filter and cursor pagination across pages", async () => {
      const carol = await newUser("lister");
      const made: string[] = [];
      for (let i = 0; i < 7; i++) made.push((await create(carol, { ...minimal, name: `b${i}` })).uuid);
      for (const uuid of made.slice(0, 2))
        expect((await api("POST", `/api/v1/bundles/${uuid}/kill`, carol)).status).toBe(200);

      const seen: string[] = [];
      let cursor: string | null = null;
      let pages = 0;
      do {
        const url: string = `/api/v1/bundles?limit=3${cursor === null ? "" : `&cursor=${cursor}`}`;
        const res = await api("GET", url, carol);
        expect(res.status).toBe(200);
        expect(res.body.items.length).toBeLessThanOrEqual(3);
        seen.push(...res.body.items.map((b: { uuid: string }) => b.uuid));
        cursor = res.body.nextCursor;
        pages++;
      } while (cursor !== null);
      expect(pages).toBe(3);
      expect(seen).toHaveLength(7);
      expect(new Set(seen)).toEqual(new Set(made));
      // Newest first: createdAt never increases along the list.
      const all = (await api("GET", "/api/v1/bundles", carol)).body.items as { createdAt: string }[];
      expect(all.map((b) => b.createdAt)).toEqual([...all.map((b) => b.createdAt)].sort().reverse());

      const killed = await api("GET", "/api/v1/bundles?state=killed", carol);
      expect(new Set(killed.body.items.map((b: { uuid: string }) => b.uuid))).toEqual(
        new Set(made.slice(0, 2)),
      );
      const two = await api("GET", "/api/v1/bundles?state=killed,staged&limit=500", carol);
      expect(two.body).toMatchObject({ nextCursor: null });
      expect(two.body.items).toHaveLength(7);
      expect(
        (await api("GET", "/api/v1/bundles", bob)).body.items.some((b: { uuid: string }) =>
          made.includes(b.uuid),
        ),
      ).toBe(false);

      for (const [query, path] of [
        ["limit=0", "limit"],
        ["limit=501", "limit"],
        ["limit=1.5", "limit"],
        ["limit=-1", "limit"],
        ["limit=99999999999999999999", "limit"],
        ["state=sleeping", "state"],
        ["cursor=!!!", "cursor"],
        [`cursor=${Buffer.from('{"createdAt":"x","uuid":"y"}').toString("base64url")}`, "cursor"],
        ["color=red", "color"],
      ]) {
        const res = await api("GET", `/api/v1/bundles?${query}`, carol);
        expect(res, query).toMatchObject({
          status: 400,
          body: { error: { code: "request.invalid_query", path } },
        });
      }
    });

    it("kills a bundle once, records the event, and refuses a second kill", async () => {
      const b = await create(alice);
      const res = await api("POST", `/api/v1/bundles/${b.uuid}/kill`, alice, { reason: "changed my mind" });
      expect(res).toMatchObject({ status: 200, body: { state: "killed", stateReason: "changed my mind" } });
      expect(res.body.timings.finishedAt).toEqual(expect.any(String));
      const again = await api("POST", `/api/v1/bundles/${b.uuid}/kill`, alice);
      expect(again).toMatchObject({ status: 409, body: { error: { code: "bundle.conflict" } } });
      const badBody = await api("POST", `/api/v1/bundles/${(await create(alice)).uuid}/kill`, alice, {
        why: 1,
      });
      expect(badBody).toMatchObject({
        status: 400,
        body: { error: { code: "request.unknown_field", path: "why" } },
      });

      const events = await api("GET", `/api/v1/bundles/${b.uuid}/events`, alice);
      expect(events.status).toBe(200);
      expect(events.body.items.map((e: { toState: string }) => e.toState)).toEqual([
        "created",
        "staged",
        "killed",
      ]);
      expect(events.body.items[2]).toMatchObject({ fromState: "staged", reason: "changed my mind" });
      expect(events.body.items[2].actor).toMatch(/^user:zzzzz-user-/);
    });
  });

  describe("runner API", () => {
    it("starts and finishes with the bundle's token, then refuses the token", async () => {
      const b = await create(alice, { ...minimal, env: { X: "1" } });
      const token = await dispatch(b.uuid);
      const spec = await api("GET", "/api/v1/runner/spec", token);
      expect(spec.body).toMatchObject({
        uuid: b.uuid,
        attempt: 1,
        command: minimal.command,
        env: { X: "1" },
      });
      const start = await api("POST", "/api/v1/runner/start", token, {});
      expect(start).toMatchObject({ status: 200, body: { uuid: b.uuid, state: "running", attempt: 1 } });
      // A retried start of the same attempt is not an error.
      expect((await api("POST", "/api/v1/runner/start", token)).status).toBe(200);
      const badFinish = await api("POST", "/api/v1/runner/finish", token, { exitCode: 256 });
      expect(badFinish).toMatchObject({
        status: 400,
        body: { error: { code: "request.invalid_body", path: "exitCode" } },
      });
      const finish = await api("POST", "/api/v1/runner/finish", token, {
        exitCode: 0,
        resourceUsage: { cpuSeconds: 1.5, maxRamBytes: 1024 },
      });
      expect(finish).toMatchObject({ status: 200, body: { state: "ready", exitCode: 0 } });
      const shown = await api("GET", `/api/v1/bundles/${b.uuid}`, alice);
      expect(shown.body).toMatchObject({ state: "ready", resourceUsage: { cpuSeconds: 1.5 } });
      for (const path of ["start", "finish"]) {
        const res = await api("POST", `/api/v1/runner/${path}`, token, { exitCode: 0 });
        expect(res).toMatchObject({ status: 401, body: { error: { code: "auth.invalid_token" } } });
      }
    });

    it("refuses other bundles' tokens, user tokens, and a requeued attempt's token", async () => {
      const b = await create(alice);
      const old = await dispatch(b.uuid);
      expect((await api("POST", "/api/v1/runner/start", alice, {})).body.error.code).toBe(
        "auth.invalid_token",
      );
      expect((await api("POST", "/api/v1/runner/start", newRunnerToken(), {})).body.error.code).toBe(
        "auth.invalid_token",
      );
      expect((await api("POST", "/api/v1/runner/start")).body.error.code).toBe("auth.missing_token");
      // The other bundle's token acts only on the other bundle.
      const other = await create(bob);
      const otherToken = await dispatch(other.uuid);
      expect((await api("POST", "/api/v1/runner/start", otherToken, {})).body.uuid).toBe(other.uuid);
      expect((await getBundle(getDb(), b.uuid))?.state).toBe("starting");

      expect((await requeueStarting(getDb(), b.uuid, 1, { actor: "dispatcher", reason: "test" })).ok).toBe(
        true,
      );
      const { token: fresh } = await startWithRunnerToken(getDb(), b.uuid, {
        instanceId: "i-2",
        gpuDevices: [0],
      });
      expect((await api("POST", "/api/v1/runner/start", old, {})).status).toBe(401);
      expect((await api("POST", "/api/v1/runner/start", fresh, {})).body).toMatchObject({
        state: "running",
        attempt: 2,
      });
      const extra = await api("POST", "/api/v1/runner/start", fresh, { hello: 1 });
      expect(extra).toMatchObject({
        status: 400,
        body: { error: { code: "request.unknown_field", path: "hello" } },
      });
    });

    it("starts several runners in one call, each by its own token, answering each as start would", async () => {
      const [a, b, c] = [await create(alice), await create(alice), await create(bob)];
      const [ta, tb, tc] = [await dispatch(a.uuid), await dispatch(b.uuid), await dispatch(c.uuid)];
      // c's runner has started already (a retried start is not an error); the user token and an unknown runner
      // token get start's 401.
      expect((await api("POST", "/api/v1/runner/start", tc, {})).status).toBe(200);
      const res = await api("POST", "/api/v1/runner/starts", undefined, {
        tokens: [tb, alice, ta, newRunnerToken(), tc],
      });
      expect(res.status).toBe(200);
      expect(res.body.items).toEqual([
        { uuid: b.uuid, state: "running", attempt: 1 },
        { status: 401, error: { code: "auth.invalid_token", message: expect.any(String) } },
        { uuid: a.uuid, state: "running", attempt: 1 },
        { status: 401, error: { code: "auth.invalid_token", message: expect.any(String) } },
        { uuid: c.uuid, state: "running", attempt: 1 },
      ]);
      for (const x of [a, b, c]) expect((await getBundle(getDb(), x.uuid))?.state).toBe("running");
      // Once finished, the token is refused here too.
      expect((await finishBundle(getDb(), a.uuid, 1, { exitCode: 0, actor: "runner" })).ok).toBe(true);
      const again = await api("POST", "/api/v1/runner/starts", undefined, { tokens: [ta] });
      expect(again.body.items).toEqual([
        { status: 401, error: { code: "auth.invalid_token", message: expect.any(String) } },
      ]);
      // Not a list of 1 to 64 tokens: 400 with the path of the bad field.
      for (const [body, path] of [
        [{}, "tokens"],
        [{ tokens: [] }, "tokens"],
        [{ tokens: Array.from({ length: 65 }, () => ta) }, "tokens"],
        [{ tokens: [ta, 7] }, "tokens[1]"],
        [{ tokens: [ta], more: 1 }, "more"],
        [{ tokens: [ta, "x".repeat(201)] }, "tokens[1]"],
      ] as const) {
        const bad = await api("POST", "/api/v1/runner/starts", undefined, body);
        expect(bad.status, JSON.stringify(body).slice(0, 80)).toBe(400);
        expect(bad.body.error.path).toBe(path);
        // The message names the field, never a token given.
        expect(JSON.stringify(bad.body)).not.toContain(ta);
      }
      // A body past the route's 64 KiB is refused before it is read as JSON.
      const huge = await api("POST", "/api/v1/runner/starts", undefined, { tokens: ["y".repeat(70_000)] });
      expect(huge).toMatchObject({ status: 413, body: { error: { code: "request.body_too_large" } } });
    });

    it("refuses start after the bundle was killed", async () => {
      const b = await create(alice);
      const token = await dispatch(b.uuid);
      expect((await api("POST", `/api/v1/bundles/${b.uuid}/kill`, alice)).status).toBe(200);
      const res = await api("POST", "/api/v1/runner/start", token, {});
      expect(res.status).toBe(401);
      expect((await getBundle(getDb(), b.uuid))?.state).toBe("killed");
    });

    it("reports runner.not_current when a start loses the race", async () => {
      const b = await create(alice);
      const token = await dispatch(b.uuid);
      expect((await api("POST", "/api/v1/runner/start", token, {})).status).toBe(200);
      // finish with the store directly (as if a second runner of this attempt finished), then finish again.
      expect((await finishBundle(getDb(), b.uuid, 1, { exitCode: 3, actor: "runner" })).ok).toBe(true);
      expect((await api("POST", "/api/v1/runner/finish", token, { exitCode: 0 })).status).toBe(401);
    });
  });

  describe("bundle manager", () => {
    it("stages a bundle whose dependencies are ready, fails one whose dependency failed", async () => {
      const dep = await create(alice);
      const child = await create(alice, { ...minimal, dependencies: [{ bundle: dep.uuid, name: "in" }] });
      await manager.runOnce();
      expect((await getBundle(getDb(), child.uuid))?.state).toBe("created");
      await finishAs(dep.uuid, 0);
      await manager.runOnce();
      expect((await getBundle(getDb(), child.uuid))?.state).toBe("staged");

      const bad = await create(alice);
      const strict = await create(alice, { ...minimal, dependencies: [{ bundle: bad.uuid }] });
      const lenient = await create(alice, {
        ...minimal,
        dependencies: [{ bundle: bad.uuid }],
        allowFailedDependencies: true,
      });
      await finishAs(bad.uuid, 1);
      await manager.runOnce();
      const s = await getBundle(getDb(), strict.uuid);
      expect(s?.state).toBe("failed");
      expect(s?.stateReason).toBe(`dependency ${bad.uuid} is failed`);
      expect((await getBundle(getDb(), lenient.uuid))?.state).toBe("staged");

      const gone = await create(alice);
      const afterKill = await create(alice, { ...minimal, dependencies: [{ bundle: gone.uuid }] });
      await api("POST", `/api/v1/bundles/${gone.uuid}/kill`, alice);
      expect(await manager.runOnce()).toBeGreaterThanOrEqual(1);
      expect((await getBundle(getDb(), afterKill.uuid))?.stateReason).toBe(
        `dependency ${gone.uuid} is killed`,
      );
    });

    it("wakes on NOTIFY when started (the poll interval is only a fallback)", async () => {
      const live = createBundleManager({ db: getDb(), logger: silent, pollInterval: 3_600_000 });
      await live.start();
      try {
        const dep = await create(alice);
        const child = await create(alice, { ...minimal, dependencies: [{ bundle: dep.uuid }] });
        expect([dep.state, child.state]).toEqual(["staged", "created"]);
        await api("POST", `/api/v1/bundles/${dep.uuid}/kill`, alice);
        await vi.waitFor(async () => expect((await getBundle(getDb(), child.uuid))?.state).toBe("failed"));
      } finally {
        await live.stop();
      }
    });

    it("moves on past a bundle it cannot move", async () => {
      const dep = await create(alice);
      const b = await create(alice, { ...minimal, dependencies: [{ bundle: dep.uuid }] });
      // Staged behind the manager's back: its transition loses, and the pass goes on without throwing.
      expect((await stageBundle(getDb(), b.uuid, { actor: "test" })).ok).toBe(true);
      await expect(manager.runOnce()).resolves.toEqual(expect.any(Number));
      await expect(markRunning(getDb(), b.uuid, 1, { actor: "test" })).resolves.toMatchObject({ ok: false });
    });
  });

  it("never answers 500 to ~200 garbage bodies", async () => {
    let seed = 12345;
    const rand = () => {
      seed = (seed * 1103515245 + 12345) % 2 ** 31;
      return seed / 2 ** 31;
    };
    const pick = <T>(xs: readonly T[]): T => xs[Math.floor(rand() * xs.length)]!;
    const keys = [
      "command",
      "image",
      "resources",
      "ram",
      "vcpus",
      "gpu",
      "env",
      "limits",
      "dependencies",
      "bundle",
      "subpath",
      "name",
      "priority",
      "maxAttempts",
      "__proto__",
      "constructor",
      "x",
      "",
    ];
    const junk = (depth: number): unknown => {
      const r = rand();
      if (depth > 4 || r < 0.3) {
        return pick([
          null,
          true,
          false,
          0,
          -1,
          1.5,
          1e300,
          -1e300,
          2 ** 60,
          "",
          "4XB",
          "1GiB",
          "x".repeat(5000),
          "\u0000",
          "zzzzz-bndl-000000000000000",
          "../..",
          "/etc",
          "\ud800",
          65,
          "10s",
        ]);
      }
      if (r < 0.55) return Array.from({ length: Math.floor(rand() * 4) }, () => junk(depth + 1));
      const o: Record<string, unknown> = {};
      for (let i = Math.floor(rand() * 5); i > 0; i--) o[pick(keys)] = junk(depth + 1);
      return o;
    };
    const bodies: string[] = [];
    for (let i = 0; i < 120; i++) bodies.push(JSON.stringify(junk(0)) ?? "null");
    for (let i = 0; i < 50; i++) {
      const o: Record<string, unknown> = { ...minimal };
      for (let k = 1 + Math.floor(rand() * 3); k > 0; k--) o[pick(keys)] = junk(1);
      bodies.push(JSON.stringify(o));
    }
    bodies.push(
      "[".repeat(10_000) + "]".repeat(10_000),
      "{".repeat(5000),
      "nul",
      "\u0000",
      "1e99999",
      '"\\ud800"',
    );
    for (let i = 0; i < 24; i++) {
      bodies.push(
        Array.from({ length: 1 + Math.floor(rand() * 50) }, () => String.fromCharCode(rand() * 256)).join(""),
      );
    }
    expect(bodies.length).toBeGreaterThanOrEqual(200);
    for (const body of bodies) {
      const res = await api("POST", "/api/v1/bundles", alice, body, { "content-type": "application/json" });
      expect(res.status, body.slice(0, 200)).toBeLessThan(500);
      expect(res.status === 201 || typeof res.body.error?.code === "string", body.slice(0, 200)).toBe(true);
    }
  });
});

describe("REST server failures and logs", () => {
  it("answers internal.error with a generic message, logs the details, and never logs tokens", async () => {
    const lines: string[] = [];
    const sink = new Writable({
      write(chunk: Buffer, _enc, done) {
        lines.push(chunk.toString("utf8"));
        done();
      },
    });
    const logger = createLogger({ level: "trace", format: "json", destination: sink });
    const db = await openDb("pglite:memory:");
    await migrate(db);
    const token = newUserToken();
    await createUser(db, {
      uuid: newUserUuid(CLUSTER),
      name: "admin",
      isAdmin: true,
      tokenHash: hashToken(token),
    });
    const app = await createRestServer({
      db,
      logger,
      clusterId: CLUSTER,
      maxRequestBodySize: BODY_LIMIT,
      defaultMaxAttempts: 3,
      dataDir: join(tmpdir(), "dispatch-cloud-rest-server-test"),
    });
    const api = client(app);
    try {
      expect((await api("POST", "/api/v1/bundles", token, minimal)).status).toBe(201);
      expect((await api("POST", "/api/v1/bundles", token, { nope: 1 })).status).toBe(400);
      const runner = newRunnerToken();
      expect((await api("POST", "/api/v1/runner/start", runner, {})).status).toBe(401);
      await db.close();
      const res = await api("GET", "/api/v1/bundles", token);
      expect({ status: res.status, body: res.body }).toEqual({
        status: 500,
        body: {
          error: { code: "internal.error", message: "internal error; the server log has the details" },
        },
      });
      const log = lines.join("");
      expect(log).toContain('"level":50');
      expect(log).toContain("rest-server");
      expect(log).not.toContain(token);
      expect(log).not.toContain(runner);
    } finally {
      await app.close();
    }
  });
});
