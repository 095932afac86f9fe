/**
 * The store's API tokens (migration 003, create, find while live, touch, list, revoke) and the queries behind
 * the per-user submission limits (the quota row lock and bucket, the active-bundle count and its index), on
 * PostgreSQL and PGlite.
 */
import { describe, expect, it } from "vitest";
import type { Db } from "../store/db.ts";
import { listMigrations } from "../store/migrate.ts";
import {
  countActiveBundles,
  countTokens,
  createToken,
  createUser,
  findLiveToken,
  getUser,
  listTokens,
  lockSubmitBucket,
  lockUser,
  revokeToken,
  saveSubmitBucket,
  touchToken,
} from "../store/queries.ts";
import { killBundle } from "../store/transitions.ts";
import { createTestBundle, createTestUser, describeEachDb, testUserUuid } from "./db.ts";

const T0 = Date.UTC(2026, 0, 1);
const at = (ms: number) => new Date(T0 + ms);

/** Runs fn in a transaction that is always rolled back. */
async function rolledBack(db: Db, fn: (tx: Db) => Promise<void>): Promise<void> {
  const rollback = new Error("rollback");
  await db
    .transaction(async (tx) => {
      await fn(tx);
      throw rollback;
    })
    .catch((err: unknown) => {
      if (err !== rollback) throw err;
    });
}

