/**
 * Races between transitions, on real PostgreSQL with separate pools (real concurrent connections), and the
 * same assertions on PGlite (where the queue serialises them).
 */
import pg from "pg";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type Db, openDb } from "../store/db.ts";
import { listMigrations, migrate } from "../store/migrate.ts";
import { getBundle, listEvents } from "../store/queries.ts";
import {
  finishBundle,
  killBundle,
  loseBundle,
  markRunning,
  stageBundle,
  startBundle,
} from "../store/transitions.ts";
import type { Bundle, BundleEvent, TransitionResult } from "../store/types.ts";
import {
  createTestBundle,
  createTestUser,
  describeEachDb,
  openTestDb,
  type TestDb,
  testPgUrl,
  useRacingDbs,
} from "./db.ts";

const N = 50;

function ok(r: TransitionResult): Bundle {
  if (!r.ok) throw new Error(`transition refused: ${r.reason}`);
  return r.bundle;
}

const startArgs = (token: string) => ({
  instanceId: `i-${token}`,
  instanceType: "m5.large",
  runnerTokenHash: token,
  gpuDevices: [],
  actor: "dispatcher",
});

describeEachDb("store concurrency", (getDb) => {
  const racing = useRacingDbs(getDb, 25);
  let a: Db;
  let b: Db;
  let owner: string;
  beforeAll(async () => {
    ({ a, b } = racing());
    owner = (await createTestUser(getDb())).uuid;
  });

  async function bundlesIn(state: "staged" | "starting" | "running", maxAttempts = 3): Promise<Bundle[]> {
    const db = getDb();
    const out: Bundle[] = [];
    for (let i = 0; i < N; i++) {
      let x = await createTestBundle(db, owner, { maxAttempts });
      x = ok(await stageBundle(db, x.uuid, { actor: "bundle-manager" }));
      if (state !== "staged") x = ok(await startBundle(db, x.uuid, startArgs(`setup-${x.uuid}`)));
      if (state === "running") x = ok(await markRunning(db, x.uuid, 1, { actor: "runner" }));
      out.push(x);
    }
    return out;
  }

  /** Events written after the bundle reached `since` (its state when the race began). */
  async function eventsAfter(x: Bundle): Promise<BundleEvent[]> {
    const all = await listEvents(getDb(), x.uuid);
    return all.filter((e) => e.id > Math.max(...all.filter((f) => f.toState === x.state).map((f) => f.id)));
  }

  it(`kill racing markRunning on ${N} bundles: outcomes are consistent, one event per success`, async () => {
    const bundles = await bundlesIn("starting");
    const results = await Promise.all(
      bundles.map((x) =>
        Promise.all([
          killBundle(a, x.uuid, { actor: "operator", reason: "race" }),
          markRunning(b, x.uuid, 1, { actor: "runner" }),
        ]),
      ),
    );
    for (const [i, x] of bundles.entries()) {
      const [kill, run] = results[i]!;
      expect(kill.ok).toBe(true);
      const events = (await eventsAfter(x)).map((e) => `${e.fromState}->${e.toState}:${e.actor}`);
      if (run.ok) {
        expect(events).toEqual(["starting->running:runner", "running->killed:operator"]);
      } else {
        expect(run.reason).toBe("wrong_state");
        expect(run.current?.state).toBe("killed");
        expect(events).toEqual(["starting->killed:operator"]);
      }
      expect((await getBundle(getDb(), x.uuid))?.state).toBe("killed");
    }
  });

  it(`two kills racing on ${N} bundles: exactly one winner each`, async () => {
    const bundles = await bundlesIn("running");
    const results = await Promise.all(
      bundles.map((x) =>
        Promise.all([
          killBundle(a, x.uuid, { actor: "operator", reason: "a" }),
          killBundle(b, x.uuid, { actor: `user:${owner}`, reason: "b" }),
        ]),
      ),
    );
    for (const [i, x] of bundles.entries()) {
      const rs = results[i]!;
      expect(rs.filter((r) => r.ok)).toHaveLength(1);
      expect(rs.find((r) => !r.ok)).toMatchObject({ reason: "wrong_state", current: { state: "killed" } });
      const events = await eventsAfter(x);
      const winner = rs.find((r) => r.ok) as { bundle: Bundle };
      expect(events).toHaveLength(1);
      expect(events[0]).toMatchObject({
        fromState: "running",
        toState: "killed",
        reason: winner.bundle.stateReason,
      });
    }
  });

  it(`two runners calling start for the same attempt on ${N} bundles: exactly one winner each`, async () => {
    const bundles = await bundlesIn("starting");
    const results = await Promise.all(
      bundles.map((x) =>
        Promise.all([
          markRunning(a, x.uuid, 1, { actor: "runner" }),
          markRunning(b, x.uuid, 1, { actor: "runner" }),
        ]),
      ),
    );
    for (const [i, x] of bundles.entries()) {
      expect(results[i]!.filter((r) => r.ok)).toHaveLength(1);
      expect(results[i]!.find((r) => !r.ok)).toMatchObject({ reason: "wrong_state" });
      expect((await eventsAfter(x)).map((e) => e.toState)).toEqual(["running"]);
    }
  });

  it(`two dispatchers starting the same staged bundle on ${N} bundles: exactly one winner each`, async () => {
    const bundles = await bundlesIn("staged");
    const results = await Promise.all(
      bundles.map((x) =>
        Promise.all([
          startBundle(a, x.uuid, startArgs(`a-${x.uuid}`)),
          startBundle(b, x.uuid, startArgs(`b-${x.uuid}`)),
        ]),
      ),
    );
    for (const [i, x] of bundles.entries()) {
      const rs = results[i]!;
      const winners = rs.filter((r) => r.ok);
      expect(winners).toHaveLength(1);
      expect(rs.find((r) => !r.ok)).toMatchObject({ reason: "wrong_state", current: { state: "starting" } });
      const now = (await getBundle(getDb(), x.uuid))!;
      const won = (winners[0] as { bundle: Bundle }).bundle;
      expect(now).toMatchObject({ attempt: 1, instanceId: won.instanceId });
      const events = await eventsAfter(x);
      expect(events.map((e) => [e.fromState, e.toState, e.attempt])).toEqual([["staged", "starting", 1]]);
    }
  });

  it(`finish, lose and kill racing on ${N} running bundles: exactly one winner each`, async () => {
    const bundles = await bundlesIn("running");
    const results = await Promise.all(
      bundles.map((x) =>
        Promise.all([
          finishBundle(a, x.uuid, 1, { exitCode: 0, actor: "runner" }),
          loseBundle(b, x.uuid, 1, { actor: "dispatcher", reason: "instance lost" }),
          killBundle(getDb(), x.uuid, { actor: "operator", reason: "kill" }),
        ]),
      ),
    );
    for (const [i, x] of bundles.entries()) {
      const rs = results[i]!;
      const events = await eventsAfter(x);
      const [finish, lose, kill] = rs;
      if (lose!.ok) {
        // Requeued (running -> staged), after which a kill may still win over the staged bundle.
        expect(finish!.ok).toBe(false);
        expect(events.map((e) => e.toState)).toEqual(kill!.ok ? ["staged", "killed"] : ["staged"]);
      } else {
        expect(rs.filter((r) => r.ok)).toHaveLength(1);
        expect(events).toHaveLength(1);
        expect(events[0]!.toState).toBe(finish!.ok ? "ready" : "killed");
      }
    }
  });
});

