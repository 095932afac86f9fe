/**
 * The Db interface every component uses, with two adapters: PostgreSQL (a `pg` Pool) and PGlite (embedded,
 * single connection). Both retry serialization failures and deadlocks in one place (`withRetries`).
 *
 * Queries without parameters go through the simple query protocol on both adapters, so they may hold several
 * statements (migrations use this); queries with parameters hold exactly one statement.
 */
import { createHash } from "node:crypto";
import { mkdirSync } from "node:fs";
import type { PGlite, Transaction as PGliteTransaction } from "@electric-sql/pglite";
import pg from "pg";
import type { Logger } from "pino";
import { makeTreePrivate } from "../lib/data-dir.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { type EmbeddedMaintenance, startEmbeddedMaintenance } from "./embedded-maintenance.ts";
import { pgliteAssets } from "./pglite-assets.ts";
import { quoteIdent } from "./sql-ident.ts";

export interface QueryResult<R> {
  rows: R[];
  rowCount: number;
}

export interface Db {
  readonly kind: "pg" | "pglite";
  query<R = Record<string, unknown>>(sql: string, params?: readonly unknown[]): Promise<QueryResult<R>>;
  /**
   * Runs fn in a transaction (retried as a whole on serialization failure or deadlock; fn may run more than
   * once). Inside fn use only `tx`: on PGlite the outer Db waits until the transaction ends. A transaction
   * started on `tx` is a savepoint.
   */
  transaction<T>(fn: (tx: Db) => Promise<T>): Promise<T>;
  /**
   * Calls onPayload for each NOTIFY on channel; resolves to an unlisten function. On PostgreSQL a lost
   * listening connection is re-established; notifications sent while it was down are lost, so listeners
   * must also poll.
   */
  listen(channel: string, onPayload: (payload: string) => void): Promise<() => Promise<void>>;
  /**
   * Takes the session-level advisory lock named by key without waiting: the lock, or null when another
   * session holds it. On PostgreSQL the lock lives on a dedicated connection (outside the pool) that stays
   * open until release(); on PGlite (one process) it is an entry in this Db's lock table.
   */
  tryAdvisoryLock(key: string): Promise<AdvisoryLock | null>;
  close(): Promise<void>;
}

export interface AdvisoryLock {
  /** Gives the lock up (closing its connection on PostgreSQL). Idempotent. */
  release(): Promise<void>;
  /** Resolves once the lock is no longer held: released, or its connection died (another may take it). */
  readonly lost: Promise<void>;
}

export interface OpenDbOptions {
  maxConnections?: number;
  logger?: Logger;
  /**
   * PGlite only: ms between rounds of the embedded autovacuum (store/embedded-maintenance.ts); 0 or absent =
   * none (short-lived commands). PostgreSQL's own autovacuum needs no help.
   */
  maintenanceInterval?: number;
}

/** SQLSTATEs after which re-running the whole transaction is the right reaction. */
export const RETRYABLE_SQLSTATES: ReadonlySet<string> = new Set([
  "40001", // serialization_failure
  "40P01", // deadlock_detected
]);

/** The SQLSTATE of a database error (both adapters put it in `code`), or undefined. */
export function sqlState(err: unknown): string | undefined {
  const code = (err as { code?: unknown } | null)?.code;
  return typeof code === "string" && /^[0-9A-Z]{5}$/.test(code) ? code : undefined;
}

/** PostgreSQL's refusal to run a prepared statement whose result columns changed since it was prepared. */
export const isStalePlan = (err: unknown): boolean =>
  sqlState(err) === "0A000" && /cached plan must not change result type/.test((err as Error).message);

/**
 * Runs fn, re-running it after a serialization failure or deadlock (with a short random backoff), or after a
 * prepared statement went stale (pgQuery has given every text a new name by then).
 */
export async function withRetries<T>(
  fn: () => Promise<T>,
  opts: { attempts?: number; logger?: Logger | undefined } = {},
): Promise<T> {
  const attempts = opts.attempts ?? 8;
  for (let i = 1; ; i++) {
    try {
      return await fn();
    } catch (err) {
      const state = sqlState(err);
      const again = state !== undefined && (RETRYABLE_SQLSTATES.has(state) || isStalePlan(err));
      if (!again || i >= attempts) throw err;
      opts.logger?.debug({ sqlState: state, attempt: i }, "retrying transaction");
      await new Promise((resolve) => setTimeout(resolve, Math.random() * 10 * 2 ** Math.min(i, 6)));
    }
  }
}

