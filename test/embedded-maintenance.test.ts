/**
 * The embedded database's autovacuum (store/embedded-maintenance.ts): PGlite never vacuums nor analyzes by
 * itself, so a process holding it does, by PostgreSQL's rules. The rounds run on real databases: PGlite, where
 * they are needed, and PostgreSQL (autovacuum kept off the table), where the same statements must hold.
 */
import { Writable } from "node:stream";
import { afterEach, describe, expect, it } from "vitest";
import { openMigrated } from "../cli/commands/serve.ts";
import { loadConfig } from "../config/load.ts";
import { createLogger } from "../lib/logger.ts";
import { type Db, openDb } from "../store/db.ts";
import {
  type AutovacuumSettings,
  checkpointDue,
  checkpointOnce,
  dueMaintenance,
  maintainOnce,
  startEmbeddedMaintenance,
  type TableActivity,
} from "../store/embedded-maintenance.ts";
import { migrate } from "../store/migrate.ts";
import { createTestUser, describeEachDb, insertTestBundles, type TestDb } from "./db.ts";

/** PostgreSQL's defaults. */
const DEFAULTS: AutovacuumSettings = {
  vacuumThreshold: 50,
  vacuumScaleFactor: 0.2,
  vacuumInsertThreshold: 1000,
  vacuumInsertScaleFactor: 0.2,
  analyzeThreshold: 50,
  analyzeScaleFactor: 0.1,
  freezeMaxAge: 200_000_000,
};

const quiet: TableActivity = {
  schema: "public",
  table: "t",
  rows: 10_000,
  deadRows: 0,
  modifiedSinceAnalyze: 0,
  insertedSinceVacuum: 0,
  xidAge: 1000,
};

describe("what is due, by autovacuum's rules", () => {
  it("vacuums past the dead rows' threshold, analyzes past the changed rows', and leaves a quiet table", () => {
    const due = dueMaintenance(
      [
        quiet,
        { ...quiet, table: "dead", deadRows: 2051 },
        { ...quiet, table: "almost", deadRows: 2050, modifiedSinceAnalyze: 1050 },
        { ...quiet, table: "changed", modifiedSinceAnalyze: 1051 },
        { ...quiet, table: "both", deadRows: 5000, modifiedSinceAnalyze: 5000 },
      ],
      DEFAULTS,
    );
    expect(due.map((s) => [s.table, s.action])).toEqual([
      ["dead", "vacuum"],
      ["changed", "analyze"],
      ["both", "vacuum+analyze"],
    ]);
    expect(due[0]?.reasons).toEqual(["dead rows 2051 > 2050"]);
  });

  it("vacuums a table that only grew (inserts) and one whose transaction ids are old, even with no dead rows", () => {
    const due = dueMaintenance(
      [
        { ...quiet, table: "appended", insertedSinceVacuum: 3001 },
        { ...quiet, table: "old", xidAge: 200_000_001 },
      ],
      DEFAULTS,
    );
    expect(due.map((s) => [s.table, s.action])).toEqual([
      ["appended", "vacuum"],
      ["old", "vacuum"],
    ]);
    expect(due[1]?.reasons[0]).toContain("transaction id age");
  });

  it("never analyzes pg_statistic (ANALYZE writes there), though it may vacuum it", () => {
    const due = dueMaintenance(
      [
        {
          ...quiet,
          schema: "pg_catalog",
          table: "pg_statistic",
          rows: 100,
          deadRows: 500,
          modifiedSinceAnalyze: 500,
        },
      ],
      DEFAULTS,
    );
    expect(due.map((s) => s.action)).toEqual(["vacuum"]);
    expect(
      dueMaintenance(
        [{ ...quiet, schema: "pg_catalog", table: "pg_statistic", modifiedSinceAnalyze: 1e6 }],
        DEFAULTS,
      ),
    ).toEqual([]);
  });

  it("takes a table never analyzed (rows -1) as empty, and a negative insert threshold as no insert rule", () => {
    const due = dueMaintenance([{ ...quiet, rows: -1, deadRows: 51, insertedSinceVacuum: 1_000_000 }], {
      ...DEFAULTS,
      vacuumInsertThreshold: -1,
    });
    expect(due).toEqual([{ schema: "public", table: "t", action: "vacuum", reasons: ["dead rows 51 > 50"] }]);
  });
});

describe("when a checkpoint is due, by the checkpointer's rules", () => {
  const c = { walBytes: 0, ageSeconds: 0, timeoutSeconds: 300, maxWalMiB: 1024, completionTarget: 0.9 };
  it("after max_wal_size / (1 + checkpoint_completion_target) of log, or checkpoint_timeout with some log", () => {
    const bound = (1024 * 2 ** 20) / 1.9;
    expect(checkpointDue({ ...c, walBytes: Math.floor(bound) })).toBeNull();
    expect(checkpointDue({ ...c, walBytes: bound + 1 })).toMatch(/^log written since the last checkpoint/);
    expect(checkpointDue({ ...c, walBytes: 10_000, ageSeconds: 299 })).toBeNull();
    expect(checkpointDue({ ...c, walBytes: 10_000, ageSeconds: 300 })).toBe(
      "last checkpoint 300 s ago >= checkpoint_timeout 300 s",
    );
    // Only the last checkpoint's own record since it: an idle database is not checkpointed again.
    expect(checkpointDue({ ...c, walBytes: 208, ageSeconds: 86_400 })).toBeNull();
  });
});

