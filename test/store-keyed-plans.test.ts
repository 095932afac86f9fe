/**
 * The statements that change bundles found by key (transitions, grouped or not, and the runners' and the
 * scheduler's writes) read only those bundles' rows, however out of date the table's statistics are about how
 * many bundles are queued or running (KEYED_LOCKS, store/transitions.ts). The case: a history of ended bundles was
 * analyzed, then a queue many times larger arrived, and some thousands started, before the next ANALYZE. The rows
 * each statement read are counted by PostgreSQL itself (pg_stat_xact_user_tables, the current transaction's).
 */
import { randomBytes } from "node:crypto";
import { beforeAll, expect, it } from "vitest";
import { setOutputManifest } from "../store/cas-queries.ts";
import type { Db } from "../store/db.ts";
import {
  appendLogChunkByToken,
  recordHeartbeat,
  recordHeartbeatByToken,
  setBundleInputManifests,
  setSchedulingStatus,
  setSchedulingStatuses,
} from "../store/queries.ts";
import { markRunningByTokens, stageBundle, stageBundles, startBundles } from "../store/transitions.ts";
import { createTestUser, describeEachDb, insertTestBundles } from "./db.ts";

const HISTORY = 2000;
const QUEUE = 6000;
const CREATED = 200;
/** Of the queue, this many are running before the statements are timed (the heartbeats' and log chunks' case). */
const RUNNING = 3000;
/** Rows a statement over 20 bundles may read: its own, a few times over (index and heap), nowhere near QUEUE. */
const MAX_ROWS_READ = 200;

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
  let owner = "";
  let staged: string[] = [];
  let created: string[] = [];
  let running: { uuid: string; token: string }[] = [];
  beforeAll(async () => {
    const db = getDb();
    owner = (await createTestUser(db)).uuid;
    await insertTestBundles(db, owner, HISTORY, "submitted");
    await db.query("UPDATE bundles SET state = 'ready'");
    await db.query("ANALYZE bundles");
    // No ANALYZE from here on (PostgreSQL's autovacuum is kept off this table; PGlite has none).
    await db.query("ALTER TABLE bundles SET (autovacuum_enabled = false)");
    staged = await insertTestBundles(db, owner, QUEUE, "submitted");
    created = await insertTestBundles(db, owner, CREATED, "created");
    const starting = staged
      .splice(0, RUNNING)
      .map((uuid) => ({ uuid, token: randomBytes(32).toString("hex") }));
    for (let k = 0; k < RUNNING; k += 500) {
      const part = starting.slice(k, k + 500);
      const items = part.map((r) => ({
        uuid: r.uuid,
        instanceId: "i-1",
        instanceType: "t",
        runnerTokenHash: r.token,
        gpuDevices: [],
      }));
      expect((await startBundles(db, items, "test")).size).toBe(part.length);
      expect(
        (
          await markRunningByTokens(
            db,
            part.map((r) => r.token),
            "test",
          )
        ).size,
      ).toBe(part.length);
    }
    running = starting;
  }, 60_000);

  it("claim, start, staging (of many and of one) and scheduling statuses read only their bundles' rows", async () => {
    const db = getDb();

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

      let started = 0;
      const start = await rowsRead(db, async (tx) => {
        started = (await markRunningByTokens(tx, tokens.slice(0, 10), "test")).size;
      });
      expect(started).toBe(10);
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
  it("a running bundle's heartbeat, log chunk and output, and a queued one's status and inputs, read only its row", async () => {
    const db = getDb();
    for (let round = 0; round < 2; round++) {
      const run = running[round] as { uuid: string; token: string };
      const queued = staged[2000 + round] as string;
      const reads: Record<string, number> = {};
      const outcomes: Record<string, unknown> = {};
      const measure = async (name: string, fn: (tx: Db) => Promise<unknown>) => {
        reads[name] = await rowsRead(db, async (tx) => {
          outcomes[name] = await fn(tx);
        });
      };
      await measure("heartbeat by token", (tx) =>
        recordHeartbeatByToken(tx, run.token, { cpu: 1 }, "pulling"),
      );
      await measure("heartbeat by attempt", (tx) => recordHeartbeat(tx, run.uuid, 1, { cpu: 2 }));
      await measure(
        "log chunk by token",
        async (tx) =>
          (
            await appendLogChunkByToken(tx, {
              tokenHash: run.token,
              stream: "stdout",
              offset: 0,
              data: Buffer.from("hi\n"),
            })
          )?.result.ok,
      );
      await measure("output manifest", (tx) => setOutputManifest(tx, run.uuid, 1, `m${round}/1`, 1));
      await measure("scheduling status", (tx) => setSchedulingStatus(tx, queued, `waiting ${round}`));
      await measure("input manifests", (tx) =>
        setBundleInputManifests(tx, queued, [{ digest: `d${round}/1`, bytes: 1 }]),
      );
      expect(outcomes).toEqual({
        "heartbeat by token": "running",
        "heartbeat by attempt": "running",
        "log chunk by token": true,
        "output manifest": true,
        "scheduling status": true,
        "input manifests": true,
      });
      // Named, so a failure says which statement read too much and how much.
      expect(Object.entries(reads).filter(([, n]) => n >= MAX_ROWS_READ)).toEqual([]);
    }
  });
});