/** `url` with any password replaced, safe for messages and logs. */
export function redactDbUrl(url: string): string {
  try {
    const u = new URL(url);
    if (u.password) u.password = "***";
    return u.toString();
  } catch {
    // Unparseable: keep only what cannot hold a secret.
    return `${url.split(/[:/@]/, 1)[0]}:...`;
  }
}

export async function openDb(url: string, opts: OpenDbOptions = {}): Promise<Db> {
  if (/^postgres(ql)?:\/\//.test(url)) {
    try {
      new URL(url);
    } catch {
      throw invalidUrl(url);
    }
    return openPg(url, opts);
  }
  if (url.startsWith("pglite:")) {
    const dir = url.slice("pglite:".length);
    if (dir === "") throw invalidUrl(url);
    return openPglite(dir === "memory:" ? undefined : dir, opts);
  }
  throw invalidUrl(url);
}

function invalidUrl(url: string): DispatchCloudError {
  return new DispatchCloudError(
    "store.invalid_url",
    `database url ${JSON.stringify(redactDbUrl(url))} is not valid; use postgres://user@host:port/db, ` +
      "pglite:<directory> or pglite:memory:",
    { path: "database.url" },
  );
}

// ---------------------------------------------------------------------------------------------------------
// PostgreSQL

/**
 * A timestamptz text parser that keeps the last text it parsed. The rows of one statement mostly share their
 * times (its now(): a batch's created_at, updated_at and staged_at), and parsing the text cost about 2 us a row
 * of a 1,000-bundle insert (docs/performance.md). Each call returns its own Date, as the parser does.
 */
export function lastTimestampParser(parse: (text: string) => unknown): (text: string) => unknown {
  let lastText: string | null = null;
  let lastMs = 0;
  return (text) => {
    if (text === lastText) return new Date(lastMs);
    const value = parse(text);
    // Only a valid Date is kept ('infinity' parses to a number, a bad text to an invalid Date).
    if (value instanceof Date && !Number.isNaN(value.getTime())) {
      lastText = text;
      lastMs = value.getTime();
    }
    return value;
  };
}

const parseTimestamptz = lastTimestampParser(pg.types.getTypeParser(pg.types.builtins.TIMESTAMPTZ, "text"));

/**
 * int8 (count(*), bigserial, change_seq) as JS numbers; all our values are far below 2^53. timestamptz through
 * lastTimestampParser.
 */
const pgTypes = {
  getTypeParser: ((oid: number, format?: "text" | "binary") => {
    if (format === "binary") return pg.types.getTypeParser(oid, format);
    if (oid === pg.types.builtins.INT8) return (v: string) => Number(v);
    if (oid === pg.types.builtins.TIMESTAMPTZ) return parseTimestamptz;
    return pg.types.getTypeParser(oid, "text");
  }) as typeof pg.types.getTypeParser,
};

type PgQueryable = Pick<pg.PoolClient, "query">;

/**
 * Statements marked with prepared() run as named prepared statements on PostgreSQL: each connection parses a
 * text once, and after a few runs PostgreSQL may keep one generic plan for all values (plan_cache_mode auto
 * still plans per run when that looks cheaper). For the larger statements on hot paths parsing and planning cost
 * more than running: a one-row submission's insert took 1.3 ms of PostgreSQL's CPU unprepared and 0.3 ms
 * prepared (docs/performance.md). Only statements whose best plan does not depend on their values should be
 * marked (inserts, lookups and updates by key): a generic plan chosen while a table was small read the queue's
 * `change_seq > $1` by a full scan once it had grown. The name is a hash of the text, so one name is one text
 * on every connection; at most MAX_PREPARED texts get names (past that they run unnamed).
 */
const PREPARED_MARK = "/* prepared */ ";
const MAX_PREPARED = 1000;
const statementNames = new Map<string, string>();
/** Bumped when a prepared statement's result type changed under it (a migration altered its table). */
let statementGeneration = 0;

/** `sql`, marked to run as a named prepared statement on PostgreSQL (see above); PGlite runs it as it is. */
export const prepared = (sql: string): string => PREPARED_MARK + sql;

function statementName(sql: string): string | undefined {
  let name = statementNames.get(sql);
  if (name === undefined && statementNames.size < MAX_PREPARED) {
    name = createHash("sha256").update(sql).digest("hex").slice(0, 24);
    statementNames.set(sql, name);
  }
  return name === undefined ? undefined : `dc${statementGeneration}_${name}`;
}

