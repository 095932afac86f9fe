/**
 * find-missing of 10,000 digests (store/cas-queries.ts findMissing) on PostgreSQL (DISPATCH_CLOUD_TEST_PG_URL)
 * and PGlite, against a store of 100,000 blobs of which the caller may read half: prints the time of each
 * round (the first round plans the statement). Target: <= 50 ms on PostgreSQL. Figures only, nothing asserted.
 *
 *   npm run bench:cas -- [--blobs 100000] [--rounds 5]
 */
import { createHash, randomBytes } from "node:crypto";
import type { Digest } from "../lib/cas/digest.ts";
import { findMissing } from "../store/cas-queries.ts";
import { createTestUser, type DbKind, openTestDb } from "../test/db.ts";

const arg = (name: string, def: number): number => {
  const i = process.argv.indexOf(`--${name}`);
  return i < 0 ? def : Number(process.argv[i + 1]);
};
const BLOBS = arg("blobs", 100_000);
const ROUNDS = arg("rounds", 5);

const digest = (): Digest => ({
  hash: createHash("sha256").update(randomBytes(16)).digest("hex"),
  size: 1000,
});

async function run(kind: DbKind): Promise<void> {
  const db = await openTestDb(kind);
  try {
    const user = await createTestUser(db);
    const stored = Array.from({ length: BLOBS }, digest);
    const now = new Date();
    for (let i = 0; i < stored.length; i += 10_000) {
      const part = stored.slice(i, i + 10_000);
      await db.query(
        `INSERT INTO cas_blobs (hash, size, created_at, touched_at)
         SELECT h, 1000, $2, $2 FROM unnest($1::text[]) AS h`,
        [part.map((d) => d.hash), now],
      );
      await db.query(
        "INSERT INTO cas_access (hash, user_uuid) SELECT h, $2 FROM unnest($1::text[]) AS h WHERE random() < 0.5",
        [part.map((d) => d.hash), user.uuid],
      );
    }
    await db.query("ANALYZE");
    for (let r = 0; r < ROUNDS; r++) {
      // Half stored (some readable, some not), half never seen.
      const ask = [...stored.slice(r * 5000, r * 5000 + 5000), ...Array.from({ length: 5000 }, digest)];
      const t0 = performance.now();
      const missing = await findMissing(db, { userUuid: user.uuid, manifests: [] }, ask, new Date());
      const ms = performance.now() - t0;
      console.log(`${kind}: round ${r + 1}: 10,000 digests, ${missing.length} missing, ${ms.toFixed(1)} ms`);
    }
  } finally {
    await db.close();
  }
}

for (const kind of ["pg", "pglite"] as const) await run(kind);
