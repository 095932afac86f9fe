/**
 * Group insert of single submissions (rest-server/submit-coalescer.ts) on PostgreSQL and PGlite: submissions
 * that arrive together go in as one statement, each caller gets its own bundle and first event,
 * one NOTIFY covers a group, and a row the database refuses fails only its own submission. Through the REST
 * server: concurrent POSTs are grouped; those with dependencies or under a limit are not.
 */
import { mkdtemp, rm } from "node:fs/promises";
import http from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, expect, it } from "vitest";
import { newBundleUuid } from "../lib/tokens.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createSubmitCoalescer } from "../rest-server/submit-coalescer.ts";
import { listEvents } from "../store/queries.ts";
import { BUNDLE_CHANNEL } from "../store/types.ts";
import { createTestUserWithToken, describeEachDb, testNewBundle, testUserUuid } from "./db.ts";
import { restServerBasics } from "./fixtures.ts";
import { injectClient } from "./rest-client.ts";

describeEachDb("submit coalescer", (getDb) => {
  let dir: string;
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "dc-coalesce-"));
  });
  afterAll(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  it("groups the submissions that arrive together; each gets its own bundle", async () => {
    const db = getDb();
    const owners = await Promise.all([1, 2, 3].map(() => createTestUserWithToken(db)));
    const c = createSubmitCoalescer(db);
    const payloads: string[] = [];
    const unlisten = await db.listen(BUNDLE_CHANNEL, (p) => payloads.push(p));
    const asked = Array.from({ length: 40 }, (_, i) => ({
      uuid: newBundleUuid("zzzzz"),
      bundle: testNewBundle(owners[i % 3]!.uuid, { name: `b${i}`, priority: i }),
    }));
    const got = await Promise.all(asked.map((a) => c.insert(a.uuid, a.bundle)));
    // All 40 arrived in the same turn of the event loop: one statement (lib/group-calls.ts).
    expect(c.stats()).toEqual({ statements: 1, bundles: 40, largest: 40 });
    got.forEach((b, i) => {
      expect(b.uuid).toBe(asked[i]!.uuid);
      expect(b.name).toBe(`b${i}`);
      expect(b.priority).toBe(i);
      expect(b.ownerUuid).toBe(owners[i % 3]!.uuid);
      expect(b.state).toBe("staged");
    });
    const events = await listEvents(db, got[5]!.uuid);
    expect(events.map((e) => [e.toState, e.actor])).toEqual([
      ["created", `user:${owners[2]!.uuid}`],
      ["staged", "rest-server"],
    ]);
    await expect.poll(() => payloads.filter((p) => p.startsWith("* staged ")).length).toBe(1);
    expect(payloads.filter((p) => p.startsWith("* staged "))).toEqual(["* staged 40"]);
    await unlisten();
  });

  it("a row the database refuses fails only its own submission", async () => {
    const db = getDb();
    const owner = await createTestUserWithToken(db);
    const c = createSubmitCoalescer(db);
    const good = (i: number) =>
      c.insert(newBundleUuid("zzzzz"), testNewBundle(owner.uuid, { name: `g${i}` }));
    const first = good(0);
    // No such user: the owner's foreign key refuses this row, and with it the group's statement.
    const bad = c.insert(newBundleUuid("zzzzz"), testNewBundle(testUserUuid(), { name: "bad" }));
    const rest = [1, 2, 3].map(good);
    await expect(bad).rejects.toThrow(/foreign key|violates/i);
    const names = (await Promise.all([first, ...rest])).map((b) => b.name);
    expect(names).toEqual(["g0", "g1", "g2", "g3"]);
    // The group of 5 that failed, then each of the 5 again.
    expect(c.stats().statements).toBe(6);
  });

  it("refuses a bundle with dependencies (those keep their own transaction)", async () => {
    const db = getDb();
    const owner = await createTestUserWithToken(db);
    const c = createSubmitCoalescer(db);
    const withDep = testNewBundle(owner.uuid, {
      dependencies: [{ bundle: newBundleUuid("zzzzz"), subpath: "", name: "d" }],
    });
    await expect(c.insert(newBundleUuid("zzzzz"), withDep)).rejects.toThrow(/without dependencies/);
    expect(c.stats().statements).toBe(0);
  });

  it("through the REST server: POSTs without dependencies or limits are grouped, the others are not", async () => {
    const db = getDb();
    const app = await createRestServer({
      ...restServerBasics(db, join(dir, "data")),
      quotas: {
        maxQueuedBundlesPerUser: 100,
        submissionsPerSecond: 0,
        submissionBurst: 1,
        maxTokensPerUser: 10,
      },
    });
    const admin = await createTestUserWithToken(db, { isAdmin: true });
    const limited = await createTestUserWithToken(db);
    const request = injectClient(app);
    const payloads: string[] = [];
    const unlisten = await db.listen(BUNDLE_CHANNEL, (p) => payloads.push(p));
    const post = (token: string, name: string, extra: object = {}) =>
      request("POST", "/api/v1/bundles", token, {
        command: ["echo", name],
        image: "busybox",
        name,
        ...extra,
      });

    // An admin is under no limit: grouped, so the notifications are `* staged <n>`, n summing to 12.
    const answers = await Promise.all(Array.from({ length: 12 }, (_, i) => post(admin.token, `a${i}`)));
    expect(answers.map((a) => a.status)).toEqual(Array(12).fill(201));
    expect(new Set(answers.map((a) => a.body.uuid)).size).toBe(12);
    const grouped = () =>
      payloads
        .filter((p) => p.startsWith("* staged "))
        .reduce((n, p) => n + Number(p.slice("* staged ".length)), 0);
    await expect.poll(grouped).toBe(12);

    // Under a limit (the queued cap is checked in a transaction) and with dependencies: one statement each.
    const mine = await post(limited.token, "l0");
    expect(mine.status).toBe(201);
    const dependent = await post(admin.token, "d0", { dependencies: [{ bundle: answers[0]!.body.uuid }] });
    expect(dependent.status).toBe(201);
    await expect.poll(() => payloads.filter((p) => p.startsWith(`${mine.body.uuid} staged `)).length).toBe(1);
    await expect
      .poll(() => payloads.filter((p) => p.startsWith(`${dependent.body.uuid} created `)).length)
      .toBe(1);
    expect(grouped()).toBe(12);
    await unlisten();
    await app.close();
  });

  it("through the REST server's sockets: POSTs read in the same round go together, on PGlite too", async () => {
    const db = getDb();
    const app = await createRestServer(restServerBasics(db, join(dir, "data-sockets")));
    const url = await app.listen({ host: "127.0.0.1", port: 0 });
    const admin = await createTestUserWithToken(db, { isAdmin: true });
    const payloads: string[] = [];
    const unlisten = await db.listen(BUNDLE_CHANNEL, (p) => payloads.push(p));
    const agent = new http.Agent({ keepAlive: true, maxSockets: 24 });
    const post = (name: string) =>
      new Promise<{ status: number; uuid: string }>((resolve, reject) => {
        const req = http.request(
          `${url}/api/v1/bundles`,
          {
            method: "POST",
            agent,
            headers: { authorization: `Bearer ${admin.token}`, "content-type": "application/json" },
          },
          (res) => {
            let text = "";
            res.on("data", (c) => {
              text += c;
            });
            res.on("end", () => resolve({ status: res.statusCode ?? 0, uuid: JSON.parse(text).uuid }));
          },
        );
        req.on("error", reject);
        req.end(JSON.stringify({ command: ["echo", name], image: "busybox", name }));
      });
    try {
      // Open the 24 connections first, so that the 24 POSTs below leave together.
      await Promise.all(Array.from({ length: 24 }, (_, i) => post(`warm${i}`)));
      await expect.poll(() => payloads.length).toBeGreaterThan(0);
      payloads.length = 0;
      const answers = await Promise.all(Array.from({ length: 24 }, (_, i) => post(`b${i}`)));
      expect(answers.map((a) => a.status)).toEqual(Array(24).fill(201));
      expect(new Set(answers.map((a) => a.uuid)).size).toBe(24);
      const staged = () => payloads.filter((p) => p.startsWith("* staged "));
      await expect.poll(() => staged().reduce((n, p) => n + Number(p.slice("* staged ".length)), 0)).toBe(24);
      // One statement (and NOTIFY) per group. A database in this thread (PGlite) reads no request while its
      // statement runs; grouping only the calls of one microtask turn gave 24 statements there.
      expect(staged().length).toBeLessThanOrEqual(8);
    } finally {
      agent.destroy();
      await unlisten();
      await app.close();
    }
  });
});
