/**
 * Applies store/migrations/NNN_name.sql (built into the one-file artifact) in order, each in its own transaction, recording each in
 * schema_migrations. Safe to run from several processes at once (a transaction-scoped advisory lock
 * serialises them) and idempotent.
 */
import { readdirSync, readFileSync } from "node:fs";
import { DispatchCloudError } from "../lib/errors.ts";
import type { Db } from "./db.ts";
import { EMBEDDED_MIGRATIONS } from "./migrations-embedded.ts";
import type { Migration } from "./types.ts";

const MIGRATIONS_DIR = new URL("./migrations/", import.meta.url);
/** Advisory lock key held while migrating (arbitrary, fixed). */
const MIGRATION_LOCK_KEY = 72_468_352_810;

export type { Migration } from "./types.ts";

/**
 * The migrations, in the order they apply: store/migrations/*.sql, or the copies built into the one-file
 * artifact (store/migrations-embedded.ts) when no directory is given and the program runs from it.
 */
export function listMigrations(dir?: URL): Migration[] {
  if (dir === undefined && EMBEDDED_MIGRATIONS !== null) return EMBEDDED_MIGRATIONS;
  return readdirSync(dir ?? MIGRATIONS_DIR)
    .filter((f) => /^\d+_[a-z0-9_]+\.sql$/.test(f))
    .sort()
    .map((name) => ({ name, sql: readFileSync(new URL(name, dir ?? MIGRATIONS_DIR), "utf8") }));
}

export async function migrate(
  db: Db,
  migrations: Migration[] = listMigrations(),
): Promise<{ applied: string[] }> {
  await db.transaction(async (tx) => {
    await tx.query("SELECT pg_advisory_xact_lock($1)", [MIGRATION_LOCK_KEY]);
    await tx.query(
      "CREATE TABLE IF NOT EXISTS schema_migrations (name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())",
    );
  });
  const applied: string[] = [];
  for (const m of migrations) {
    const ran = await db
      .transaction(async (tx) => {
        await tx.query("SELECT pg_advisory_xact_lock($1)", [MIGRATION_LOCK_KEY]);
        const done = await tx.query("SELECT 1 FROM schema_migrations WHERE name = $1", [m.name]);
        if (done.rowCount > 0) return false;
        await tx.query(m.sql);
        await tx.query("INSERT INTO schema_migrations (name) VALUES ($1)", [m.name]);
        return true;
      })
      .catch((err: unknown) => {
        throw new DispatchCloudError(
          "store.migration_failed",
          `migration ${m.name} failed: ${(err as Error).message}`,
          { cause: err },
        );
      });
    if (ran) applied.push(m.name);
  }
  return { applied };
}
