/**
 * The statements that move a list of bundles read only those bundles' rows, however out of date the table's
 * statistics are about how many bundles are queued (KEYED_LOCKS, store/transitions.ts). The case: a history of
 * ended bundles was analyzed, then a queue many times larger arrived before the next ANALYZE. The rows each
 * statement read are counted by PostgreSQL itself (pg_stat_xact_user_tables, the current transaction's counts).
 */
import { randomBytes } from "node:crypto";
import { expect, it } from "vitest";
import type { Db } from "../store/db.ts";
import { insertBundles, setSchedulingStatuses } from "../store/queries.ts";
import { markRunningByTokens, stageBundle, stageBundles, startBundles } from "../store/transitions.ts";
import { createTestUser, describeEachDb, testBundleUuid, testNewBundle } from "./db.ts";

const HISTORY = 2000;
const QUEUE = 6000;
const CREATED = 200;
/** Rows a statement over 20 bundles may read: its own, a few times over (index and heap), nowhere near QUEUE. */
const MAX_ROWS_READ = 200;

async function insertMany(
  db: Db,
  owner: string,
  n: number,
  state: "submitted" | "created",
): Promise<string[]> {
  const uuids: string[] = [];
  for (let k = 0; k < n; k += 1000) {
    const items = Array.from({ length: Math.min(1000, n - k) }, () => ({
      uuid: testBundleUuid(),
      bundle: testNewBundle(owner),
    }));
    await insertBundles(db, owner, items, state);
    uuids.push(...items.map((i) => i.uuid));
  }
  return uuids;
}

/** Runs `fn` in a transaction and answers how many rows of `bundles` it read (sequentially or by index). */
async function rowsRead(db: Db, fn: (tx: Db) => Promise<unknown>): Promise<number> {
  return db.transaction(async (tx) => {
    const before = await readCount(tx);
    await fn(tx);
    return (await readCount(tx)) - before;
  });
}

async function readCount(tx: Db): Promise<number> {
  const { rows } = await tx.query<{ n: string }>(
    `SELECT (coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0))::text AS n
     FROM pg_stat_xact_user_tables WHERE relname = 'bundles'`,
  );
  return Number(rows[0]?.n ?? 0);
}

describeEachDb("transitions on a queue that grew after ANALYZE", (getDb) => {
  it("claim, start, staging (of many and of one) and scheduling statuses read only their bundles' rows", async () => {
    const db = getDb();
    const owner = (await createTestUser(db)).uuid;
    await insertMany(db, owner, HISTORY, "submitted");
    await db.query("UPDATE bundles SET state = 'ready'");
    await db.query("ANALYZE bundles");
    // No ANALYZE from here on (PostgreSQL's autovacuum is kept off this table; PGlite has none).
    await db.query("ALTER TABLE bundles SET (autovacuum_enabled = false)");
    const staged = await insertMany(db, owner, QUEUE, "submitted");
    const created = await insertMany(db, owner, CREATED, "created");

    // Each statement runs twice: on PostgreSQL a prepared statement's plan may change after its first runs.
    for (let round = 0; round < 2; round++) {
      const uuids = staged.slice(round * 20, round * 20 + 20);
      const tokens = uuids.map(() => randomBytes(32).toString("hex"));
      let claimed = 0;
      const claim = await rowsRead(db, async (tx) => {
        claimed = (
          await startBundles(
            tx,
            uuids.map((uuid, i) => ({
              uuid,
              instanceId: `i-${i % 2}`,
              instanceType: "t",
              runnerTokenHash: tokens[i] as string,
              gpuDevices: [],
            })),
            "test",
          )
        ).size;
      });
      expect(claimed).toBe(20);
      expect(claim).toBeLessThan(MAX_ROWS_READ);

      let running = 0;
      const start = await rowsRead(db, async (tx) => {
        running = (await markRunningByTokens(tx, tokens.slice(0, 10), "test")).size;
      });
      expect(running).toBe(10);
      expect(start).toBeLessThan(MAX_ROWS_READ);

      let stagedNow = 0;
      const stage = await rowsRead(db, async (tx) => {
        const items = created.slice(round * 20, round * 20 + 20).map((uuid) => ({ uuid, reason: null }));
        stagedNow = (await stageBundles(tx, items, "test")).length;
      });
      expect(stagedNow).toBe(20);
      expect(stage).toBeLessThan(MAX_ROWS_READ);

      let one = false;
      const single = await rowsRead(db, async (tx) => {
        one = (await stageBundle(tx, created[100 + round] as string, { actor: "test" })).ok;
      });
      expect(one).toBe(true);
      expect(single).toBeLessThan(MAX_ROWS_READ);

      let changed = 0;
      const queued = staged.slice(1000 + round * 20, 1020 + round * 20);
      const statuses = await rowsRead(db, async (tx) => {
        changed = await setSchedulingStatuses(
          tx,
          [...queued, uuids[0] as string],
          [...queued.map(() => `waiting ${round}`), "not queued: left alone"],
        );
      });
      expect(changed).toBe(20);
      expect(statuses).toBeLessThan(MAX_ROWS_READ);
    }
  });
});
