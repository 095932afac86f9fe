import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../lib/errors.ts";
import { type Db, lastTimestampParser, sqlState } from "../store/db.ts";
import { listMigrations, migrate } from "../store/migrate.ts";
import {
  bundlesChangedAfterOrIn,
  changedAfterOrInSql,
  countUsers,
  createdBundlesReady,
  createUser,
  dependentsOf,
  findBundleByRunnerTokenHash,
  findLiveToken,
  getBundle,
  getBundleForOwner,
  insertBundle,
  listBundles,
  listBundlesQuery,
  listEvents,
  maxChangeSeq,
  newBundleOf,
  setSchedulingStatus,
  setSchedulingStatuses,
} from "../store/queries.ts";
import {
  failCreated,
  failStaged,
  finishBundle,
  killBundle,
  loseBundle,
  markRunning,
  requeueStarting,
  stageBundle,
  stageBundles,
  startBundle,
} from "../store/transitions.ts";
import { BUNDLE_CHANNEL, type Bundle, type TransitionResult } from "../store/types.ts";
import {
  createTestBundle,
  createTestUser,
  describeEachDb,
  testBundleUuid,
  testNewBundle,
  testUserUuid,
} from "./db.ts";

const start = (db: Db, uuid: string, token = `hash-${uuid}`) =>
  startBundle(db, uuid, {
    instanceId: "i-1",
    instanceType: "m5.large",
    runnerTokenHash: token,
    gpuDevices: [0, 1],
    actor: "dispatcher",
  });

function ok(r: TransitionResult): Bundle {
  if (!r.ok) throw new Error(`transition refused: ${r.reason} (state ${r.current?.state})`);
  return r.bundle;
}

/** A bundle driven to `state` through the real transitions. */
async function bundleIn(
  db: Db,
  owner: string,
  state: "created" | "staged" | "starting" | "running",
  maxAttempts = 3,
): Promise<Bundle> {
  let b = await createTestBundle(db, owner, { maxAttempts });
  if (state === "created") return b;
  b = ok(await stageBundle(db, b.uuid, { actor: "bundle-manager" }));
  if (state === "staged") return b;
  b = ok(await start(db, b.uuid));
  if (state === "starting") return b;
  return ok(await markRunning(db, b.uuid, b.attempt, { actor: "runner" }));
}

