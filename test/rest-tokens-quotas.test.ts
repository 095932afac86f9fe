/**
 * The users' API tokens (create, list, revoke, expiry by the injected clock) and the per-user submission limits
 * (queued bundles, submission rate with Retry-After, both under parallel requests), through fastify.inject on
 * PostgreSQL and PGlite.
 */
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { pino } from "pino";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { ensureAdmin } from "../cli/commands/serve.ts";
import { loadConfig } from "../config/load.ts";
import { hashToken, newUserUuid } from "../lib/tokens.ts";
import { TOKEN_CACHE_MS } from "../rest-server/auth.ts";
import { createRestServer } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";
import { createTestUserWithToken, describeEachDb, openTestDb } from "./db.ts";
import { FakeClock } from "./fake-clock.ts";
import { expectApiError, injectClient, type Json } from "./rest-client.ts";

const CLUSTER = "zzzzz";
const HOUR = 3_600_000;
const minimal = { command: ["echo", "hi"], image: "busybox" };

const makeUser = (db: Db, isAdmin = false) => createTestUserWithToken(db, { isAdmin });
const expectError = expectApiError;

describeEachDb("REST tokens and quotas", (getDb) => {
  // An hour ahead of the database's clock, which dates the token a user is made with: tokens made through the
  // API (dated by this clock) come after it.
  const clock = new FakeClock(Date.now() + HOUR);
  let dir: string;
  const apps: FastifyInstance[] = [];
  /** A REST server on the suite's database with the given limits (and the suite's clock). */
  const server = async (quotas?: Parameters<typeof createRestServer>[0]["quotas"]) => {
    const app = await createRestServer({
      db: getDb(),
      logger: false,
      clusterId: CLUSTER,
      maxRequestBodySize: 2 ** 20,
      defaultMaxAttempts: 3,
      clock,
      dataDir: join(dir, "data"),
      ...(quotas === undefined ? {} : { quotas }),
    });
    apps.push(app);
    return injectClient(app);
  };

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "dc-rest-tokens-"));
  });
  afterAll(async () => {
    for (const app of apps) await app.close();
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  describe("tokens", () => {
    let api: Awaited<ReturnType<typeof server>>;
    let admin: { uuid: string; token: string };
    beforeAll(async () => {
      api = await server({
        maxQueuedBundlesPerUser: 0,
        submissionsPerSecond: 0,
        submissionBurst: 1,
        maxTokensPerUser: 4,
      });
      admin = await makeUser(getDb(), true);
    });
    const newToken = async (token: string, body: object = {}): Promise<Json> => {
      const res = await api("POST", "/api/v1/tokens", token, body);
      expect(res.status, JSON.stringify(res.body)).toBe(201);
      return res.body;
    };
    const whoAmI = (token: string) => api("GET", "/api/v1/users/current", token);

    it("makes another token, shown once; lists them without secrets; the user's first token is one of them", async () => {
      const alice = await makeUser(getDb());
      const made = await newToken(alice.token, { label: "laptop" });
      expect(made).toMatchObject({
        userUuid: alice.uuid,
        label: "laptop",
        expiresAt: null,
        revokedAt: null,
        expired: false,
        current: false,
      });
      expect(made.id).toMatch(/^zzzzz-tokn-[a-z0-9]{15}$/);
      expect(made.token).toMatch(/^dcu_[A-Za-z0-9_-]{43}$/);
      expect(made.createdAt).toBe(new Date(clock.now()).toISOString());
      expect((await whoAmI(made.token)).body.uuid).toBe(alice.uuid);

      const list = await api("GET", "/api/v1/tokens", alice.token);
      expect(list.status).toBe(200);
      const items: Json[] = list.body.items;
      expect(items.map((t) => t.label)).toEqual(["", "laptop"]);
      expect(items.map((t) => t.current)).toEqual([true, false]);
      // Used just now (the list request itself), by the injected clock.
      expect(items[0].lastUsedAt).toBe(new Date(clock.now()).toISOString());
      const dump = JSON.stringify(list.body);
      for (const secret of [alice.token, made.token]) {
        expect(dump).not.toContain(secret);
        expect(dump).not.toContain(hashToken(secret));
      }
      // The database keeps hashes only.
      const { rows } = await getDb().query("SELECT * FROM api_tokens WHERE user_uuid = $1", [alice.uuid]);
      expect(JSON.stringify(rows)).not.toContain(made.token);
      expect(rows.map((r) => r["token_hash"]).sort()).toEqual(
        [hashToken(alice.token), hashToken(made.token)].sort(),
      );
    });

    it("revokes the user's own tokens, the first one included; a revoked token is auth.invalid_token", async () => {
      const alice = await makeUser(getDb());
      const second = await newToken(alice.token);
      const [first] = (await api("GET", "/api/v1/tokens", second.token)).body.items as Json[];
      expect(first.current).toBe(false);
      const revoked = await api("DELETE", `/api/v1/tokens/${first.id}`, second.token);
      expect(revoked.status).toBe(200);
      expect(revoked.body).toMatchObject({ id: first.id, revokedAt: new Date(clock.now()).toISOString() });
      expectError(await whoAmI(alice.token), 401, "auth.invalid_token");
      expectError(
        await api("DELETE", `/api/v1/tokens/${first.id}`, second.token),
        404,
        "token.not_found",
        "id",
      );
      expect((await api("GET", "/api/v1/tokens", second.token)).body.items.map((t: Json) => t.id)).toEqual([
        second.id,
      ]);
      // A token may revoke itself; then nothing works with it.
      expect((await api("DELETE", `/api/v1/tokens/${second.id}`, second.token)).status).toBe(200);
      expectError(await api("GET", "/api/v1/tokens", second.token), 401, "auth.invalid_token");
    });

    it("trusts a token found live for TOKEN_CACHE_MS: a revocation behind the server's back takes effect after it", async () => {
      const bob = await makeUser(getDb());
      expect((await whoAmI(bob.token)).status).toBe(200);
      await getDb().query("UPDATE api_tokens SET revoked_at = now() WHERE user_uuid = $1", [bob.uuid]);
      expect((await whoAmI(bob.token)).status).toBe(200);
      await clock.advance(TOKEN_CACHE_MS);
      expectError(await whoAmI(bob.token), 401, "auth.invalid_token");
    });

    it("hides other users' tokens from a user: 404 to revoke, 403 to list; an admin lists, revokes and makes anyone's", async () => {
      const alice = await makeUser(getDb());
      const bob = await makeUser(getDb());
      const aliceExtra = await newToken(alice.token);
      expectError(await api("DELETE", `/api/v1/tokens/${aliceExtra.id}`, bob.token), 404, "token.not_found");
      expect((await whoAmI(aliceExtra.token)).status).toBe(200);
      expectError(await api("GET", `/api/v1/tokens?user=${alice.uuid}`, bob.token), 403, "auth.forbidden");
      expectError(
        await api("POST", "/api/v1/tokens", bob.token, { userUuid: alice.uuid }),
        403,
        "auth.forbidden",
      );
      // A user naming themselves is fine.
      expect((await api("GET", `/api/v1/tokens?user=${bob.uuid}`, bob.token)).body.items).toHaveLength(1);

      const listed = await api("GET", `/api/v1/tokens?user=${alice.uuid}`, admin.token);
      expect(listed.status).toBe(200);
      expect(listed.body.items.map((t: Json) => t.userUuid)).toEqual([alice.uuid, alice.uuid]);
      expect(listed.body.items.map((t: Json) => t.current)).toEqual([false, false]);
      expect((await api("DELETE", `/api/v1/tokens/${aliceExtra.id}`, admin.token)).body).toMatchObject({
        id: aliceExtra.id,
        userUuid: alice.uuid,
      });
      expectError(await whoAmI(aliceExtra.token), 401, "auth.invalid_token");
      expect((await whoAmI(alice.token)).status).toBe(200);

      const forAlice = await newToken(admin.token, { userUuid: alice.uuid, label: "from admin" });
      expect(forAlice.userUuid).toBe(alice.uuid);
      expect((await whoAmI(forAlice.token)).body.uuid).toBe(alice.uuid);
      const nobody = newUserUuid(CLUSTER);
      expectError(
        await api("GET", `/api/v1/tokens?user=${nobody}`, admin.token),
        404,
        "user.not_found",
        "user",
      );
      expectError(
        await api("POST", "/api/v1/tokens", admin.token, { userUuid: nobody }),
        404,
        "user.not_found",
        "userUuid",
      );
    });

    it("expires tokens by the injected clock (ttl or expiresAt); an expired token is listed until revoked", async () => {
      const alice = await makeUser(getDb());
      const byTtl = await newToken(alice.token, { ttl: "1h" });
      expect(byTtl.expiresAt).toBe(new Date(clock.now() + HOUR).toISOString());
      await clock.advance(1);
      const at = new Date(clock.now() - 1 + 2 * HOUR).toISOString();
      const byTime = await newToken(alice.token, { expiresAt: at });
      expect(byTime.expiresAt).toBe(at);
      expect((await whoAmI(byTtl.token)).status).toBe(200);

      await clock.advance(HOUR - 2);
      expect((await whoAmI(byTtl.token)).status).toBe(200);
      await clock.advance(1);
      expectError(await whoAmI(byTtl.token), 401, "auth.invalid_token");
      expect((await whoAmI(byTime.token)).status).toBe(200);
      const list = (await api("GET", "/api/v1/tokens", alice.token)).body.items as Json[];
      expect(list.map((t) => [t.id, t.expired])).toEqual([
        [list[0].id, false],
        [byTtl.id, true],
        [byTime.id, false],
      ]);
      await clock.advance(HOUR);
      expectError(await whoAmI(byTime.token), 401, "auth.invalid_token");
      expect((await whoAmI(alice.token)).status).toBe(200);
      // Revoking an expired token removes it from the list.
      expect((await api("DELETE", `/api/v1/tokens/${byTtl.id}`, alice.token)).status).toBe(200);
      expect((await api("GET", "/api/v1/tokens", alice.token)).body.items).toHaveLength(2);
    });

    it("refuses bad requests with a code and the path of the bad field", async () => {
      const alice = await makeUser(getDb());
      const past = new Date(clock.now() - 1000).toISOString();
      for (const [body, code, path] of [
        [{ ttl: "1h", expiresAt: new Date(clock.now() + HOUR).toISOString() }, "request.invalid_body", "ttl"],
        [{ expiresAt: past }, "request.invalid_body", "expiresAt"],
        [{ expiresAt: "tomorrow" }, "request.invalid_body", "expiresAt"],
        [{ expiresAt: "2026-13-45T99:00:00Z" }, "request.invalid_body", "expiresAt"],
        [{ ttl: "abc" }, "request.invalid_body", "ttl"],
        [{ ttl: "0" }, "request.invalid_body", "ttl"],
        [{ ttl: 3600 }, "request.invalid_body", "ttl"],
        [{ ttl: "100000000d" }, "request.invalid_body", "ttl"],
        [{ label: "a\nb" }, "request.invalid_body", "label"],
        [{ label: "x".repeat(101) }, "request.invalid_body", "label"],
        [{ userUuid: "alice" }, "request.invalid_body", "userUuid"],
        [{ scope: "all" }, "request.unknown_field", "scope"],
      ] as const) {
        expectError(await api("POST", "/api/v1/tokens", alice.token, body), 400, code, path);
      }
      expectError(await api("GET", "/api/v1/tokens?all=1", alice.token), 400, "request.invalid_query", "all");
      expectError(
        await api("GET", "/api/v1/tokens?user=bob", alice.token),
        400,
        "request.invalid_query",
        "user",
      );
      expectError(
        await api("DELETE", "/api/v1/tokens/nope", alice.token),
        400,
        "request.invalid_param",
        "id",
      );
      expectError(
        await api("DELETE", "/api/v1/tokens/zzzzz-tokn-000000000000000", alice.token),
        404,
        "token.not_found",
      );
      expectError(await api("GET", "/api/v1/tokens"), 401, "auth.missing_token");
      // Nothing was made by the refused requests.
      expect((await api("GET", "/api/v1/tokens", alice.token)).body.items).toHaveLength(1);
    });

    it("caps the tokens a user holds (quotas.maxTokensPerUser), expired ones included until revoked", async () => {
      const alice = await makeUser(getDb());
      const made = [];
      for (let i = 0; i < 3; i++) made.push(await newToken(alice.token, { ttl: "1s" }));
      expectError(await api("POST", "/api/v1/tokens", alice.token, {}), 429, "quota.tokens");
      await clock.advance(1000);
      expectError(await api("POST", "/api/v1/tokens", alice.token, {}), 429, "quota.tokens");
      expect((await api("DELETE", `/api/v1/tokens/${made[0].id}`, alice.token)).status).toBe(200);
      await newToken(alice.token);
      expect((await api("GET", "/api/v1/tokens", alice.token)).body.items).toHaveLength(4);
    });

    it("keeps the admin token file that serve writes working, as a revocable token", async () => {
      // ensureAdmin acts on a database without users: a fresh one of the suite's kind.
      const fresh = await openTestDb(getDb().kind);
      try {
        const dataDir = join(dir, "serve-data");
        await ensureAdmin(
          fresh,
          { ...loadConfig(undefined), clusterId: CLUSTER, dataDir },
          pino({ level: "silent" }),
        );
        const token = (await readFile(join(dataDir, "admin-token"), "utf8")).trim();
        const app = await createRestServer({
          db: fresh,
          logger: false,
          clusterId: CLUSTER,
          maxRequestBodySize: 2 ** 20,
          defaultMaxAttempts: 3,
          clock,
          dataDir: join(dir, "data"),
        });
        try {
          const freshApi = injectClient(app);
          const me = await freshApi("GET", "/api/v1/users/current", token);
          expect(me.body).toMatchObject({ name: "admin", isAdmin: true });
          const [t] = (await freshApi("GET", "/api/v1/tokens", token)).body.items as Json[];
          expect(t.current).toBe(true);
          expect((await freshApi("DELETE", `/api/v1/tokens/${t.id}`, token)).status).toBe(200);
          expectError(await freshApi("GET", "/api/v1/users/current", token), 401, "auth.invalid_token");
        } finally {
          await app.close();
        }
      } finally {
        await fresh.close();
      }
    });
  });

  describe("submission limits", () => {
    it("refuses a submission over the queued cap with 429 quota.queued_bundles; a finished bundle makes room", async () => {
      const api = await server({
        maxQueuedBundlesPerUser: 3,
        submissionsPerSecond: 0,
        submissionBurst: 1,
        maxTokensPerUser: 100,
      });
      const alice = await makeUser(getDb());
      const bob = await makeUser(getDb());
      const uuids: string[] = [];
      for (let i = 0; i < 3; i++) {
        const res = await api("POST", "/api/v1/bundles", alice.token, minimal);
        expect(res.status).toBe(201);
        uuids.push(res.body.uuid);
      }
      const over = await api("POST", "/api/v1/bundles", alice.token, minimal);
      expectError(over, 429, "quota.queued_bundles");
      expect(over.headers["retry-after"]).toBeUndefined();
      // Another user is not affected; a bad body is still a 400 first.
      expect((await api("POST", "/api/v1/bundles", bob.token, minimal)).status).toBe(201);
      expectError(
        await api("POST", "/api/v1/bundles", alice.token, { image: "x" }),
        400,
        "request.invalid_body",
      );
      expect((await api("POST", `/api/v1/bundles/${uuids[0]}/kill`, alice.token, {})).status).toBe(200);
      expect((await api("POST", "/api/v1/bundles", alice.token, minimal)).status).toBe(201);
      expectError(await api("POST", "/api/v1/bundles", alice.token, minimal), 429, "quota.queued_bundles");
    });

    it("never lets parallel submissions overshoot the queued cap", async () => {
      const api = await server({
        maxQueuedBundlesPerUser: 4,
        submissionsPerSecond: 0,
        submissionBurst: 1,
        maxTokensPerUser: 100,
      });
      const alice = await makeUser(getDb());
      const results = await Promise.all(
        Array.from({ length: 16 }, () => api("POST", "/api/v1/bundles", alice.token, minimal)),
      );
      expect(results.filter((r) => r.status === 201)).toHaveLength(4);
      expect(
        results.filter((r) => r.status === 429 && r.body.error.code === "quota.queued_bundles"),
      ).toHaveLength(12);
      const { rows } = await getDb().query<{ n: number }>(
        "SELECT count(*)::int AS n FROM bundles WHERE owner_uuid = $1",
        [alice.uuid],
      );
      expect(rows[0]!.n).toBe(4);
    });

    it("paces submissions with a token bucket: 429 quota.rate_limited with Retry-After in seconds", async () => {
      const api = await server({
        maxQueuedBundlesPerUser: 0,
        submissionsPerSecond: 0.5,
        submissionBurst: 2,
        maxTokensPerUser: 100,
      });
      const alice = await makeUser(getDb());
      const submit = () => api("POST", "/api/v1/bundles", alice.token, minimal);
      expect((await submit()).status).toBe(201);
      expect((await submit()).status).toBe(201);
      const limited = await submit();
      expectError(limited, 429, "quota.rate_limited");
      expect(limited.headers["retry-after"]).toBe("2");
      expect(limited.headers["content-type"]).toMatch(/^application\/json/);
      await clock.advance(1000);
      expect((await submit()).headers["retry-after"]).toBe("1");
      await clock.advance(1000);
      // Refused requests spent nothing: exactly one token has come back.
      expect((await submit()).status).toBe(201);
      expectError(await submit(), 429, "quota.rate_limited");
      // The bucket never holds more than the burst.
      await clock.advance(3_600_000);
      const after = await Promise.all([submit(), submit(), submit()]);
      expect(after.map((r) => r.status).sort()).toEqual([201, 201, 429]);
      const { rows } = await getDb().query<{ n: number }>(
        "SELECT count(*)::int AS n FROM bundles WHERE owner_uuid = $1",
        [alice.uuid],
      );
      expect(rows[0]!.n).toBe(5);
    });

    it("exempts admins from both submission limits", async () => {
      const api = await server({
        maxQueuedBundlesPerUser: 1,
        submissionsPerSecond: 0.001,
        submissionBurst: 1,
        maxTokensPerUser: 100,
      });
      const admin = await makeUser(getDb(), true);
      const alice = await makeUser(getDb());
      for (let i = 0; i < 5; i++)
        expect((await api("POST", "/api/v1/bundles", admin.token, minimal)).status).toBe(201);
      expect((await api("POST", "/api/v1/bundles", alice.token, minimal)).status).toBe(201);
      expect((await api("POST", "/api/v1/bundles", alice.token, minimal)).status).toBe(429);
    });
  });
});
