/**
 * The dispatcher's claims (staged -> starting with a fresh runner token) on a real store: the claims made
 * together (one scheduling pass) go to the database as one statement, each with its own token, instance, devices
 * and price per hour; a claim the statement could not make is asked alone and says why.
 */
import { expect, it } from "vitest";
import { hashToken } from "../../lib/tokens.ts";
import type { Db } from "../../store/db.ts";
import { getBundle } from "../../store/queries.ts";
import { killBundle, stageBundle } from "../../store/transitions.ts";
import type { Bundle } from "../../store/types.ts";
import { createTestBundle, createTestUser, describeEachDb } from "../../test/db.ts";
import { silentLogger as logger } from "../../test/fixtures.ts";
import { createBundleTransitions } from "./transitions.ts";

/** The Db, counting the statements that move bundles to `starting`. */
function counting(db: Db): { db: Db; claims: () => number } {
  let n = 0;
  const wrapped: Db = Object.create(db);
  wrapped.query = (sql, params) => {
    if (sql.includes("state = 'starting'")) n++;
    return db.query(sql, params);
  };
  return { db: wrapped, claims: () => n };
}

describeEachDb("dispatcher claims", (getDb) => {
  it("claims made together are one statement; each gets its own token, instance, devices and price", async () => {
    const owner = (await createTestUser(getDb())).uuid;
    const staged: Bundle[] = [];
    for (let i = 0; i < 6; i++) {
      const b = await createTestBundle(getDb(), owner);
      await stageBundle(getDb(), b.uuid, { actor: "test" });
      staged.push(b);
    }
    // One of them is killed before the pass: its claim cannot be made.
    await killBundle(getDb(), staged[5]!.uuid, { actor: "operator", reason: "changed its mind" });
    const { db, claims } = counting(getDb());
    const applied: string[] = [];
    const transitions = createBundleTransitions({
      db,
      queue: { apply: (b) => applied.push(b.uuid) },
      logger,
    });
    const results = await Promise.all(
      staged.map((b, i) =>
        transitions.claim(b.uuid, {
          instanceId: `i-${i % 2}`,
          instanceType: "small",
          gpuDevices: [i],
          // Each its own price, so a mix-up between the rows of the one statement shows.
          pricePerHour: i === 3 ? null : 0.01 * (i + 1),
        }),
      ),
    );
    // One grouped statement, then the one it did not move, asked alone.
    expect(claims()).toBe(2);
    const tokens = new Set<string>();
    for (const [i, r] of results.slice(0, 5).entries()) {
      if (!r.ok) throw new Error(`claim ${i} refused: ${r.reason}`);
      expect(r.bundle).toMatchObject({
        state: "starting",
        attempt: 1,
        instanceId: `i-${i % 2}`,
        gpuDevices: [i],
        pricePerHour: i === 3 ? null : 0.01 * (i + 1),
      });
      tokens.add(r.token);
      const row = await getDb().query<{ runner_token_hash: string }>(
        "SELECT runner_token_hash FROM bundles WHERE uuid = $1",
        [r.bundle.uuid],
      );
      expect(row.rows[0]?.runner_token_hash).toBe(hashToken(r.token));
    }
    expect(tokens.size).toBe(5);
    expect(results[5]).toMatchObject({ ok: false, reason: "wrong_state", current: { state: "killed" } });
    expect((await getBundle(getDb(), staged[5]!.uuid))?.state).toBe("killed");
    // Every row, moved or not, was applied to the queue.
    expect(applied.sort()).toEqual(staged.map((b) => b.uuid).sort());
  });
});
