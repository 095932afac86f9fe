/**
 * The benches' REST server: a store (PGlite or PostgreSQL, test/db.ts), one ordinary user with a fresh token,
 * and the server listening on a loopback port. The caller closes `app` and `db`.
 */
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createUser } from "../store/queries.ts";
import { openTestDb, type TestDb } from "../test/db.ts";

export interface BenchServer {
  db: TestDb;
  app: Awaited<ReturnType<typeof createRestServer>>;
  url: string;
  /** The bench user's bearer token. */
  token: string;
}

export async function startBenchServer(opts: {
  db: "pg" | "pglite";
  dataDir: string;
  maxRequestBodySize: number;
}): Promise<BenchServer> {
  const db = await openTestDb(opts.db);
  const token = newUserToken();
  await createUser(db, {
    uuid: newUserUuid("bench"),
    name: "bench",
    isAdmin: false,
    tokenHash: hashToken(token),
  });
  const app = await createRestServer({
    db,
    logger: false,
    clusterId: "bench",
    maxRequestBodySize: opts.maxRequestBodySize,
    defaultMaxAttempts: 3,
    dataDir: opts.dataDir,
  });
  const url = await app.listen({ host: "127.0.0.1", port: 0 });
  return { db, app, url, token };
}