async function pgQuery<R>(c: PgQueryable, sql: string, params?: readonly unknown[]): Promise<QueryResult<R>> {
  const name = params !== undefined && sql.startsWith(PREPARED_MARK) ? statementName(sql) : undefined;
  let res: pg.QueryResult | pg.QueryResult[];
  try {
    res = await (name === undefined
      ? c.query(sql, params === undefined ? undefined : [...params])
      : c.query({ name, text: sql, values: [...(params ?? [])] }));
  } catch (err) {
    // New names for every text, so each connection prepares them again when withRetries runs the query (or
    // its whole transaction) once more.
    if (name !== undefined && isStalePlan(err)) statementGeneration++;
    throw err;
  }
  const last = Array.isArray(res) ? res[res.length - 1] : res;
  const rows = (last?.rows ?? []) as R[];
  return { rows, rowCount: last?.rowCount ?? rows.length };
}

function pgTxDb(client: pg.PoolClient, depth: number): Db {
  const db: Db = {
    kind: "pg",
    query: (sql, params) => pgQuery(client, sql, params),
    async transaction(fn) {
      const sp = `sp_${depth}`;
      await client.query(`SAVEPOINT ${sp}`);
      try {
        const out = await fn(pgTxDb(client, depth + 1));
        await client.query(`RELEASE SAVEPOINT ${sp}`);
        return out;
      } catch (err) {
        await client.query(`ROLLBACK TO SAVEPOINT ${sp}`);
        throw err;
      }
    },
    listen: () => Promise.reject(new Error("listen inside a transaction is not supported")),
    tryAdvisoryLock: () => Promise.reject(new Error("advisory locks inside a transaction are not supported")),
    close: () => Promise.reject(new Error("close inside a transaction is not supported")),
  };
  return db;
}

async function openPg(url: string, opts: OpenDbOptions): Promise<Db> {
  const logger = opts.logger;
  // No JIT: our statements are short, and a planner estimate over the JIT threshold (a table not analyzed
  // yet) made one bundle manager pass spend 0.8 s compiling a query that runs in 4 ms. (An `options`
  // parameter in the URL takes precedence.)
  const config: pg.PoolConfig = { connectionString: url, types: pgTypes, options: "-c jit=off" };
  // Idle connections stay open (pg closes them after 10 s by default): a burst of bundles after a quiet spell
  // would otherwise open its statements' connections again, each a new backend that loads its caches and
  // prepares its statements, a few ms on the burst's path (docs/decisions.md). At most `max` are kept; an idle
  // one does not keep the process alive (allowExitOnIdle), as pg's timeout used to let it end after 10 s.
  const pool = new pg.Pool({
    ...config,
    max: opts.maxConnections ?? 10,
    idleTimeoutMillis: 0,
    allowExitOnIdle: true,
  });
  pool.on("error", (err) => logger?.warn({ err }, "idle database connection failed"));
  // Fail fast (with a clear message) when the server cannot be reached.
  try {
    const c = await pool.connect();
    c.release();
  } catch (err) {
    await pool.end().catch(() => {});
    throw new Error(`cannot connect to ${redactDbUrl(url)}: ${(err as Error).message}`, { cause: err });
  }

  const listener = createPgListener(config, logger);

  return {
    kind: "pg",
    query: (sql, params) => withRetries(() => pgQuery(pool, sql, params), { logger }),
    transaction: (fn) =>
      withRetries(
        async () => {
          const client = await pool.connect();
          let broken = false;
          try {
            await client.query("BEGIN");
            const out = await fn(pgTxDb(client, 0));
            await client.query("COMMIT");
            return out;
          } catch (err) {
            try {
              await client.query("ROLLBACK");
            } catch {
              broken = true;
            }
            throw err;
          } finally {
            client.release(broken);
          }
        },
        { logger },
      ),
    listen: (channel, onPayload) => listener.listen(channel, onPayload),
    tryAdvisoryLock: (key) => pgTryAdvisoryLock(config, key, logger),
    async close() {
      await listener.close();
      await pool.end();
    },
  };
}

/** How often a held lock's connection is checked, so a silently dead connection is noticed. */
const LOCK_HEARTBEAT_MS = 5000;

/**
 * pg_try_advisory_lock on a connection of its own, kept open while the lock is held: PostgreSQL releases a
 * session lock when its session ends, so a crashed holder frees it by itself.
 */