describeEachDb("store: tokens and quotas", (getDb) => {
  const db = () => getDb();

  describe("migration 003", () => {
    it("moves every user's token into api_tokens, where it keeps working", async () => {
      const [m1, m2, m3] = listMigrations();
      expect(m3?.name).toBe("003_api_tokens.sql");
      // The migrations, in a schema of their own, inside a transaction that is rolled back.
      await rolledBack(db(), async (tx) => {
        await tx.query("CREATE SCHEMA mig003");
        await tx.query("SET LOCAL search_path TO mig003");
        await tx.query(m1!.sql);
        await tx.query(m2!.sql);
        await tx.query(
          "INSERT INTO users (uuid, name, is_admin, token_hash) VALUES ('abcde-user-aaaaaaaaaaaaaaa', 'old', true, 'h-old')",
        );
        await tx.query(m3!.sql);
        const found = await findLiveToken(tx, "h-old", new Date());
        expect(found?.user).toMatchObject({ uuid: "abcde-user-aaaaaaaaaaaaaaa", name: "old", isAdmin: true });
        expect(found?.token.id).toMatch(/^abcde-tokn-[0-9a-f]{15}$/);
        expect(found?.token.createdAt).toEqual(found?.user.createdAt);
        const { rows } = await tx.query(
          "SELECT column_name FROM information_schema.columns WHERE table_schema = 'mig003' AND table_name = 'users' AND column_name = 'token_hash'",
        );
        expect(rows).toEqual([]);
      });
    });
  });

  describe("tokens", () => {
    it("finds a token only while it is neither revoked nor expired", async () => {
      const user = await createTestUser(db());
      const t = await createToken(db(), {
        userUuid: user.uuid,
        tokenHash: `h-exp-${user.uuid}`,
        label: "ci",
        expiresAt: at(60_000),
        now: at(0),
      });
      expect(t).toMatchObject({
        userUuid: user.uuid,
        label: "ci",
        createdAt: at(0),
        expiresAt: at(60_000),
        lastUsedAt: null,
        revokedAt: null,
      });
      expect(t.id).toMatch(/^zzzzz-tokn-[a-z0-9]{15}$/);
      expect((await findLiveToken(db(), `h-exp-${user.uuid}`, at(59_999)))?.user.uuid).toBe(user.uuid);
      expect(await findLiveToken(db(), `h-exp-${user.uuid}`, at(60_000))).toBeNull();

      const forever = await createToken(db(), {
        userUuid: user.uuid,
        tokenHash: `h-forever-${user.uuid}`,
        label: "",
        expiresAt: null,
        now: at(0),
      });
      expect((await findLiveToken(db(), `h-forever-${user.uuid}`, at(1e12)))?.token.id).toBe(forever.id);
      expect(await revokeToken(db(), { id: forever.id, ownerUuid: user.uuid, now: at(5) })).toMatchObject({
        id: forever.id,
        revokedAt: at(5),
      });
      expect(await findLiveToken(db(), `h-forever-${user.uuid}`, at(6))).toBeNull();
    });

    it("revokes once, only the owner's unless no owner is given (admins), and lists what is not revoked", async () => {
      const alice = await createTestUser(db());
      const bob = await createTestUser(db());
      // The first token, made with the user (at the database's time); the others after it.
      const [first] = await listTokens(db(), alice.uuid);
      const later = (ms: number) => new Date(first!.createdAt.getTime() + ms);
      const make = (label: string, ms: number) =>
        createToken(db(), {
          userUuid: alice.uuid,
          tokenHash: `h-${label}-${alice.uuid}`,
          label,
          expiresAt: label === "short" ? later(ms + 1) : null,
          now: later(ms),
        });
      const a = await make("a", 10);
      const short = await make("short", 20);
      expect((await listTokens(db(), alice.uuid)).map((t) => t.label)).toEqual(["", "a", "short"]);
      expect(await countTokens(db(), alice.uuid)).toBe(3);

      expect(await revokeToken(db(), { id: a.id, ownerUuid: bob.uuid, now: at(30) })).toBeNull();
      expect(await revokeToken(db(), { id: a.id, ownerUuid: alice.uuid, now: at(30) })).toMatchObject({
        id: a.id,
        revokedAt: at(30),
      });
      expect(await revokeToken(db(), { id: a.id, ownerUuid: alice.uuid, now: at(31) })).toBeNull();
      // An admin names no owner; an expired token stays listed (and counted) until it is revoked.
      expect((await listTokens(db(), alice.uuid)).map((t) => t.id)).toEqual([first!.id, short.id]);
      expect(await revokeToken(db(), { id: short.id, ownerUuid: null, now: at(40) })).toMatchObject({
        userUuid: alice.uuid,
      });
      expect((await listTokens(db(), alice.uuid)).map((t) => t.id)).toEqual([first!.id]);
      expect(await countTokens(db(), alice.uuid)).toBe(1);
      expect(await countTokens(db(), bob.uuid)).toBe(1);
    });

    it("records the last use at most once per interval", async () => {
      const user = await createTestUser(db());
      const [t] = await listTokens(db(), user.uuid);
      expect(await touchToken(db(), t!.id, at(0), 60_000)).toBe(true);
      expect(await touchToken(db(), t!.id, at(59_999), 60_000)).toBe(false);
      expect((await listTokens(db(), user.uuid))[0]?.lastUsedAt).toEqual(at(0));
      expect(await touchToken(db(), t!.id, at(60_001), 60_000)).toBe(true);
      expect((await listTokens(db(), user.uuid))[0]?.lastUsedAt).toEqual(at(60_001));
    });

    it("finds and locks users by uuid", async () => {
      const user = await createTestUser(db());
      expect(await getUser(db(), user.uuid)).toEqual(user);
      expect(await getUser(db(), testUserUuid())).toBeNull();
      await db().transaction(async (tx) => {
        expect(await lockUser(tx, user.uuid)).toEqual(user);
        expect(await lockUser(tx, testUserUuid())).toBeNull();
      });
    });

    it("refuses a token hash that is already stored", async () => {
      const user = await createTestUser(db());
      const hash = `h-dup-${user.uuid}`;
      const args = { userUuid: user.uuid, tokenHash: hash, label: "", expiresAt: null, now: at(0) };
      await createToken(db(), args);
      await expect(createToken(db(), args)).rejects.toMatchObject({ code: "23505" });
      await expect(
        createUser(db(), { uuid: testUserUuid(), name: `dup-${user.uuid}`, isAdmin: false, tokenHash: hash }),
      ).rejects.toMatchObject({ code: "23505" });
      // The user of the failed statement was not made either.
      const { rows } = await db().query("SELECT 1 FROM users WHERE name = $1", [`dup-${user.uuid}`]);
      expect(rows).toEqual([]);
    });
  });

  describe("submission limits", () => {
    it("makes a user's quota row with a full bucket, then returns what was saved", async () => {
      const user = await createTestUser(db());
      await db().transaction(async (tx) => {
        expect(await lockSubmitBucket(tx, { userUuid: user.uuid, burst: 5, now: at(0) })).toEqual({
          tokens: 5,
          refilledAt: at(0),
        });
        await saveSubmitBucket(tx, user.uuid, { tokens: 1.5, refilledAt: at(1000) });
      });
      await db().transaction(async (tx) => {
        expect(await lockSubmitBucket(tx, { userUuid: user.uuid, burst: 5, now: at(9000) })).toEqual({
          tokens: 1.5,
          refilledAt: at(1000),
        });
      });
    });

    it("counts a user's non-final bundles, up to a bound", async () => {
      const user = await createTestUser(db());
      const other = await createTestUser(db());
      const bundles = [];
      for (let i = 0; i < 4; i++) bundles.push(await createTestBundle(db(), user.uuid));
      await createTestBundle(db(), other.uuid);
      expect(await countActiveBundles(db(), user.uuid, 100)).toBe(4);
      expect(await countActiveBundles(db(), user.uuid, 3)).toBe(3);
      const killed = await killBundle(db(), bundles[0]!.uuid, { actor: "test", reason: "test" });
      expect(killed.ok).toBe(true);
      expect(await countActiveBundles(db(), user.uuid, 100)).toBe(3);
    });

    it("counts through the partial index of active bundles, never reading final ones", async () => {
      const user = await createTestUser(db());
      await rolledBack(db(), async (tx) => {
        // With sequential scans priced out, the plan shows which index can answer the count.
        await tx.query("SET LOCAL enable_seqscan = off");
        const { rows } = await tx.query<{ "QUERY PLAN": string }>(
          `EXPLAIN SELECT count(*)::int AS n FROM (
             SELECT 1 FROM bundles WHERE owner_uuid = '${user.uuid}'
               AND state IN ('created', 'staged', 'starting', 'running') LIMIT 10) AS active`,
        );
        expect(rows.map((r) => r["QUERY PLAN"]).join("\n")).toContain("bundles_owner_active");
      });
    });
  });
});
