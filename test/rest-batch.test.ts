/**
 * Batch submission (`POST /api/v1/bundles/batch`, `dispatch-cloud submit --batch FILE.jsonl`) on PostgreSQL and
 * PGlite: all or nothing, the bad field named under its item, the limits counted for the whole batch, one
 * notification for the whole batch, and the bundle manager staging every bundle of it.
 */
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { pino } from "pino";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../cli/cli.ts";
import type { CliIo } from "../cli/io.ts";
import { createBundleManager } from "../rest-server/bundle-manager.ts";
import { createRestServer } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";
import { listBundles } from "../store/queries.ts";
import { finishBundle, markRunning, startBundle } from "../store/transitions.ts";
import { BUNDLE_CHANNEL } from "../store/types.ts";
import { createTestUserWithToken, describeEachDb } from "./db.ts";
import { expectApiError, injectClient } from "./rest-client.ts";

const CLUSTER = "zzzzz";
const item = (name: string, extra: object = {}) => ({
  command: ["echo", name],
  image: "busybox",
  name,
  ...extra,
});

const makeUser = (db: Db, isAdmin = false) => createTestUserWithToken(db, { isAdmin });
const expectError = expectApiError;

async function countBundles(db: Db, owner: string): Promise<number> {
  const { rows } = await db.query<{ n: number }>(
    "SELECT count(*)::int AS n FROM bundles WHERE owner_uuid = $1",
    [owner],
  );
  return rows[0]!.n;
}