async function pgTryAdvisoryLock(
  config: pg.ClientConfig,
  key: string,
  logger: Logger | undefined,
): Promise<AdvisoryLock | null> {
  const client = new pg.Client({ ...config, keepAlive: true });
  client.on("error", () => {});
  await client.connect();
  let ok = false;
  try {
    const { rows } = await client.query<{ ok: boolean }>(
      "SELECT pg_try_advisory_lock(hashtext($1)::bigint) AS ok",
      [key],
    );
    ok = rows[0]?.ok === true;
  } finally {
    if (!ok) await client.end().catch(() => {});
  }
  if (!ok) return null;

  let done = false;
  let resolveLost!: () => void;
  const lost = new Promise<void>((resolve) => {
    resolveLost = resolve;
  });
  const end = (why: string | null, err?: unknown) => {
    if (done) return;
    done = true;
    clearInterval(heartbeat);
    if (why !== null) logger?.warn({ err, lockKey: key }, why);
    client.end().catch(() => {});
    resolveLost();
  };
  client.on("error", (err) => end("advisory lock connection failed; the lock is lost", err));
  client.on("end", () => end("advisory lock connection closed; the lock is lost"));
  const heartbeat = setInterval(() => {
    client
      .query("SELECT 1")
      .catch((err: unknown) => end("advisory lock connection failed; the lock is lost", err));
  }, LOCK_HEARTBEAT_MS);
  heartbeat.unref();
  return {
    lost,
    async release() {
      if (done) return;
      done = true;
      clearInterval(heartbeat);
      client.removeAllListeners("end");
      await client.end().catch(() => {});
      resolveLost();
    },
  };
}

/** One dedicated connection for LISTEN, shared by all channels, reconnecting with backoff when lost. */
function createPgListener(config: pg.ClientConfig, logger: Logger | undefined) {
  const handlers = new Map<string, Set<(payload: string) => void>>();
  let client: pg.Client | null = null;
  let connecting: Promise<pg.Client> | null = null;
  let closed = false;
  let retryTimer: NodeJS.Timeout | null = null;

  const connect = (): Promise<pg.Client> => {
    if (client) return Promise.resolve(client);
    if (connecting) return connecting;
    connecting = (async () => {
      const c = new pg.Client(config);
      c.on("notification", (msg) => {
        for (const h of handlers.get(msg.channel) ?? []) h(msg.payload ?? "");
      });
      c.on("error", (err) => {
        logger?.warn({ err }, "database listen connection failed; reconnecting");
        lost(c);
      });
      c.on("end", () => lost(c));
      try {
        await c.connect();
        for (const ch of handlers.keys()) await c.query(`LISTEN ${quoteIdent(ch)}`);
      } catch (err) {
        c.removeAllListeners();
        c.on("error", () => {});
        await c.end().catch(() => {});
        throw err;
      }
      if (closed) {
        await c.end().catch(() => {});
        throw new Error("database closed");
      }
      client = c;
      return c;
    })().finally(() => {
      connecting = null;
    });
    return connecting;
  };

  const lost = (c: pg.Client) => {
    if (client !== c) return;
    client = null;
    c.end().catch(() => {});
    scheduleReconnect(100);
  };

  const scheduleReconnect = (delay: number) => {
    if (closed || retryTimer || handlers.size === 0) return;
    retryTimer = setTimeout(() => {
      retryTimer = null;
      connect().catch((err) => {
        logger?.warn({ err }, "database listen reconnect failed");
        scheduleReconnect(Math.min(delay * 2, 5000));
      });
    }, delay);
  };

  return {
    async listen(channel: string, onPayload: (payload: string) => void): Promise<() => Promise<void>> {
      if (closed) throw new Error("database closed");
      let set = handlers.get(channel);
      const first = set === undefined;
      if (!set) {
        set = new Set();
        handlers.set(channel, set);
      }
      set.add(onPayload);
      try {
        const c = await connect();
        // connect() issues LISTEN for channels known when it connected; repeat is harmless.
        if (first) await c.query(`LISTEN ${quoteIdent(channel)}`);
      } catch (err) {
        set.delete(onPayload);
        if (set.size === 0) handlers.delete(channel);
        throw err;
      }
      return async () => {
        const s = handlers.get(channel);
        if (!s?.delete(onPayload) || s.size > 0) return;
        handlers.delete(channel);
        await client?.query(`UNLISTEN ${quoteIdent(channel)}`).catch(() => {});
      };
    },
    async close() {
      closed = true;
      if (retryTimer) clearTimeout(retryTimer);
      retryTimer = null;
      await connecting?.catch(() => {});
      const c = client;
      client = null;
      if (c) {
        c.removeAllListeners();
        c.on("error", () => {});
        await c.end().catch(() => {});
      }
    },
  };
}

// ---------------------------------------------------------------------------------------------------------
// PGlite

