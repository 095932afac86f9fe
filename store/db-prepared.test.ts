/**
 * On PostgreSQL statements marked prepared() run as named prepared statements (store/db.ts): each text is parsed
 * once per connection, and a statement whose table changed under it is prepared again instead of failing.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { openTestDb, type TestDb } from "../test/db.ts";
import { type Db, openDb, prepared } from "./db.ts";

describe("prepared statements on PostgreSQL", () => {
  let test: TestDb;
  /** One connection, so every statement below runs on the session whose prepared statements are listed. */
  let db: Db;
  beforeAll(async () => {
    test = await openTestDb("pg");
    db = await openDb(test.url, { maxConnections: 1 });
    await db.query("CREATE TABLE prep_probe (id int PRIMARY KEY, a text)");
    await db.query("INSERT INTO prep_probe VALUES (1, 'one'), (2, 'two')");
  });
  afterAll(async () => {
    await db?.close();
    await test?.close();
  });

  const preparedCount = async (like: string) =>
    (
      await db.query<{ n: number }>(
        "SELECT count(*)::int AS n FROM pg_prepared_statements WHERE statement LIKE $1",
        [like],
      )
    ).rows[0]!.n;

  it("prepares a statement with parameters once and runs it again by name", async () => {
    for (const id of [1, 2, 1, 2, 1, 2, 1]) {
      const { rows } = await db.query<{ a: string }>(prepared("SELECT a FROM prep_probe WHERE id = $1"), [
        id,
      ]);
      expect(rows).toEqual([{ a: id === 1 ? "one" : "two" }]);
    }
    expect(await preparedCount("%SELECT a FROM prep_probe WHERE id = $1")).toBe(1);
    // Unmarked, a statement is planned afresh for its values (and without parameters it keeps the simple
    // protocol, several statements allowed).
    await db.query("SELECT a FROM prep_probe WHERE id > $1", [0]);
    await db.query("SELECT 1 FROM prep_probe; SELECT 2 FROM prep_probe");
    expect(await preparedCount("%FROM prep_probe WHERE id > $1")).toBe(0);
    expect(await preparedCount("%SELECT 1 FROM prep_probe%")).toBe(0);
  });

  it("survives a column added under a prepared SELECT *, outside and inside a transaction", async () => {
    const sql = prepared("SELECT * FROM prep_probe WHERE id = $1");
    expect((await db.query(sql, [1])).rows).toEqual([{ id: 1, a: "one" }]);
    await db.query("ALTER TABLE prep_probe ADD COLUMN b text DEFAULT 'x'");
    expect((await db.query(sql, [1])).rows).toEqual([{ id: 1, a: "one", b: "x" }]);

    const inTx = prepared("SELECT * FROM prep_probe WHERE id = $1 AND true");
    await db.transaction((tx) => tx.query(inTx, [2]));
    await db.query("ALTER TABLE prep_probe ADD COLUMN c int DEFAULT 7");
    let runs = 0;
    const rows = await db.transaction(async (tx) => {
      runs++;
      return (await tx.query(inTx, [2])).rows;
    });
    expect(rows).toEqual([{ id: 2, a: "two", b: "x", c: 7 }]);
    expect(runs).toBe(2);
  });
});
