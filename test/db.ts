/**
 * Test databases. `describeEachDb` runs a suite twice: on real PostgreSQL (a fresh database cloned from a
 * migrated template, at DISPATCH_CLOUD_TEST_PG_URL) and on PGlite in memory. A missing PostgreSQL server is
 * a failure that says how to start one, never a skip.
 */
import { createHash, randomBytes } from "node:crypto";
import pg from "pg";
import { afterAll, beforeAll, describe } from "vitest";
import { hashToken, newRunnerToken, newUserToken } from "../lib/tokens.ts";
import { type Db, openDb, redactDbUrl } from "../store/db.ts";
import { listMigrations, migrate } from "../store/migrate.ts";
import { createUser, type InitialState, insertBundle, insertBundles } from "../store/queries.ts";
import { startBundle } from "../store/transitions.ts";
import type { Bundle, NewBundle, User } from "../store/types.ts";

export type DbKind = "pg" | "pglite";
export type TestDb = Db & { readonly url: string };

const HOW_TO = 'start the test services with: eval "$(bash scripts/test-services.sh)"';
const TEMPLATE_LOCK_KEY = 72_468_352_811;

export function testPgUrl(): string {
  const url = process.env["DISPATCH_CLOUD_TEST_PG_URL"];
  if (!url) throw new Error(`DISPATCH_CLOUD_TEST_PG_URL is not set; ${HOW_TO}`);
  return url;
}

function withDatabase(url: string, name: string): string {
  const u = new URL(url);
  u.pathname = `/${name}`;
  return u.toString();
}

async function adminClient(url: string): Promise<pg.Client> {
  const client = new pg.Client({ connectionString: url });
  client.on("error", () => {});
  try {
    await client.connect();
  } catch (err) {
    await client.end().catch(() => {});
    throw new Error(`cannot reach PostgreSQL at ${redactDbUrl(url)} (${(err as Error).message}); ${HOW_TO}`, {
      cause: err,
    });
  }
  return client;
}

/** The migrated template database for the current migrations, created once (under an advisory lock). */
async function ensureTemplate(admin: pg.Client, url: string): Promise<string> {
  const hash = createHash("sha256");
  for (const m of listMigrations()) hash.update(m.name).update(m.sql);
  const template = `dc_test_tmpl_${hash.digest("hex").slice(0, 16)}`;
  await admin.query("SELECT pg_advisory_lock($1)", [TEMPLATE_LOCK_KEY]);
  try {
    const { rowCount } = await admin.query("SELECT 1 FROM pg_database WHERE datname = $1", [template]);
    if (rowCount) return template;
    const old = await admin.query<{ datname: string }>(
      "SELECT datname FROM pg_database WHERE datname LIKE 'dc\\_test\\_tmpl\\_%'",
    );
    for (const { datname } of old.rows)
      await admin.query(`DROP DATABASE IF EXISTS "${datname}"`).catch(() => {});
    const building = `${template}_building`;
    await admin.query(`DROP DATABASE IF EXISTS "${building}"`);
    await admin.query(`CREATE DATABASE "${building}"`);
    const db = await openDb(withDatabase(url, building), { maxConnections: 1 });
    try {
      await migrate(db);
    } finally {
      await db.close();
    }
    await admin.query(`ALTER DATABASE "${building}" RENAME TO "${template}"`);
    return template;
  } finally {
    await admin.query("SELECT pg_advisory_unlock($1)", [TEMPLATE_LOCK_KEY]);
  }
}

/**
 * A migrated database of the given kind, to close after use. On PostgreSQL it is a new database (dropped by
 * close); `url` opens more connections to it (for tests that need separate pools).
 */