describe("store concurrency on PostgreSQL only", () => {
  let db: TestDb;
  beforeAll(async () => {
    db = await openTestDb("pg");
  });
  afterAll(async () => {
    await db?.close();
  });

  it("two processes migrating an empty database at once apply each migration once", async () => {
    const admin = new pg.Client({ connectionString: testPgUrl() });
    await admin.connect();
    const name = `dc_test_migrate_${process.pid}_${Date.now()}`;
    const url = new URL(db.url);
    url.pathname = `/${name}`;
    try {
      await admin.query(`CREATE DATABASE "${name}"`);
      const dbs = await Promise.all([1, 2, 3].map(() => openDb(url.toString(), { maxConnections: 2 })));
      try {
        const results = await Promise.all(dbs.map((d) => migrate(d)));
        expect(results.flatMap((r) => r.applied).sort()).toEqual(listMigrations().map((m) => m.name));
        expect(await migrate(dbs[0]!)).toEqual({ applied: [] });
      } finally {
        await Promise.all(dbs.map((d) => d.close()));
      }
    } finally {
      await admin.query(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
      await admin.end();
    }
  });

  it("the LISTEN connection reconnects after the server drops it", async () => {
    const listener = await openDb(db.url, { maxConnections: 1 });
    const got: string[] = [];
    const unlisten = await listener.listen("dc_test_reconnect", (p) => got.push(p));
    const waitFor = async (payload: string, send: boolean) => {
      const deadline = Date.now() + 10_000;
      while (!got.includes(payload)) {
        if (Date.now() > deadline) throw new Error(`no notification ${payload}; got ${got.join(",")}`);
        if (send) await db.query("SELECT pg_notify('dc_test_reconnect', $1)", [payload]);
        await new Promise((r) => setTimeout(r, 50));
      }
    };
    try {
      await db.query("SELECT pg_notify('dc_test_reconnect', 'before')");
      await waitFor("before", false);
      const { rowCount } = await db.query(
        `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND query LIKE 'LISTEN%' AND pid <> pg_backend_pid()`,
      );
      expect(rowCount).toBe(1);
      await waitFor("after", true);
    } finally {
      await unlisten();
      await listener.close();
    }
  });

  it("transactions that deadlock are retried until both commit", async () => {
    const u1 = await createTestUser(db);
    const u2 = await createTestUser(db);
    let arrived = 0;
    let release: () => void = () => {};
    const bothLocked = new Promise<void>((resolve) => {
      release = resolve;
    });
    let runs = 0;
    const swap = (first: string, second: string) =>
      db.transaction(async (tx) => {
        runs++;
        await tx.query("UPDATE users SET is_admin = NOT is_admin WHERE uuid = $1", [first]);
        if (++arrived === 2) release();
        await bothLocked; // the first run of each holds one lock and waits for the other's
        await tx.query("UPDATE users SET is_admin = NOT is_admin WHERE uuid = $1", [second]);
      });
    await Promise.all([swap(u1.uuid, u2.uuid), swap(u2.uuid, u1.uuid)]);
    expect(runs).toBe(3);
    const { rows } = await db.query<{ is_admin: boolean }>(
      "SELECT is_admin FROM users WHERE uuid = ANY($1::text[])",
      [[u1.uuid, u2.uuid]],
    );
    expect(rows.map((r) => r.is_admin)).toEqual([false, false]);
  });
});