const ROWS = 2000;

/** The table's counters as the database now reports them (this session's own flushed first). */
async function counters(db: Db, table: string): Promise<{ dead: number; lastVacuum: unknown; rows: number }> {
  await db.query("SELECT pg_stat_force_next_flush()");
  const { rows } = await db.query<{ dead: string; last_vacuum: unknown; rows: number }>(
    `SELECT s.n_dead_tup::text AS dead, s.last_vacuum, c.reltuples::float8 AS rows
     FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid WHERE s.relname = $1`,
    [table],
  );
  const r = rows[0];
  if (r === undefined) throw new Error(`no table ${table}`);
  return { dead: Number(r.dead), lastVacuum: r.last_vacuum, rows: r.rows };
}

const heapSize = async (db: Db) =>
  Number((await db.query<{ n: string }>("SELECT pg_relation_size('bundles')::text AS n")).rows[0]?.n);

describeEachDb("a round of the embedded maintenance", (getDb) => {
  const opened: Db[] = [];
  afterEach(async () => {
    for (const d of opened.splice(0)) await d.close();
  });
  /** One connection, so that the counters a statement leaves are flushed before the next reads them (PG). */
  async function oneConnection(t: TestDb): Promise<Db> {
    if (t.kind === "pglite") return t;
    const d = await openDb(t.url, { maxConnections: 1 });
    opened.push(d);
    // Kept off so that what vacuums the table in this test is the round, not PostgreSQL's own worker.
    await d.query("ALTER TABLE bundles SET (autovacuum_enabled = false)");
    return d;
  }

  it("vacuums the table whose rows were rewritten, leaves the quiet ones, and then has nothing due", async () => {
    const db = await oneConnection(getDb());
    const owner = (await createTestUser(db)).uuid;
    await insertTestBundles(db, owner, ROWS, "submitted");
    await maintainOnce(db);
    for (let round = 0; round < 2; round++) await db.query("UPDATE bundles SET priority = priority + 1");
    expect((await counters(db, "bundles")).dead).toBeGreaterThanOrEqual(ROWS);

    const steps = await maintainOnce(db);
    const bundles = steps.find((s) => s.table === "bundles");
    expect(bundles?.action).toBe("vacuum+analyze");
    expect(bundles?.reasons.join("; ")).toMatch(/^dead rows \d+ > \d+; rows changed since the last analyze/);
    expect(bundles?.ms).toBeGreaterThanOrEqual(0);
    expect(steps.map((s) => s.table)).not.toContain("users");
    const after = await counters(db, "bundles");
    expect(after.dead).toBe(0);
    expect(after.lastVacuum).not.toBeNull();
    expect((await maintainOnce(db)).map((s) => s.table)).not.toContain("bundles");
  });
});

/** A logger at info whose lines, parsed, are kept in `lines`. */
function capturedLogger() {
  const lines: Record<string, unknown>[] = [];
  const logger = createLogger({
    level: "info",
    format: "json",
    destination: new Writable({
      write(chunk, _enc, done) {
        lines.push(JSON.parse(String(chunk)) as Record<string, unknown>);
        done();
      },
    }),
  });
  return { lines, logger };
}