export async function openTestDb(kind: DbKind): Promise<TestDb> {
  if (kind === "pglite") {
    const db = await openDb("pglite:memory:");
    try {
      await migrate(db);
    } catch (err) {
      await db.close();
      throw err;
    }
    return Object.assign(db, { url: "pglite:memory:" });
  }
  const url = testPgUrl();
  const name = `dc_test_${process.pid}_${randomBytes(4).toString("hex")}`;
  const admin = await adminClient(url);
  try {
    const template = await ensureTemplate(admin, url);
    await admin.query(`CREATE DATABASE "${name}" TEMPLATE "${template}"`);
  } finally {
    await admin.end();
  }
  const dbUrl = withDatabase(url, name);
  const db = await openDb(dbUrl);
  return {
    kind: db.kind,
    url: dbUrl,
    query: (sql, params) => db.query(sql, params),
    transaction: (fn) => db.transaction(fn),
    listen: (channel, onPayload) => db.listen(channel, onPayload),
    tryAdvisoryLock: (key) => db.tryAdvisoryLock(key),
    async close() {
      await db.close();
      const a = await adminClient(url);
      try {
        await a.query(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
      } finally {
        await a.end();
      }
    },
  };
}

/**
 * Runs the suite once on PostgreSQL and once on PGlite; getDb() is the suite's migrated database. If the
 * database cannot be opened, every test that calls getDb() fails with the reason (never a skip).
 */
export function describeEachDb(name: string, fn: (getDb: () => TestDb) => void): void {
  for (const kind of ["pg", "pglite"] as const) {
    describe(`${name} [${kind}]`, () => fn(useTestDb(kind)));
  }
}

/**
 * A database of one kind for the enclosing describe block. A database that cannot be opened fails every test
 * that calls the getter, with the reason (never a skip).
 */
export function useTestDb(kind: DbKind): () => TestDb {
  let db: TestDb | undefined;
  let setupError: unknown;
  beforeAll(async () => {
    try {
      db = await openTestDb(kind);
    } catch (err) {
      setupError = err;
    }
  });
  afterAll(async () => {
    await db?.close();
  });
  return () => {
    if (db === undefined) throw setupError ?? new Error(`no ${kind} test database`);
    return db;
  };
}

/**
 * Two more connection pools to the block's database, for races: on PostgreSQL real concurrent connections (each
 * pool up to maxConnections), on PGlite the same Db (where the queue serialises the racers). Closed after the
 * block.
 */
export function useRacingDbs(getDb: () => TestDb, maxConnections: number): () => { a: Db; b: Db } {
  let pools: { a: Db; b: Db } | undefined;
  const opened: Db[] = [];
  beforeAll(async () => {
    const db = getDb();
    if (db.kind === "pglite") {
      pools = { a: db, b: db };
      return;
    }
    const a = await openDb(db.url, { maxConnections });
    opened.push(a);
    const b = await openDb(db.url, { maxConnections });
    opened.push(b);
    pools = { a, b };
  });
  afterAll(async () => {
    await Promise.all(opened.map((d) => d.close()));
  });
  return () => {
    if (pools === undefined)
      throw new Error("the racing pools were not opened (see the test database's error)");
    return pools;
  };
}

// ---------------------------------------------------------------------------------------------------------
// Fixtures

const ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789";
const randomId = (n: number): string => Array.from(randomBytes(n), (b) => ALNUM[b % ALNUM.length]).join("");

export const testBundleUuid = (cluster = "zzzzz"): string => `${cluster}-bndl-${randomId(15)}`;
export const testUserUuid = (cluster = "zzzzz"): string => `${cluster}-user-${randomId(15)}`;

/** Creates a user with a random name and token hash. */
export async function createTestUser(db: Db, opts: { isAdmin?: boolean } = {}): Promise<User> {
  return createUser(db, {
    uuid: testUserUuid(),
    name: `user-${randomId(8)}`,
    isAdmin: opts.isAdmin ?? false,
    tokenHash: createHash("sha256").update(randomBytes(32)).digest("hex"),
  });
}

/** A user made directly in the database with a real user token (for API tests); returns its uuid and token. */
export async function createTestUserWithToken(
  db: Db,
  opts: { isAdmin?: boolean } = {},
): Promise<{ uuid: string; token: string }> {
  const token = newUserToken();
  const user = await createUser(db, {
    uuid: testUserUuid(),
    name: `u-${randomId(10)}`,
    isAdmin: opts.isAdmin ?? false,
    tokenHash: hashToken(token),
  });
  return { uuid: user.uuid, token };
}

/** A valid NewBundle for owner, with overrides. */
export function testNewBundle(ownerUuid: string, overrides: Partial<NewBundle> = {}): NewBundle {
  return {
    ownerUuid,
    name: "test bundle",
    command: ["sh", "-c", "echo hello"],
    image: "busybox",
    env: { GREETING: "hello" },
    resources: { vcpus: 1, ram: 256 * 2 ** 20, scratch: 2 ** 30, gpu: null },
    preemptible: false,
    priority: 500,
    limits: { time: null, disk: null, network: true },
    dependencies: [],
    allowFailedDependencies: false,
    maxAttempts: 3,
    ...overrides,
  };
}

/**
 * Inserts `n` test bundles owned by ownerUuid in statements of 1,000 (`submitted`: staged at once, having no
 * dependencies; or `created`); returns their uuids in order.
 */
export async function insertTestBundles(
  db: Db,
  ownerUuid: string,
  n: number,
  state: InitialState,
): Promise<string[]> {
  const uuids: string[] = [];
  for (let k = 0; k < n; k += 1000) {
    const items = Array.from({ length: Math.min(1000, n - k) }, () => ({
      uuid: testBundleUuid(),
      bundle: testNewBundle(ownerUuid),
    }));
    await insertBundles(db, ownerUuid, items, state);
    uuids.push(...items.map((i) => i.uuid));
  }
  return uuids;
}

/** Inserts a created bundle owned by ownerUuid. */
export function createTestBundle(
  db: Db,
  ownerUuid: string,
  overrides: Partial<NewBundle> = {},
): Promise<Bundle> {
  return insertBundle(db, testBundleUuid(), testNewBundle(ownerUuid, overrides), "created");
}

/**
 * Moves a staged bundle to `starting` as the pool does, with a fresh runner token (only its hash is stored);
 * throws when the transition is refused. Returns the token and the row.
 */
export async function startWithRunnerToken(
  db: Db,
  uuid: string,
  over: { instanceId?: string; instanceType?: string; gpuDevices?: number[]; actor?: string } = {},
): Promise<{ token: string; bundle: Bundle }> {
  const token = newRunnerToken();
  const r = await startBundle(db, uuid, {
    instanceId: over.instanceId ?? "i-1",
    instanceType: over.instanceType ?? "small",
    runnerTokenHash: hashToken(token),
    gpuDevices: over.gpuDevices ?? [],
    actor: over.actor ?? "dispatcher",
  });
  if (!r.ok) throw new Error(`cannot start ${uuid}: ${r.reason} (${r.current?.state ?? "gone"})`);
  return { token, bundle: r.bundle };
}