describeEachDb("store", (getDb) => {
  let owner: string;
  const db = () => getDb();
  const setup = async () => {
    owner ??= (await createTestUser(db())).uuid;
  };

  describe("migrations", () => {
    it("are idempotent", async () => {
      expect(await migrate(db())).toEqual({ applied: [] });
      expect(await migrate(db())).toEqual({ applied: [] });
      const { rows } = await db().query<{ name: string }>("SELECT name FROM schema_migrations ORDER BY name");
      expect(rows.map((r) => r.name)).toEqual(listMigrations().map((m) => m.name));
      expect(rows[0]?.name).toBe("001_initial.sql");
    });

    it("a failing migration reports store.migration_failed and is not recorded", async () => {
      const bad = [
        { name: "999_broken.sql", sql: "CREATE TABLE half_done (a int); SELECT no_such_function()" },
      ];
      const err = await migrate(db(), bad).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(DispatchCloudError);
      expect(err).toMatchObject({ code: "store.migration_failed" });
      expect((err as Error).message).toContain("999_broken.sql");
      const { rows } = await db().query("SELECT 1 FROM schema_migrations WHERE name = '999_broken.sql'");
      expect(rows).toEqual([]);
      expect((await db().query("SELECT to_regclass('half_done') AS t")).rows).toEqual([{ t: null }]);
    });

    it("refuses an event for a bundle that does not exist, and a delete or rename of a bundle with events", async () => {
      await setup();
      const b = await createTestBundle(db(), owner);
      const event = (uuid: string) =>
        `(${[uuid, "created", "staged", "0", "test"].map((v) => `'${v}'`).join(", ")})`;
      const insertEvents = (...uuids: string[]) =>
        db().query(
          `INSERT INTO bundle_events (bundle_uuid, from_state, to_state, attempt, actor) VALUES ${uuids.map(event).join(", ")}`,
        );
      const count = async () =>
        (await db().query<{ n: number }>("SELECT count(*) AS n FROM bundle_events")).rows[0]!.n;
      const before = await count();
      // One unknown bundle among known ones: the whole statement is refused.
      const ghost = testBundleUuid();
      for (const uuids of [[ghost], [b.uuid, ghost, b.uuid]]) {
        const err = await insertEvents(...uuids).catch((e: unknown) => e);
        expect(sqlState(err)).toBe("23503");
        expect((err as Error).message).toContain(ghost);
      }
      expect(await count()).toBe(before);
      await insertEvents(b.uuid, b.uuid);
      expect(await count()).toBe(before + 2);

      const del = await db()
        .query("DELETE FROM bundles WHERE uuid = $1", [b.uuid])
        .catch((e: unknown) => e);
      expect(sqlState(del)).toBe("23503");
      expect((del as Error).message).toContain(b.uuid);
      const rename = await db()
        .query("UPDATE bundles SET uuid = $2 WHERE uuid = $1", [b.uuid, testBundleUuid()])
        .catch((e: unknown) => e);
      expect(sqlState(rename)).toBe("23503");
      expect((await getBundle(db(), b.uuid))?.uuid).toBe(b.uuid);
      // Other updates of the row are not affected.
      await setSchedulingStatus(db(), b.uuid, "waiting");
      expect((await getBundle(db(), b.uuid))?.schedulingStatus).toBe("waiting");
    });

    it("returns each row's timestamps as Dates of its own, however many rows share one", async () => {
      const { rows } = await db().query<{ t: Date; u: Date }>(
        "SELECT t, t AS u FROM (VALUES ('2026-11-27 10:00:00.123+00'::timestamptz), ('2026-11-27 10:00:00.123+00'), ('2026-11-28 00:00:00+00')) v(t)",
      );
      expect(rows.map((r) => r.t.toISOString())).toEqual([
        "2026-11-27T10:00:00.123Z",
        "2026-11-27T10:00:00.123Z",
        "2026-11-28T00:00:00.000Z",
      ]);
      rows[0]!.t.setTime(0);
      expect(rows[0]!.u.toISOString()).toBe("2026-11-27T10:00:00.123Z");
      expect(rows[1]!.t.toISOString()).toBe("2026-11-27T10:00:00.123Z");
    });

    it("returns int8 as JS numbers", async () => {
      const { rows } = await db().query("SELECT 9007199254740991::int8 AS n, count(*) AS c FROM users");
      expect(typeof rows[0]!["n"]).toBe("number");
      expect(rows[0]!["n"]).toBe(Number.MAX_SAFE_INTEGER);
      expect(typeof rows[0]!["c"]).toBe("number");
    });
  });

  describe("users", () => {
    it("creates, finds by token hash, counts, and refuses a duplicate name", async () => {
      const before = await countUsers(db());
      const uuid = testUserUuid();
      const u = await createUser(db(), {
        uuid,
        name: `alice-${uuid}`,
        isAdmin: true,
        tokenHash: `th-${uuid}`,
      });
      expect(u).toMatchObject({ uuid, name: `alice-${uuid}`, isAdmin: true });
      expect(u.createdAt).toBeInstanceOf(Date);
      // The user's first token is made with it.
      const found = await findLiveToken(db(), `th-${uuid}`, new Date());
      expect(found?.user).toEqual(u);
      expect(found?.token).toMatchObject({ userUuid: uuid, expiresAt: null, revokedAt: null });
      expect(found?.token.id).toMatch(/^zzzzz-tokn-[a-z0-9]{15}$/);
      expect(await findLiveToken(db(), "nope", new Date())).toBeNull();
      expect(await countUsers(db())).toBe(before + 1);
      const err = await createUser(db(), {
        uuid: testUserUuid(),
        name: `alice-${uuid}`,
        isAdmin: false,
        tokenHash: "other",
      }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(DispatchCloudError);
      expect(err).toMatchObject({ code: "user.exists", status: 409 });
      expect(await countUsers(db())).toBe(before + 1);
    });
  });

  describe("bundles", () => {
    it("insertBundle stores every field, writes a created event and returns the row", async () => {
      await setup();
      const uuid = testBundleUuid();
      const input = testNewBundle(owner, {
        name: "full",
        env: { A: "1", B: "two" },
        resources: {
          vcpus: 4,
          ram: 8 * 2 ** 30,
          scratch: 10 ** 10,
          gpu: {
            stack: "cuda",
            deviceCount: 2,
            vram: 2 ** 34,
            driverVersion: "11.10",
            hardwareTarget: ["8.0"],
          },
        },
        limits: { time: 3_600_000, disk: 2 ** 31, network: false },
        preemptible: true,
        priority: 7,
        maxAttempts: 5,
      });
      const b = await insertBundle(db(), uuid, input, "created");
      const { ownerUuid, name, command, image, env, resources, preemptible, priority, limits } = input;
      expect(b).toMatchObject({
        uuid,
        ownerUuid,
        name,
        command,
        image,
        env,
        resources,
        preemptible,
        priority,
      });
      expect(b).toMatchObject({
        limits,
        dependencies: [],
        allowFailedDependencies: false,
        maxAttempts: 5,
        attempt: 0,
        state: "created",
        stateReason: null,
        schedulingStatus: null,
        instanceId: null,
        instanceType: null,
        gpuDevices: [],
        exitCode: null,
        resourceUsage: null,
        costDollars: null,
        stagedAt: null,
        startingAt: null,
        runningAt: null,
        finishedAt: null,
      });
      expect(typeof b.changeSeq).toBe("number");
      expect(b.createdAt).toBeInstanceOf(Date);
      expect(await getBundle(db(), uuid)).toEqual(b);
      const events = await listEvents(db(), uuid);
      expect(events).toHaveLength(1);
      expect(events[0]).toMatchObject({
        bundleUuid: uuid,
        fromState: null,
        toState: "created",
        attempt: 0,
        reason: null,
        actor: `user:${owner}`,
      });
      expect(typeof events[0]!.id).toBe("number");
    });

    it("newBundleOf gives back the request a stored bundle was made from, and inserting it again keeps it", async () => {
      await setup();
      const input = testNewBundle(owner, {
        resources: { vcpus: 2, ram: 2 ** 30, scratch: 2 ** 30, gpu: null, tag: "lab", workersOnly: true },
        imagePinned: `reg.test/tool@sha256:${"ab".repeat(32)}`,
        imageStore: { manifest: `${"c".repeat(64)}/10`, imageId: `sha256:${"d".repeat(64)}`, bytes: 10 },
      });
      const stored = await insertBundle(db(), testBundleUuid(), input, "created");
      expect(newBundleOf(stored)).toEqual(input);
      const again = await insertBundle(db(), testBundleUuid(), newBundleOf(stored), "created");
      expect(newBundleOf(again)).toEqual(input);
      // Without a pinned or stored image the request says so with nulls.
      const plainInput = testNewBundle(owner);
      const plain = await insertBundle(db(), testBundleUuid(), plainInput, "created");
      expect(newBundleOf(plain)).toEqual({ ...plainInput, imagePinned: null, imageStore: null });
    });

    it("getBundleForOwner hides other users' bundles", async () => {
      await setup();
      const other = await createTestUser(db());
      const b = await createTestBundle(db(), owner);
      expect((await getBundleForOwner(db(), b.uuid, owner))?.uuid).toBe(b.uuid);
      expect(await getBundleForOwner(db(), b.uuid, other.uuid)).toBeNull();
      expect(await getBundle(db(), testBundleUuid())).toBeNull();
    });

    it("validates dependencies: they must exist and belong to the same owner", async () => {
      await setup();
      const other = await createTestUser(db());
      const mine = await createTestBundle(db(), owner);
      const theirs = await createTestBundle(db(), other.uuid);
      const missing = testBundleUuid();
      for (const [bad, i] of [
        [missing, 1],
        [theirs.uuid, 1],
      ] as const) {
        const uuid = testBundleUuid();
        const deps = [
          { bundle: mine.uuid, subpath: "", name: "a" },
          { bundle: bad, subpath: "", name: "b" },
        ];
        const err = await insertBundle(
          db(),
          uuid,
          testNewBundle(owner, { dependencies: deps }),
          "created",
        ).catch((e: unknown) => e);
        expect(err).toBeInstanceOf(DispatchCloudError);
        expect(err).toMatchObject({ code: "bundle.invalid_dependency", path: `dependencies[${i}].bundle` });
        expect((err as Error).message).toContain(bad);
        expect(await getBundle(db(), uuid)).toBeNull();
        expect(await listEvents(db(), uuid)).toEqual([]);
      }
      const deps = [
        { bundle: mine.uuid, subpath: "out/x", name: "x" },
        { bundle: mine.uuid, subpath: "", name: "all" },
      ];
      const b = await createTestBundle(db(), owner, { dependencies: deps });
      expect(b.dependencies).toEqual(deps);
      expect(await dependentsOf(db(), mine.uuid)).toEqual([b.uuid]);
    });

    it("lists an owner's bundles newest first with stable keyset pagination and a state filter", async () => {
      const user = await createTestUser(db());
      const made: Bundle[] = [];
      for (let i = 0; i < 7; i++) made.push(await createTestBundle(db(), user.uuid, { name: `b${i}` }));
      await stageBundle(db(), made[2]!.uuid, { actor: "bundle-manager" });
      await stageBundle(db(), made[5]!.uuid, { actor: "bundle-manager" });
      const all = await listBundles(db(), { ownerUuid: user.uuid, limit: 100 });
      expect(all).toHaveLength(7);
      const key = (b: Bundle) => [b.createdAt.getTime(), b.uuid] as const;
      for (let i = 1; i < all.length; i++) {
        const [t0, u0] = key(all[i - 1]!);
        const [t1, u1] = key(all[i]!);
        expect(t0 > t1 || (t0 === t1 && u0 > u1)).toBe(true);
      }
      const paged: Bundle[] = [];
      let after: { createdAt: Date; uuid: string } | null = null;
      for (;;) {
        const page: Bundle[] = await listBundles(db(), { ownerUuid: user.uuid, after, limit: 3 });
        paged.push(...page);
        if (page.length < 3) break;
        const last = page[page.length - 1]!;
        after = { createdAt: last.createdAt, uuid: last.uuid };
      }
      expect(paged.map((b) => b.uuid)).toEqual(all.map((b) => b.uuid));
      const staged = await listBundles(db(), { ownerUuid: user.uuid, states: ["staged"], limit: 10 });
      expect(staged.map((b) => b.uuid).sort()).toEqual([made[2]!.uuid, made[5]!.uuid].sort());
      expect(await listBundles(db(), { ownerUuid: user.uuid, states: [], limit: 10 })).toEqual([]);
    });

    it("reads changes incrementally by change sequence", async () => {
      await setup();
      const seq0 = await maxChangeSeq(db());
      const a = await createTestBundle(db(), owner);
      const b = await createTestBundle(db(), owner);
      await stageBundle(db(), a.uuid, { actor: "bundle-manager" });
      const changed = await bundlesChangedAfterOrIn(db(), seq0, [], 100);
      expect(changed.map((x) => x.uuid)).toEqual([b.uuid, a.uuid]);
      expect(changed[1]!.state).toBe("staged");
      expect(await maxChangeSeq(db())).toBe(changed[1]!.changeSeq);
      expect((await bundlesChangedAfterOrIn(db(), seq0, [], 1)).map((x) => x.uuid)).toEqual([b.uuid]);
      expect(await bundlesChangedAfterOrIn(db(), await maxChangeSeq(db()), [], 100)).toEqual([]);
    });

    it("reads changes by the change_seq index, also from a table filled since its last ANALYZE", async () => {
      await setup();
      // 5,000 rows the planner has no statistics for (no ANALYZE since they went in).
      await db().query(
        `INSERT INTO bundles (uuid, owner_uuid, name, command, image, env, resources, preemptible, priority, limits,
           dependencies, allow_failed_dependencies, max_attempts, state)
         SELECT 'zzzzz-bndl-p' || lpad(i::text, 14, '0'), $1, 'b' || i, '["true"]', 'busybox', '{}',
           '{"vcpus": 1, "ram": 1048576, "scratch": 0, "gpu": null}', false, 1,
           '{"time": null, "disk": null, "network": true}', '[]', false, 3, 'staged'
         FROM generate_series(1, 5000) AS i`,
        [owner],
      );
      const top = await maxChangeSeq(db());
      for (const [sql, params] of [
        [changedAfterOrInSql(false), [top - 2, 5000]],
        [changedAfterOrInSql(true), [top - 2, 5000, [top - 100, top - 50]]],
      ] as const) {
        const { rows } = await db().query<{ "QUERY PLAN": string }>(`EXPLAIN ${sql}`, [...params]);
        const plan = rows.map((r) => r["QUERY PLAN"]).join("\n");
        expect(plan).toMatch(/Index|Bitmap/);
        expect(plan).not.toMatch(/Seq Scan/);
      }
      const read = await bundlesChangedAfterOrIn(db(), top - 2, [top - 100], 10);
      expect(read.map((b) => b.changeSeq)).toEqual([top - 100, top - 1, top]);
    });

    it("lists an owner's failed and killed bundles by their own index, not through the whole history", async () => {
      const user = (await createTestUser(db())).uuid;
      // 3,000 finished bundles, one in a thousand failed or killed, one a second up to now.
      await db().query(
        `INSERT INTO bundles (uuid, owner_uuid, name, command, image, env, resources, preemptible, priority, limits,
           dependencies, allow_failed_dependencies, max_attempts, state, created_at)
         SELECT 'zzzzz-bndl-h' || lpad(i::text, 14, '0'), $1, 'b' || i, '["true"]', 'busybox', '{}',
           '{"vcpus": 1, "ram": 1048576, "scratch": 0, "gpu": null}', false, 1,
           '{"time": null, "disk": null, "network": true}', '[]', false, 3,
           CASE i % 1000 WHEN 1 THEN 'failed' WHEN 2 THEN 'killed' ELSE 'ready' END,
           now() - (3000 - i) * interval '1 second'
         FROM generate_series(1, 3000) AS i`,
        [user],
      );
      await db().query("ANALYZE bundles");
      for (const states of [["failed"], ["killed", "failed"]] as const) {
        const q = listBundlesQuery({ ownerUuid: user, states: [...states], limit: 101 });
        const { rows } = await db().query<{ "QUERY PLAN": string }>(`EXPLAIN ${q.sql}`, q.params);
        expect(rows.map((r) => r["QUERY PLAN"]).join("\n")).toContain("bundles_owner_unsuccessful");
      }
      const failed = await listBundles(db(), { ownerUuid: user, states: ["failed"], limit: 101 });
      expect(failed.map((b) => b.name)).toEqual(["b2001", "b1001", "b1"]);
      const page = await listBundles(db(), { ownerUuid: user, states: ["failed", "killed"], limit: 2 });
      expect(page.map((b) => b.name)).toEqual(["b2002", "b2001"]);
    });

    it("setSchedulingStatus bumps change_seq without an event, and only when the status changes", async () => {
      await setup();
      const b = await bundleIn(db(), owner, "staged");
      expect(await setSchedulingStatus(db(), b.uuid, "waiting for an idle instance of type m5.large")).toBe(
        true,
      );
      const b2 = (await getBundle(db(), b.uuid))!;
      expect(b2.schedulingStatus).toBe("waiting for an idle instance of type m5.large");
      expect(b2.changeSeq).toBeGreaterThan(b.changeSeq);
      expect(await setSchedulingStatus(db(), b.uuid, "waiting for an idle instance of type m5.large")).toBe(
        false,
      );
      expect((await getBundle(db(), b.uuid))!.changeSeq).toBe(b2.changeSeq);
      expect(await listEvents(db(), b.uuid)).toHaveLength(2);
      expect(await setSchedulingStatus(db(), b.uuid, null)).toBe(true);
      expect((await getBundle(db(), b.uuid))!.schedulingStatus).toBeNull();
      expect(await setSchedulingStatus(db(), testBundleUuid(), "x")).toBe(false);
      // Once the bundle has left the queue, a late sentence does not land on it.
      const running = await bundleIn(db(), owner, "running");
      expect(await setSchedulingStatus(db(), running.uuid, "waiting in queue at position 1")).toBe(false);
      expect((await getBundle(db(), running.uuid))!.schedulingStatus).toBeNull();
    });

    it("setSchedulingStatuses writes many in one statement, with the same rules", async () => {
      await setup();
      const a = await bundleIn(db(), owner, "staged");
      const b = await bundleIn(db(), owner, "staged");
      const running = await bundleIn(db(), owner, "running");
      await setSchedulingStatus(db(), b.uuid, "waiting in queue at position 2: at quota");
      const b1 = (await getBundle(db(), b.uuid))!;
      const changed = await setSchedulingStatuses(
        db(),
        [a.uuid, b.uuid, running.uuid, testBundleUuid()],
        ["waiting in queue at position 1: at quota", b1.schedulingStatus!, "late", "unknown"],
      );
      // Only a changed: b's status is unchanged, running has left the queue, the last is not a bundle.
      expect(changed).toBe(1);
      const a2 = (await getBundle(db(), a.uuid))!;
      expect(a2.schedulingStatus).toBe("waiting in queue at position 1: at quota");
      expect(a2.changeSeq).toBeGreaterThan(a.changeSeq);
      expect((await getBundle(db(), b.uuid))!.changeSeq).toBe(b1.changeSeq);
      expect((await getBundle(db(), running.uuid))!.schedulingStatus).toBeNull();
      expect(await listEvents(db(), a.uuid)).toHaveLength(2);
      expect(await setSchedulingStatuses(db(), [], [])).toBe(0);
      await expect(setSchedulingStatuses(db(), [a.uuid], [])).rejects.toThrow(/differ in length/);
    });

    it("createdBundlesReady lists created bundles that can be decided, with their dependencies' states", async () => {
      const user = await createTestUser(db());
      const dep1 = await bundleIn(db(), user.uuid, "running");
      const dep2 = await createTestBundle(db(), user.uuid);
      const dep = (d: Bundle, name: string) => ({ bundle: d.uuid, subpath: "", name });
      const waiting = await createTestBundle(db(), user.uuid, {
        dependencies: [dep(dep1, "a"), dep(dep2, "b")],
      });
      const free = await createTestBundle(db(), user.uuid);
      const mine = async () =>
        (await createdBundlesReady(db(), 1000)).filter((r) => r.bundle.ownerUuid === user.uuid);

      expect((await mine()).map((r) => r.bundle.uuid)).toEqual([dep2.uuid, free.uuid]);
      expect((await mine())[0]!.dependencyStates).toEqual([]);
      expect(await dependentsOf(db(), dep1.uuid)).toEqual([waiting.uuid]);

      ok(await finishBundle(db(), dep1.uuid, dep1.attempt, { exitCode: 0, actor: "runner" }));
      expect((await mine()).map((r) => r.bundle.uuid)).toEqual([dep2.uuid, free.uuid]);
      ok(await killBundle(db(), dep2.uuid, { actor: `user:${user.uuid}`, reason: "no longer needed" }));
      const ready = await mine();
      expect(ready.map((r) => r.bundle.uuid)).toEqual([waiting.uuid, free.uuid]);
      expect(ready[0]!.dependencyStates).toEqual([
        { uuid: dep1.uuid, state: "ready" },
        { uuid: dep2.uuid, state: "killed" },
      ]);
      ok(
        await failCreated(db(), waiting.uuid, {
          actor: "bundle-manager",
          reason: `dependency ${dep2.uuid} killed`,
        }),
      );
      expect(await dependentsOf(db(), dep1.uuid)).toEqual([]);
    });
  });

  describe("transitions", () => {
    /** Runs the transition and checks it wrote exactly one event (from -> to, by actor) and bumped change_seq. */
    async function expectOneEvent(
      before: Bundle,
      run: () => Promise<TransitionResult>,
      expected: { from: string; to: string; actor: string; reason?: string | null },
    ): Promise<Bundle> {
      const n = await eventCount(before.uuid);
      const after = ok(await run());
      expect(after.state).toBe(expected.to);
      expect(after.changeSeq).toBeGreaterThan(before.changeSeq);
      expect(await getBundle(db(), before.uuid)).toEqual(after);
      const events = await listEvents(db(), before.uuid);
      expect(events).toHaveLength(n + 1);
      expect(events[n]).toMatchObject({
        bundleUuid: before.uuid,
        fromState: expected.from,
        toState: expected.to,
        attempt: after.attempt,
        actor: expected.actor,
        reason: expected.reason === undefined ? after.stateReason : expected.reason,
      });
      return after;
    }

    async function eventCount(uuid: string): Promise<number> {
      return (await listEvents(db(), uuid)).length;
    }

    it("created -> staged -> starting -> running -> ready, one event and one change_seq bump each", async () => {
      await setup();
      let b = await createTestBundle(db(), owner);
      const step = async (run: () => Promise<TransitionResult>, from: string, to: string, actor: string) => {
        b = await expectOneEvent(b, run, { from, to, actor });
        return b;
      };
      await setSchedulingStatus(db(), b.uuid, "waiting");
      b = (await getBundle(db(), b.uuid))!;
      const staged = await step(
        () => stageBundle(db(), b.uuid, { actor: "bundle-manager" }),
        "created",
        "staged",
        "bundle-manager",
      );
      expect(staged.stagedAt).toBeInstanceOf(Date);
      expect(staged.schedulingStatus).toBeNull();

      const starting = await step(() => start(db(), b.uuid, "tok-1"), "staged", "starting", "dispatcher");
      expect(starting).toMatchObject({
        attempt: 1,
        instanceId: "i-1",
        instanceType: "m5.large",
        gpuDevices: [0, 1],
      });
      expect(starting.startingAt).toBeInstanceOf(Date);
      expect((await findBundleByRunnerTokenHash(db(), "tok-1"))?.uuid).toBe(b.uuid);

      const running = await step(
        () => markRunning(db(), b.uuid, 1, { actor: "runner" }),
        "starting",
        "running",
        "runner",
      );
      expect(running.runningAt).toBeInstanceOf(Date);
      expect((await findBundleByRunnerTokenHash(db(), "tok-1"))?.uuid).toBe(b.uuid);

      const ready = await step(
        () =>
          finishBundle(db(), b.uuid, 1, {
            exitCode: 0,
            resourceUsage: { cpuSeconds: 12.5, maxRss: 1024 },
            costDollars: 0.25,
            actor: "runner",
          }),
        "running",
        "ready",
        "runner",
      );
      expect(ready).toMatchObject({
        exitCode: 0,
        stateReason: null,
        resourceUsage: { cpuSeconds: 12.5, maxRss: 1024 },
        costDollars: 0.25,
        instanceId: "i-1",
      });
      expect(ready.finishedAt).toBeInstanceOf(Date);
      expect(await findBundleByRunnerTokenHash(db(), "tok-1")).toBeNull();
      expect((await listEvents(db(), b.uuid)).map((e) => [e.fromState, e.toState, e.attempt])).toEqual([
        [null, "created", 0],
        ["created", "staged", 0],
        ["staged", "starting", 1],
        ["starting", "running", 1],
        ["running", "ready", 1],
      ]);
    });

    it("finish with a non-zero exit code or a reason fails the bundle", async () => {
      await setup();
      const a = await bundleIn(db(), owner, "running");
      const fa = await expectOneEvent(
        a,
        () => finishBundle(db(), a.uuid, 1, { exitCode: 2, actor: "runner" }),
        {
          from: "running",
          to: "failed",
          actor: "runner",
          reason: "exited with code 2",
        },
      );
      expect(fa).toMatchObject({ exitCode: 2, stateReason: "exited with code 2" });
      const b = await bundleIn(db(), owner, "running");
      const reason = "time limit exceeded (1h)";
      const fb = ok(
        await finishBundle(db(), b.uuid, 1, { exitCode: 0, failed: true, reason, actor: "runner" }),
      );
      expect(fb).toMatchObject({ state: "failed", stateReason: reason, exitCode: 0 });
      expect(await findBundleByRunnerTokenHash(db(), `hash-${b.uuid}`)).toBeNull();
      const c = await bundleIn(db(), owner, "running");
      const fc = ok(await finishBundle(db(), c.uuid, 1, { exitCode: null, actor: "runner" }));
      expect(fc).toMatchObject({
        state: "failed",
        exitCode: null,
        stateReason: "the runner reported no exit code",
      });
      const d = await bundleIn(db(), owner, "running");
      const note = "outputs were empty";
      const fd = ok(await finishBundle(db(), d.uuid, 1, { exitCode: 0, reason: note, actor: "runner" }));
      expect(fd).toMatchObject({ state: "ready", exitCode: 0, stateReason: note });
    });

    it("created -> failed and staged -> failed", async () => {
      await setup();
      const a = await createTestBundle(db(), owner);
      const reason = "dependency zzzzz-bndl-000000000000000 failed";
      const fa = await expectOneEvent(
        a,
        () => failCreated(db(), a.uuid, { actor: "bundle-manager", reason }),
        {
          from: "created",
          to: "failed",
          actor: "bundle-manager",
          reason,
        },
      );
      expect(fa.finishedAt).toBeInstanceOf(Date);
      const b = await bundleIn(db(), owner, "staged");
      const noFit = "no instance type has 2 GPUs with 40GiB";
      await expectOneEvent(b, () => failStaged(db(), b.uuid, { actor: "dispatcher", reason: noFit }), {
        from: "staged",
        to: "failed",
        actor: "dispatcher",
        reason: noFit,
      });
    });

    it("starting -> staged (requeue) clears the instance and the runner token", async () => {
      await setup();
      const b = await bundleIn(db(), owner, "starting");
      const r = await expectOneEvent(
        b,
        () => requeueStarting(db(), b.uuid, 1, { actor: "dispatcher", reason: "runner never appeared" }),
        { from: "starting", to: "staged", actor: "dispatcher", reason: "runner never appeared" },
      );
      expect(r).toMatchObject({ attempt: 1, instanceId: null, instanceType: null, gpuDevices: [] });
      expect(await findBundleByRunnerTokenHash(db(), `hash-${b.uuid}`)).toBeNull();
      const again = ok(await start(db(), b.uuid, `second-${b.uuid}`));
      expect(again.attempt).toBe(2);
    });

    it("running -> staged when the instance is lost, running -> failed when attempts are exhausted", async () => {
      await setup();
      let b = await bundleIn(db(), owner, "running", 2);
      const lost = b;
      b = await expectOneEvent(
        lost,
        () => loseBundle(db(), lost.uuid, 1, { actor: "dispatcher", reason: "instance i-1 disappeared" }),
        { from: "running", to: "staged", actor: "dispatcher", reason: "instance i-1 disappeared" },
      );
      expect(b).toMatchObject({ attempt: 1, instanceId: null, finishedAt: null });
      expect(await findBundleByRunnerTokenHash(db(), `hash-${b.uuid}`)).toBeNull();
      b = ok(await start(db(), b.uuid, `h2-${b.uuid}`));
      b = ok(await markRunning(db(), b.uuid, 2, { actor: "runner" }));
      const reason = "instance i-1 disappeared (attempts exhausted: 2 of 2)";
      const lost2 = b;
      b = await expectOneEvent(
        lost2,
        () => loseBundle(db(), lost2.uuid, 2, { actor: "dispatcher", reason: "instance i-1 disappeared" }),
        { from: "running", to: "failed", actor: "dispatcher", reason },
      );
      expect(b).toMatchObject({ stateReason: reason, instanceId: null, attempt: 2 });
      expect(b.finishedAt).toBeInstanceOf(Date);
      expect(await findBundleByRunnerTokenHash(db(), `h2-${b.uuid}`)).toBeNull();
    });

    it("startBundle refuses with wrong_attempt once attempts are exhausted", async () => {
      await setup();
      const b = await bundleIn(db(), owner, "starting", 1);
      ok(
        await requeueStarting(db(), b.uuid, 1, { actor: "dispatcher", reason: "runner failed before start" }),
      );
      const n = await eventCount(b.uuid);
      const r = await start(db(), b.uuid);
      expect(r).toMatchObject({
        ok: false,
        reason: "wrong_attempt",
        current: { state: "staged", attempt: 1 },
      });
      expect(await eventCount(b.uuid)).toBe(n);
    });

    it("kills from every non-final state and keeps the instance so it can be stopped", async () => {
      await setup();
      for (const state of ["created", "staged", "starting", "running"] as const) {
        const b = await bundleIn(db(), owner, state);
        const k = await expectOneEvent(
          b,
          () => killBundle(db(), b.uuid, { actor: "operator", reason: "operator kill" }),
          { from: state, to: "killed", actor: "operator", reason: "operator kill" },
        );
        expect(k.finishedAt).toBeInstanceOf(Date);
        expect(k.instanceId).toBe(state === "starting" || state === "running" ? "i-1" : null);
        expect(await findBundleByRunnerTokenHash(db(), `hash-${b.uuid}`)).toBeNull();
      }
    });

    it("refuses wrong states, wrong attempts and unknown bundles without writing anything", async () => {
      await setup();
      const running = await bundleIn(db(), owner, "running");
      const ready = ok(
        await finishBundle(db(), (await bundleIn(db(), owner, "running")).uuid, 1, {
          exitCode: 0,
          actor: "runner",
        }),
      );
      const created = await createTestBundle(db(), owner);
      const cases: [string, Bundle | null, () => Promise<TransitionResult>, string][] = [
        ["stage running", running, () => stageBundle(db(), running.uuid, { actor: "x" }), "wrong_state"],
        ["start created", created, () => start(db(), created.uuid), "wrong_state"],
        [
          "failStaged created",
          created,
          () => failStaged(db(), created.uuid, { actor: "x", reason: "r" }),
          "wrong_state",
        ],
        [
          "failCreated running",
          running,
          () => failCreated(db(), running.uuid, { actor: "x", reason: "r" }),
          "wrong_state",
        ],
        [
          "markRunning running",
          running,
          () => markRunning(db(), running.uuid, 1, { actor: "runner" }),
          "wrong_state",
        ],
        [
          "markRunning created",
          created,
          () => markRunning(db(), created.uuid, 0, { actor: "runner" }),
          "wrong_state",
        ],
        [
          "finish wrong attempt",
          running,
          () => finishBundle(db(), running.uuid, 2, { exitCode: 0, actor: "runner" }),
          "wrong_attempt",
        ],
        [
          "lose wrong attempt",
          running,
          () => loseBundle(db(), running.uuid, 7, { actor: "d", reason: "r" }),
          "wrong_attempt",
        ],
        [
          "requeue running",
          running,
          () => requeueStarting(db(), running.uuid, 1, { actor: "d", reason: "r" }),
          "wrong_state",
        ],
        [
          "kill ready",
          ready,
          () => killBundle(db(), ready.uuid, { actor: "operator", reason: "r" }),
          "wrong_state",
        ],
        [
          "finish ready",
          ready,
          () => finishBundle(db(), ready.uuid, 1, { exitCode: 1, actor: "runner" }),
          "wrong_state",
        ],
        [
          "kill unknown",
          null,
          () => killBundle(db(), testBundleUuid(), { actor: "operator", reason: "r" }),
          "not_found",
        ],
        [
          "markRunning unknown",
          null,
          () => markRunning(db(), testBundleUuid(), 1, { actor: "runner" }),
          "not_found",
        ],
      ];
      for (const [label, before, run, reason] of cases) {
        const n = before ? await eventCount(before.uuid) : 0;
        const r = await run();
        expect({ label, ok: r.ok, reason: r.ok ? null : r.reason }).toEqual({ label, ok: false, reason });
        if (!r.ok && before) {
          const now = (await getBundle(db(), before.uuid))!;
          expect(r.current).toEqual(now);
          expect(now.changeSeq).toBe(before.changeSeq);
          expect(await eventCount(before.uuid)).toBe(n);
        }
        if (!r.ok && !before) expect(r.current).toBeNull();
      }
      const s = await bundleIn(db(), owner, "starting");
      const wrong = await markRunning(db(), s.uuid, 5, { actor: "runner" });
      expect(wrong).toMatchObject({
        ok: false,
        reason: "wrong_attempt",
        current: { state: "starting", attempt: 1 },
      });
    });

    it("NOTIFYs '<uuid> <state> <changeSeq>' on insert and on every transition", async () => {
      await setup();
      const payloads: string[] = [];
      let wake: (() => void) | undefined;
      const unlisten = await db().listen(BUNDLE_CHANNEL, (p) => {
        payloads.push(p);
        wake?.();
      });
      const waitFor = async (n: number) => {
        const deadline = Date.now() + 5000;
        while (payloads.length < n) {
          if (Date.now() > deadline)
            throw new Error(`expected ${n} notifications, got ${payloads.join(" | ")}`);
          await new Promise<void>((resolve) => {
            wake = resolve;
            setTimeout(resolve, 50);
          });
        }
      };
      try {
        const b = await createTestBundle(db(), owner);
        const s = ok(await stageBundle(db(), b.uuid, { actor: "bundle-manager" }));
        await setSchedulingStatus(db(), b.uuid, "waiting"); // no notification
        const k = ok(await killBundle(db(), b.uuid, { actor: "operator", reason: "test" }));
        await stageBundle(db(), b.uuid, { actor: "bundle-manager" }); // refused: no notification
        await waitFor(3);
        const mine = payloads.filter((p) => p.startsWith(`${b.uuid} `));
        expect(mine).toEqual([
          `${b.uuid} created ${b.changeSeq}`,
          `${b.uuid} staged ${s.changeSeq}`,
          `${b.uuid} killed ${k.changeSeq}`,
        ]);
      } finally {
        await unlisten();
      }
      const count = payloads.length;
      await createTestBundle(db(), owner);
      await new Promise((r) => setTimeout(r, 100));
      expect(payloads.length).toBe(count);
    });
  });

  describe("stageBundles", () => {
    it("stages the created bundles of a page in one statement, each with its reason and event; leaves the others", async () => {
      const owner = (await createTestUser(db())).uuid;
      const a = await createTestBundle(db(), owner);
      const b = await createTestBundle(db(), owner);
      const gone = await createTestBundle(db(), owner);
      ok(await killBundle(db(), gone.uuid, { actor: "operator", reason: "test" }));
      const moved = await stageBundles(
        db(),
        [
          { uuid: a.uuid, reason: null },
          { uuid: b.uuid, reason: "allowFailedDependencies: x" },
          { uuid: gone.uuid, reason: null },
          { uuid: testBundleUuid(), reason: null },
        ],
        "bundle-manager",
      );
      expect(moved.map((m) => m.uuid).sort()).toEqual([a.uuid, b.uuid].sort());
      const after = await getBundle(db(), b.uuid);
      expect(after).toMatchObject({ state: "staged", stateReason: "allowFailedDependencies: x" });
      expect(after!.stagedAt).not.toBeNull();
      expect((await getBundle(db(), gone.uuid))!.state).toBe("killed");
      const events = await listEvents(db(), b.uuid);
      expect(events.map((e) => [e.fromState, e.toState, e.actor])).toEqual([
        [null, "created", `user:${owner}`],
        ["created", "staged", "bundle-manager"],
      ]);
      expect(await stageBundles(db(), [{ uuid: a.uuid, reason: null }], "bundle-manager")).toEqual([]);
    });

    it("gives a staged bundle its dependencies' output manifests (once each) as its inputs, for locality", async () => {
      const owner = (await createTestUser(db())).uuid;
      const dep = await createTestBundle(db(), owner);
      const plain = await createTestBundle(db(), owner);
      const digest = `${"ab".repeat(32)}/120`;
      await db().query("UPDATE bundles SET output_manifest = $2, output_bytes = 5000 WHERE uuid = $1", [
        dep.uuid,
        digest,
      ]);
      const uuid = testBundleUuid();
      const twice = [
        { bundle: dep.uuid, subpath: "", name: "a" },
        { bundle: dep.uuid, subpath: "x", name: "b" },
      ];
      await insertBundle(db(), uuid, testNewBundle(owner, { dependencies: twice }), "created");
      await stageBundles(
        db(),
        [
          { uuid, reason: null },
          { uuid: plain.uuid, reason: null },
        ],
        "bundle-manager",
      );
      expect((await getBundle(db(), uuid))!.inputManifests).toEqual([{ digest, bytes: 5000 }]);
      expect((await getBundle(db(), plain.uuid))!.inputManifests).toBeUndefined();
    });
  });

  describe("transactions", () => {
    it("roll back on error, and outside queries never see inside a transaction", async () => {
      await setup();
      const before = await countUsers(db());
      let inside = -1;
      const tx = db()
        .transaction(async (t) => {
          await createTestUser(t);
          inside = await countUsers(t);
          await new Promise((r) => setTimeout(r, 100));
          throw new Error("roll back");
        })
        .catch((e: unknown) => e);
      await new Promise((r) => setTimeout(r, 20));
      const outside = await countUsers(db());
      expect(await tx).toMatchObject({ message: "roll back" });
      expect(inside).toBe(before + 1);
      expect(outside).toBe(before);
      expect(await countUsers(db())).toBe(before);
    });

    it("nested transactions are savepoints", async () => {
      const before = await countUsers(db());
      await db().transaction(async (t) => {
        await createTestUser(t);
        await t
          .transaction(async (t2) => {
            await createTestUser(t2);
            throw new Error("inner");
          })
          .catch(() => {});
      });
      expect(await countUsers(db())).toBe(before + 1);
    });
  });
});

describe("lastTimestampParser", () => {
  it("parses a repeated text once and returns a Date of its own each time; keeps no invalid value", () => {
    let calls = 0;
    const parse = lastTimestampParser((text) => {
      calls++;
      if (text === "infinity") return Number.POSITIVE_INFINITY;
      return new Date(text);
    });
    const a = parse("2026-11-27T10:00:00.123Z") as Date;
    const b = parse("2026-11-27T10:00:00.123Z") as Date;
    expect(calls).toBe(1);
    expect(b).not.toBe(a);
    expect(b.getTime()).toBe(a.getTime());
    a.setTime(0);
    expect((parse("2026-11-27T10:00:00.123Z") as Date).toISOString()).toBe("2026-11-27T10:00:00.123Z");
    expect(parse("infinity")).toBe(Number.POSITIVE_INFINITY);
    expect(parse("infinity")).toBe(Number.POSITIVE_INFINITY);
    expect(Number.isNaN((parse("not a time") as Date).getTime())).toBe(true);
    expect(Number.isNaN((parse("not a time") as Date).getTime())).toBe(true);
    expect(calls).toBe(5);
    expect((parse("2026-11-28T00:00:00Z") as Date).toISOString()).toBe("2026-11-28T00:00:00.000Z");
    expect(calls).toBe(6);
  });
});