describe("the embedded maintenance on PGlite", () => {
  const opened: Db[] = [];
  afterEach(async () => {
    for (const d of opened.splice(0)) await d.close();
  });
  async function pglite(opts: Parameters<typeof openDb>[1] = {}): Promise<Db> {
    const db = await openDb("pglite:memory:", opts);
    opened.push(db);
    await migrate(db);
    return db;
  }

  it("keeps a table's size bounded under rewrites, which without it grows with each", async () => {
    const db = await pglite();
    const owner = (await createTestUser(db)).uuid;
    await insertTestBundles(db, owner, ROWS, "submitted");
    await maintainOnce(db);
    const start = await heapSize(db);
    for (let round = 0; round < 5; round++) await db.query("UPDATE bundles SET priority = priority + 1");
    const unmaintained = await heapSize(db);
    expect(unmaintained).toBeGreaterThan(3 * start);

    await maintainOnce(db);
    for (let round = 0; round < 10; round++) {
      await db.query("UPDATE bundles SET priority = priority + 1");
      await maintainOnce(db);
    }
    expect(await heapSize(db)).toBeLessThanOrEqual(unmaintained);
  });

  it("analyzes a table that grew since its statistics were taken", async () => {
    const db = await pglite();
    const owner = (await createTestUser(db)).uuid;
    await insertTestBundles(db, owner, 10, "submitted");
    await db.query("ANALYZE bundles");
    await insertTestBundles(db, owner, ROWS, "submitted");
    expect((await counters(db, "bundles")).rows).toBe(10);
    const step = (await maintainOnce(db)).find((s) => s.table === "bundles");
    expect(step?.action).toMatch(/analyze/);
    expect((await counters(db, "bundles")).rows).toBe(ROWS + 10);
  });

  it("runs by itself in serve's database (database.embeddedMaintenanceInterval), and logs what it did", async () => {
    const { lines, logger } = capturedLogger();
    const config = loadConfig();
    const db = await openMigrated(
      { ...config, database: { ...config.database, url: "pglite:memory:", embeddedMaintenanceInterval: 20 } },
      logger,
    );
    opened.push(db);
    const owner = (await createTestUser(db)).uuid;
    await insertTestBundles(db, owner, ROWS, "submitted");
    await db.query("UPDATE bundles SET priority = priority + 1");
    const deadline = Date.now() + 20_000;
    while ((await counters(db, "bundles")).lastVacuum === null && Date.now() < deadline)
      await new Promise((r) => setTimeout(r, 20));
    expect((await counters(db, "bundles")).lastVacuum).not.toBeNull();
    const line = lines.find((l) => l["table"] === "public.bundles");
    expect(line?.["msg"]).toMatch(/^embedded database: table maintained/);
    expect(line?.["level"]).toBe(30);
  });

  it("checkpoints once the log since the last checkpoint passes its bound, which keeps pg_wal from growing", async () => {
    const db = await pglite();
    const owner = (await createTestUser(db)).uuid;
    await insertTestBundles(db, owner, ROWS, "submitted");
    const walFiles = async () =>
      Number((await db.query<{ n: string }>("SELECT count(*)::text AS n FROM pg_ls_waldir()")).rows[0]?.n);
    const rewrite = () => db.query("UPDATE bundles SET priority = priority + 1");
    // PGlite never checkpoints by itself: its log grows with every write.
    const before = await walFiles();
    for (let round = 0; round < 20; round++) await rewrite();
    const grown = await walFiles();
    expect(grown).toBeGreaterThan(before);

    const first = await checkpointOnce(db, { maxWalMiB: 4 });
    expect(first?.reason).toMatch(/^log written since the last checkpoint \d+ bytes > \d+$/);
    for (let round = 0; round < 20; round++) {
      await rewrite();
      await checkpointOnce(db, { maxWalMiB: 4 });
    }
    // As much log again as the first 20 rounds wrote, in the files the checkpoints let it recycle.
    expect(await walFiles()).toBeLessThanOrEqual(grown);
  });

  it("checkpoints after checkpoint_timeout only if something was written since the last one", async () => {
    const db = await pglite();
    await checkpointOnce(db, { timeoutSeconds: 0 });
    expect(await checkpointOnce(db, { timeoutSeconds: 0 })).toBeNull();
    await createTestUser(db);
    expect((await checkpointOnce(db, { timeoutSeconds: 0 }))?.reason).toMatch(/^last checkpoint \d+ s ago/);
    expect(await checkpointOnce(db, { timeoutSeconds: 3600 })).toBeNull();
  });

  it("logs the checkpoints its rounds make", async () => {
    const { lines, logger } = capturedLogger();
    const db = await pglite();
    await createTestUser(db);
    const checkpointed = new Promise<void>((resolve) => {
      const m = startEmbeddedMaintenance(db, {
        intervalMs: 10,
        logger,
        checkpointSettings: { timeoutSeconds: 0 },
        onRound: () => {
          if (lines.some((l) => String(l["msg"]).startsWith("embedded database: checkpoint")))
            void m.stop().then(resolve);
        },
      });
    });
    await checkpointed;
    const line = lines.find((l) => String(l["msg"]).startsWith("embedded database: checkpoint"));
    expect(line?.["reason"]).toMatch(/checkpoint_timeout 0 s$/);
    expect(line?.["level"]).toBe(30);
  });

  it("logs a failed round as a warning and goes on with the next", async () => {
    const db = await openDb("pglite:memory:");
    await db.close();
    const { lines: warnings, logger } = capturedLogger();
    let rounds = 0;
    const failedTwice = new Promise<void>((resolve) => {
      const maintenance = startEmbeddedMaintenance(db, {
        intervalMs: 5,
        logger,
        onRound: () => rounds++,
      });
      const check = setInterval(() => {
        if (warnings.length < 2) return;
        clearInterval(check);
        void maintenance.stop().then(resolve);
      }, 5);
    });
    await failedTwice;
    expect(rounds).toBe(0);
    expect(warnings.every((w) => w["level"] === 40)).toBe(true);
    expect(warnings[0]?.["msg"]).toBe("embedded database: maintenance round failed; the next comes as usual");
  });
});
