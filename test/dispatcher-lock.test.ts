import { expect, it } from "vitest";
import { openDb } from "../store/db.ts";
import { describeEachDb } from "./db.ts";

describeEachDb("advisory locks", (getDb) => {
  it("lets one holder have a key at a time, and the next one after release", async () => {
    const db = getDb();
    const first = await db.tryAdvisoryLock("dispatch-cloud:test-a");
    expect(first).not.toBeNull();
    expect(await db.tryAdvisoryLock("dispatch-cloud:test-a")).toBeNull();
    const other = await db.tryAdvisoryLock("dispatch-cloud:test-b");
    expect(other).not.toBeNull();
    await first?.release();
    await expect(first?.lost).resolves.toBeUndefined();
    const second = await db.tryAdvisoryLock("dispatch-cloud:test-a");
    expect(second).not.toBeNull();
    await second?.release();
    await other?.release();
    await first?.release(); // idempotent
  });

  it("refuses inside a transaction", async () => {
    await expect(getDb().transaction((tx) => tx.tryAdvisoryLock("x"))).rejects.toThrow(/transaction/);
  });
});

describeEachDb("advisory locks across connections", (getDb) => {
  it("is free again once the holder's connection dies (PostgreSQL) or its Db closes (PGlite)", async () => {
    const db = getDb();
    const key = "dispatch-cloud:test-crash";
    if (db.kind === "pg") {
      // Two processes' worth of pools on the same database.
      const a = await openDb(db.url);
      const b = await openDb(db.url);
      try {
        const lock = await a.tryAdvisoryLock(key);
        expect(lock).not.toBeNull();
        expect(await b.tryAdvisoryLock(key)).toBeNull();
        const { rows } = await db.query<{ pid: number }>(
          "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objid = (hashtext($1)::bigint & 4294967295)::oid",
          [key],
        );
        expect(rows).toHaveLength(1);
        await db.query("SELECT pg_terminate_backend($1)", [rows[0]?.pid]);
        await lock?.lost; // the holder learns it lost the lock
        const taken = await b.tryAdvisoryLock(key);
        expect(taken).not.toBeNull();
        await taken?.release();
        await lock?.release();
      } finally {
        await a.close();
        await b.close();
      }
    } else {
      const lock = await db.tryAdvisoryLock(key);
      expect(await db.tryAdvisoryLock(key)).toBeNull();
      await lock?.release();
      expect(await db.tryAdvisoryLock(key)).not.toBeNull();
    }
  });
});