describeEachDb("batch submission", (getDb) => {
  let dir: string;
  const apps: FastifyInstance[] = [];
  const server = async (quotas?: Parameters<typeof createRestServer>[0]["quotas"], maxBatch?: number) => {
    const app = await createRestServer({
      db: getDb(),
      logger: false,
      clusterId: CLUSTER,
      maxRequestBodySize: 2 ** 20,
      ...(maxBatch === undefined ? {} : { maxBatchRequestBodySize: maxBatch }),
      defaultMaxAttempts: 3,
      dataDir: join(dir, "data"),
      ...(quotas === undefined ? {} : { quotas }),
    });
    apps.push(app);
    return app;
  };

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "dc-rest-batch-"));
  });
  afterAll(async () => {
    for (const app of apps) await app.close();
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  describe("without limits", () => {
    let api: ReturnType<typeof injectClient>;
    beforeAll(async () => {
      api = injectClient(await server());
    });

    it("creates every bundle in the order given, with its events and its dependencies; stages those without", async () => {
      const u = await makeUser(getDb());
      const dep = await api("POST", "/api/v1/bundles", u.token, item("dep"));
      expect(dep.status).toBe(201);
      const res = await api("POST", "/api/v1/bundles/batch", u.token, {
        items: [item("a"), item("b", { dependencies: [{ bundle: dep.body.uuid, name: "in" }] }), item("c")],
      });
      expect(res.status, JSON.stringify(res.body)).toBe(201);
      expect(res.body.items.map((b: { name: string }) => b.name)).toEqual(["a", "b", "c"]);
      expect(new Set(res.body.items.map((b: { uuid: string }) => b.uuid)).size).toBe(3);
      // A bundle without dependencies is staged by its insert (both events); "b" waits for its dependency.
      expect(res.body.items.map((b: { state: string }) => b.state)).toEqual(["staged", "created", "staged"]);
      for (const b of res.body.items) {
        const got = await api("GET", `/api/v1/bundles/${b.uuid}`, u.token);
        expect(got.body).toMatchObject({ uuid: b.uuid, name: b.name, command: ["echo", b.name] });
        expect(got.body.timings.stagedAt === null).toBe(b.name === "b");
        const events = await api("GET", `/api/v1/bundles/${b.uuid}/events`, u.token);
        expect(events.body.items).toMatchObject([
          { fromState: null, toState: "created", actor: `user:${u.uuid}` },
          ...(b.name === "b" ? [] : [{ fromState: "created", toState: "staged", actor: "rest-server" }]),
        ]);
      }
      const { rows } = await getDb().query<{ dependency_uuid: string; name: string }>(
        "SELECT dependency_uuid, name FROM bundle_dependencies WHERE bundle_uuid = $1",
        [res.body.items[1].uuid],
      );
      expect(rows).toEqual([{ dependency_uuid: dep.body.uuid, name: "in" }]);
    });

    it("answers each bundle's uuid and state only when asked to with Prefer: return=minimal", async () => {
      const u = await makeUser(getDb());
      const dep = await api("POST", "/api/v1/bundles", u.token, item("dep2"));
      const batch = {
        items: [item("m1"), item("m2", { dependencies: [{ bundle: dep.body.uuid, name: "in" }] })],
      };
      for (const prefer of ["return=minimal", 'wait=5, RETURN="minimal"; x=y']) {
        const res = await api("POST", "/api/v1/bundles/batch", u.token, batch, { prefer });
        expect(res.status, JSON.stringify(res.body)).toBe(201);
        expect(res.headers["preference-applied"]).toBe("return=minimal");
        expect(res.body.items).toEqual([
          { uuid: expect.stringMatching(/^zzzzz-bndl-/), state: "staged" },
          { uuid: expect.stringMatching(/^zzzzz-bndl-/), state: "created" },
        ]);
        // The bundles are whole all the same: the same rows, events and dependencies as with a whole answer.
        const [m1, m2] = res.body.items;
        expect((await api("GET", `/api/v1/bundles/${m1.uuid}`, u.token)).body).toMatchObject({
          name: "m1",
          state: "staged",
          command: ["echo", "m1"],
        });
        expect((await api("GET", `/api/v1/bundles/${m2.uuid}`, u.token)).body).toMatchObject({
          name: "m2",
          state: "created",
          dependencies: [{ bundle: dep.body.uuid, name: "in" }],
        });
        const events = await api("GET", `/api/v1/bundles/${m1.uuid}/events`, u.token);
        expect(events.body.items.map((e: { toState: string }) => e.toState)).toEqual(["created", "staged"]);
      }
      // Any other preference (or none) gets the whole bundles.
      const whole = await api("POST", "/api/v1/bundles/batch", u.token, batch, {
        prefer: "return=representation",
      });
      expect(whole.status).toBe(201);
      expect(whole.headers["preference-applied"]).toBeUndefined();
      expect(whole.body.items[0]).toMatchObject({ name: "m1", command: ["echo", "m1"], state: "staged" });
    });

    it("refuses the whole batch on one bad field, naming it under its item, and keeps nothing", async () => {
      const u = await makeUser(getDb());
      const cases: [object, number, string, string][] = [
        [
          { items: [item("a"), item("b", { resources: { ram: "lots" } })] },
          400,
          "request.invalid_body",
          "items[1].resources.ram",
        ],
        [{ items: [item("a", { bogus: 1 })] }, 400, "request.unknown_field", "items[0].bogus"],
        [{ items: [item("a"), { image: "busybox" }] }, 400, "request.invalid_body", "items[1].command"],
        [
          { items: [item("a"), item("b", { env: { "A B": "x" } })] },
          400,
          "request.invalid_body",
          'items[1].env["A B"]',
        ],
        [{ items: [] }, 400, "request.invalid_body", "items"],
        [{ items: item("a") }, 400, "request.invalid_body", "items"],
        [{ items: [item("a")], extra: true }, 400, "request.unknown_field", "extra"],
        [[item("a")], 400, "request.invalid_body", ""],
        [{ items: Array.from({ length: 10_001 }, () => ({})) }, 400, "request.invalid_body", "items"],
      ];
      for (const [body, status, code, path] of cases) {
        const res = await api("POST", "/api/v1/bundles/batch", u.token, body);
        expectError(res, status, code, path === "" ? undefined : path);
        if (path.startsWith("items[")) expect(res.body.error.message).toContain(path);
      }
      const foreign = await makeUser(getDb());
      const theirs = await api("POST", "/api/v1/bundles", foreign.token, item("theirs"));
      const res = await api("POST", "/api/v1/bundles/batch", u.token, {
        items: [item("a"), item("b"), item("c", { dependencies: [{ bundle: theirs.body.uuid }] })],
      });
      expectError(res, 400, "bundle.invalid_dependency", "items[2].dependencies[0].bundle");
      expect(await countBundles(getDb(), u.uuid)).toBe(0);
    });

    // 20 go as one statement, 10,000 as a transaction of statements of 1,000; either wakes listeners once.
    it.each([
      [20, "whole"],
      [20, "minimal"],
      [10_000, "whole"],
    ])(
      "takes %i bundles in one request (%s answer), in order, and wakes listeners once for all of them",
      async (n, answer) => {
        const u = await makeUser(getDb());
        const payloads: string[] = [];
        const unlisten = await getDb().listen(BUNDLE_CHANNEL, (p) => payloads.push(p));
        try {
          const items = Array.from({ length: n }, (_, i) => item(`n${i}`));
          const res = await api(
            "POST",
            "/api/v1/bundles/batch",
            u.token,
            { items },
            answer === "minimal" ? { prefer: "return=minimal" } : {},
          );
          expect(res.status, JSON.stringify(res.body).slice(0, 500)).toBe(201);
          expect(res.body.items).toHaveLength(n);
          const stored = await listBundles(getDb(), { ownerUuid: u.uuid, limit: n + 1 });
          expect(stored).toHaveLength(n);
          const nameOf = new Map(stored.map((b) => [b.uuid, b.name]));
          const names = res.body.items.map((b: { uuid: string }) => nameOf.get(b.uuid));
          expect(names).toEqual(items.map((it) => it.name));
          // A notification is delivered after its transaction commits; a marker sent afterwards arrives after it.
          await getDb().query("SELECT pg_notify($1, 'marker')", [BUNDLE_CHANNEL]);
          await expect.poll(() => payloads.includes("marker")).toBe(true);
        } finally {
          await unlisten();
        }
        expect(payloads.filter((p) => p !== "marker")).toEqual([`* staged ${n}`]);
      },
    );

    it("refuses a body larger than restServer.maxBatchRequestBodySize with request.body_too_large", async () => {
      const small = injectClient(await server(undefined, 4096));
      const u = await makeUser(getDb());
      const items = Array.from({ length: 100 }, (_, i) => item(`n${i}`));
      expectError(
        await small("POST", "/api/v1/bundles/batch", u.token, { items }),
        413,
        "request.body_too_large",
      );
      expect(await countBundles(getDb(), u.uuid)).toBe(0);
    });

    it("the bundle manager stages a whole batch from its one notification", async () => {
      const manager = createBundleManager({
        db: getDb(),
        logger: pino({ level: "silent" }),
        pollInterval: 3_600_000,
      });
      await manager.start();
      try {
        const u = await makeUser(getDb());
        const res = await api("POST", "/api/v1/bundles/batch", u.token, {
          items: Array.from({ length: 50 }, (_, i) => item(`s${i}`)),
        });
        expect(res.status).toBe(201);
        await expect
          .poll(
            async () =>
              (
                await getDb().query<{ n: number }>(
                  "SELECT count(*)::int AS n FROM bundles WHERE owner_uuid = $1 AND state = 'staged'",
                  [u.uuid],
                )
              ).rows[0]!.n,
            { timeout: 10_000 },
          )
          .toBe(50);
      } finally {
        await manager.stop();
      }
    });
    it("one bundle manager pass stages a batch larger than its page, page after page", async () => {
      const u = await makeUser(getDb());
      const dep = await api("POST", "/api/v1/bundles", u.token, item("dep"));
      const res = await api("POST", "/api/v1/bundles/batch", u.token, {
        items: Array.from({ length: 50 }, (_, i) =>
          item(`p${i}`, { dependencies: [{ bundle: dep.body.uuid }] }),
        ),
      });
      expect(res.status).toBe(201);
      const manager = createBundleManager({ db: getDb(), logger: pino({ level: "silent" }), batchSize: 7 });
      expect(await manager.runOnce()).toBe(0);
      // Its dependency ends ready: the 50 are staged in one pass over pages of 7.
      const db = getDb();
      const tokenHash = `h-${dep.body.uuid}`;
      await startBundle(db, dep.body.uuid, {
        instanceId: "i-1",
        instanceType: "small",
        runnerTokenHash: tokenHash,
        gpuDevices: [],
        actor: "test",
      });
      await markRunning(db, dep.body.uuid, 1, { actor: "test" });
      expect((await finishBundle(db, dep.body.uuid, 1, { exitCode: 0, actor: "test" })).ok).toBe(true);
      expect(await manager.runOnce()).toBe(50);
      const { rows } = await getDb().query<{ n: number }>(
        "SELECT count(*)::int AS n FROM bundles WHERE owner_uuid = $1 AND state = 'staged'",
        [u.uuid],
      );
      expect(rows[0]!.n).toBe(50);
    });
  });

  describe("with per-user limits", () => {
    it("counts every bundle of a batch against the queued cap, and refuses one that would pass it whole", async () => {
      const api = injectClient(
        await server({
          maxQueuedBundlesPerUser: 5,
          submissionsPerSecond: 0,
          submissionBurst: 1,
          maxTokensPerUser: 10,
        }),
      );
      const u = await makeUser(getDb());
      expect((await api("POST", "/api/v1/bundles", u.token, item("one"))).status).toBe(201);
      const over = await api("POST", "/api/v1/bundles/batch", u.token, {
        items: Array.from({ length: 5 }, (_, i) => item(`x${i}`)),
      });
      expectError(over, 429, "quota.queued_bundles");
      expect(over.body.error.message).toContain("these 5 bundles and the 1 of yours");
      expect(await countBundles(getDb(), u.uuid)).toBe(1);
      const fits = await api("POST", "/api/v1/bundles/batch", u.token, {
        items: Array.from({ length: 4 }, (_, i) => item(`y${i}`)),
      });
      expect(fits.status).toBe(201);
      expect(await countBundles(getDb(), u.uuid)).toBe(5);
      const admin = await makeUser(getDb(), true);
      const adminBatch = await api("POST", "/api/v1/bundles/batch", admin.token, {
        items: Array.from({ length: 8 }, (_, i) => item(`z${i}`)),
      });
      expect(adminBatch.status).toBe(201);
    });

    it("spends one submission of the rate bucket per batch, whatever its size", async () => {
      const api = injectClient(
        await server({
          maxQueuedBundlesPerUser: 0,
          submissionsPerSecond: 0.001,
          submissionBurst: 2,
          maxTokensPerUser: 10,
        }),
      );
      const u = await makeUser(getDb());
      const batch = { items: Array.from({ length: 20 }, (_, i) => item(`r${i}`)) };
      expect((await api("POST", "/api/v1/bundles/batch", u.token, batch)).status).toBe(201);
      expect((await api("POST", "/api/v1/bundles/batch", u.token, batch)).status).toBe(201);
      const third = await api("POST", "/api/v1/bundles/batch", u.token, batch);
      expectError(third, 429, "quota.rate_limited");
      expect(third.headers["retry-after"]).toMatch(/^\d+$/);
      expect(await countBundles(getDb(), u.uuid)).toBe(40);
    });
  });

  describe("dispatch-cloud submit --batch", () => {
    let apiUrl: string;
    let user: { uuid: string; token: string };
    const cli = async (argv: string[]) => {
      const out: string[] = [];
      const err: string[] = [];
      const io: CliIo = {
        argv,
        env: { DISPATCH_CLOUD_API_URL: apiUrl, DISPATCH_CLOUD_TOKEN: user.token },
        cwd: dir,
        out: (l) => out.push(l),
        err: (l) => err.push(l),
        progress: (l) => err.push(l),
      };
      return { code: await runCli(io), out, err };
    };
    beforeAll(async () => {
      const app = await server();
      apiUrl = await app.listen({ host: "127.0.0.1", port: 0 });
      user = await makeUser(getDb());
    });

    it("submits a JSON-lines file and prints one uuid per line, in order", async () => {
      const file = join(dir, "ok.jsonl");
      await writeFile(file, `${JSON.stringify(item("l1"))}\n\n${JSON.stringify(item("l2"))}\n`);
      const r = await cli(["submit", "--batch", file]);
      expect(r.err).toEqual([]);
      expect(r.code).toBe(0);
      expect(r.out).toHaveLength(2);
      const api = injectClient(apps[apps.length - 1]!);
      const names = [];
      for (const uuid of r.out)
        names.push((await api("GET", `/api/v1/bundles/${uuid}`, user.token)).body.name);
      expect(names).toEqual(["l1", "l2"]);
    });

    it("names the file's line of a bad bundle, and of a line that is not JSON; nothing is submitted", async () => {
      const before = await countBundles(getDb(), user.uuid);
      const bad = join(dir, "bad.jsonl");
      await writeFile(
        bad,
        [item("a"), item("b"), item("c", { priority: 5000 })].map((x) => JSON.stringify(x)).join("\n"),
      );
      const r = await cli(["submit", "--batch", bad]);
      expect(r.code).toBe(1);
      expect(r.out).toEqual([]);
      expect(r.err.join("\n")).toContain(`${bad}:3: priority:`);
      expect(r.err.join("\n")).toContain("[request.invalid_body]");
      const notJson = join(dir, "notjson.jsonl");
      await writeFile(notJson, `${JSON.stringify(item("a"))}\n{oops\n`);
      const r2 = await cli(["submit", "--batch", notJson]);
      expect(r2.code).toBe(2);
      expect(r2.err.join("\n")).toContain(`${notJson}:2: not valid JSON`);
      expect(await countBundles(getDb(), user.uuid)).toBe(before);
    });
  });
});