type PgliteQueryable = Pick<PGliteTransaction, "query" | "exec">;

async function pgliteQuery<R>(
  c: PgliteQueryable,
  sql: string,
  params?: readonly unknown[],
): Promise<QueryResult<R>> {
  if (params === undefined || params.length === 0) {
    const results = await c.exec(sql);
    const last = results[results.length - 1];
    const rows = (last?.rows ?? []) as R[];
    return { rows, rowCount: Math.max(last?.affectedRows ?? 0, rows.length) };
  }
  const res = await c.query<R>(sql, [...params]);
  return { rows: res.rows, rowCount: Math.max(res.affectedRows ?? 0, res.rows.length) };
}

function pgliteTxDb(tx: PGliteTransaction, depth: number): Db {
  return {
    kind: "pglite",
    query: (sql, params) => pgliteQuery(tx, sql, params),
    async transaction(fn) {
      const sp = `sp_${depth}`;
      await tx.query(`SAVEPOINT ${sp}`);
      try {
        const out = await fn(pgliteTxDb(tx, depth + 1));
        await tx.query(`RELEASE SAVEPOINT ${sp}`);
        return out;
      } catch (err) {
        await tx.query(`ROLLBACK TO SAVEPOINT ${sp}`);
        throw err;
      }
    },
    listen: () => Promise.reject(new Error("listen inside a transaction is not supported")),
    tryAdvisoryLock: () => Promise.reject(new Error("advisory locks inside a transaction are not supported")),
    close: () => Promise.reject(new Error("close inside a transaction is not supported")),
  };
}

/**
 * PGlite has one connection: every operation (a query, a whole transaction, LISTEN) is queued, so a
 * transaction never sees, nor is seen by, queries from outside it before it ends.
 */
async function openPglite(dir: string | undefined, opts: OpenDbOptions): Promise<Db> {
  const logger = opts.logger;
  // The database is private to this user: the directory 0700, and the files PGlite unpacks (world-writable in
  // its bundle) made private once it has opened them (lib/data-dir.ts).
  if (dir !== undefined) mkdirSync(dir, { recursive: true, mode: 0o700 });
  // Loaded on first use (commands that do not open PGlite do not pay for it), with the wasm and data files
  // built into the one-file artifact when it runs from there (store/pglite-assets.ts).
  const [{ PGlite: PGliteClass }, assets] = await Promise.all([
    import("@electric-sql/pglite"),
    pgliteAssets(),
  ]);
  const pglite: PGlite = await PGliteClass.create({
    ...(dir === undefined ? {} : { dataDir: dir }),
    ...assets,
  });
  if (dir !== undefined) await makeTreePrivate(dir);
  let tail: Promise<unknown> = Promise.resolve();
  const exclusive = <T>(fn: () => Promise<T>): Promise<T> => {
    const run = tail.then(fn, fn);
    tail = run.catch(() => {});
    return run;
  };
  let closed = false;
  // One process holds every session: advisory locks are entries here, released on release() or close().
  const locks = new Map<string, () => void>();
  let maintenance: EmbeddedMaintenance | undefined;

  const db: Db = {
    kind: "pglite",
    query: (sql, params) => withRetries(() => exclusive(() => pgliteQuery(pglite, sql, params)), { logger }),
    transaction: (fn) =>
      withRetries(() => exclusive(() => pglite.transaction((tx) => fn(pgliteTxDb(tx, 0)))), { logger }),
    async listen(channel, onPayload) {
      const unlisten = await exclusive(() => pglite.listen(channel, onPayload));
      return () => (closed ? Promise.resolve() : exclusive(() => unlisten()));
    },
    async tryAdvisoryLock(key) {
      if (closed) throw new Error("database closed");
      if (locks.has(key)) return null;
      let resolveLost!: () => void;
      const lost = new Promise<void>((resolve) => {
        resolveLost = resolve;
      });
      const drop = () => {
        if (locks.get(key) !== drop) return;
        locks.delete(key);
        resolveLost();
      };
      locks.set(key, drop);
      return { lost, release: async () => drop() };
    },
    async close() {
      if (closed) return;
      closed = true;
      await maintenance?.stop();
      for (const drop of [...locks.values()]) drop();
      await exclusive(() => pglite.close());
    },
  };
  if ((opts.maintenanceInterval ?? 0) > 0)
    maintenance = startEmbeddedMaintenance(db, {
      intervalMs: opts.maintenanceInterval as number,
      ...(logger === undefined ? {} : { logger }),
    });
  return db;
}
