/**
 * The embedded database's autovacuum and checkpointer. PGlite is PostgreSQL in one process with no background
 * workers: it says `autovacuum = on` but never vacuums nor analyzes. Every update and delete leaves a dead row
 * version, so without this its tables and indexes grow without bound (a transition rewrites a bundle's row), the
 * planner's statistics stay those of the first ANALYZE (or none), and nothing freezes old transaction ids. Nor does
 * it ever checkpoint while it runs, so its write-ahead log (pg_wal) grows by every write, and an unclean stop
 * replays all of it at the next start.
 *
 * `maintainOnce` does what autovacuum's worker would, with PostgreSQL's own rules and settings (read from the
 * database): a table is vacuumed once its dead rows exceed `autovacuum_vacuum_threshold +
 * autovacuum_vacuum_scale_factor x rows`, its rows inserted since the last vacuum exceed the insert threshold
 * likewise, or its oldest unfrozen transaction id is older than `autovacuum_freeze_max_age`; it is analyzed once
 * its rows changed since the last ANALYZE exceed `autovacuum_analyze_threshold + autovacuum_analyze_scale_factor x
 * rows`. `checkpointOnce` checkpoints as PostgreSQL's checkpointer would: once `checkpoint_timeout` has passed
 * since the last checkpoint with anything written since, or once the log written since it passes `max_wal_size /
 * (1 + checkpoint_completion_target)`; a checkpoint lets the log before it be recycled. `startEmbeddedMaintenance`
 * runs both every `database.embeddedMaintenanceInterval` on PGlite only (on PostgreSQL, autovacuum and the
 * checkpointer do this). PGlite has one connection, so while a table is vacuumed or a checkpoint writes, every
 * other statement waits: the thresholds keep each proportional to what changed (docs/operations.md has figures).
 */
import type { Logger } from "../lib/logger.ts";
import { quoteIdent } from "./sql-ident.ts";

/** What a round needs of the database (store/db.ts's Db has it; declared here, as db.ts starts the rounds). */
export interface MaintainedDb {
  query<R = Record<string, unknown>>(sql: string): Promise<{ rows: R[] }>;
}

/** One table's counters, as `pg_stat_all_tables` and `pg_class` give them. */
export interface TableActivity {
  schema: string;
  table: string;
  /** The planner's estimate of live rows; < 0 when never vacuumed nor analyzed (taken as 0). */
  rows: number;
  deadRows: number;
  modifiedSinceAnalyze: number;
  insertedSinceVacuum: number;
  /** age(relfrozenxid): transactions since the table's oldest unfrozen id. */
  xidAge: number;
}

/** PostgreSQL's autovacuum settings, as the database reports them. */
export interface AutovacuumSettings {
  vacuumThreshold: number;
  vacuumScaleFactor: number;
  vacuumInsertThreshold: number;
  vacuumInsertScaleFactor: number;
  analyzeThreshold: number;
  analyzeScaleFactor: number;
  freezeMaxAge: number;
}

export type MaintenanceAction = "vacuum" | "vacuum+analyze" | "analyze";

export interface MaintenanceStep {
  schema: string;
  table: string;
  action: MaintenanceAction;
  /** Why: which thresholds were passed, e.g. ["dead rows 4100 > 450"]. */
  reasons: string[];
  /** How long the statement held the database, in ms (set once it has run). */
  ms?: number;
}

/** What is due on each table, by PostgreSQL's autovacuum rules; tables with nothing due are left out. */
export function dueMaintenance(tables: readonly TableActivity[], s: AutovacuumSettings): MaintenanceStep[] {
  const steps: MaintenanceStep[] = [];
  for (const t of tables) {
    const rows = Math.max(0, t.rows);
    const vacuumAt = s.vacuumThreshold + s.vacuumScaleFactor * rows;
    const insertAt = s.vacuumInsertThreshold + s.vacuumInsertScaleFactor * rows;
    const analyzeAt = s.analyzeThreshold + s.analyzeScaleFactor * rows;
    const vacuum: string[] = [];
    if (t.deadRows > vacuumAt) vacuum.push(`dead rows ${t.deadRows} > ${Math.floor(vacuumAt)}`);
    // A negative insert threshold turns inserts off as a reason, as in PostgreSQL.
    if (s.vacuumInsertThreshold >= 0 && t.insertedSinceVacuum > insertAt)
      vacuum.push(`rows inserted since the last vacuum ${t.insertedSinceVacuum} > ${Math.floor(insertAt)}`);
    if (t.xidAge > s.freezeMaxAge) vacuum.push(`transaction id age ${t.xidAge} > ${s.freezeMaxAge}`);
    // PostgreSQL never analyzes pg_statistic, where ANALYZE writes (its counter of changed rows only grows).
    const analyze =
      t.modifiedSinceAnalyze > analyzeAt && !(t.schema === "pg_catalog" && t.table === "pg_statistic");
    if (vacuum.length === 0 && !analyze) continue;
    const reasons = [...vacuum];
    if (analyze)
      reasons.push(
        `rows changed since the last analyze ${t.modifiedSinceAnalyze} > ${Math.floor(analyzeAt)}`,
      );
    const action = vacuum.length === 0 ? "analyze" : analyze ? "vacuum+analyze" : "vacuum";
    steps.push({ schema: t.schema, table: t.table, action, reasons });
  }
  return steps;
}

const ACTIVITY_SQL = `
  SELECT s.schemaname AS schema, s.relname AS table, c.reltuples::float8 AS rows,
    s.n_dead_tup::float8 AS dead_rows, s.n_mod_since_analyze::float8 AS modified,
    s.n_ins_since_vacuum::float8 AS inserted, age(c.relfrozenxid)::float8 AS xid_age
  FROM pg_stat_all_tables s JOIN pg_class c ON c.oid = s.relid
  WHERE c.relkind IN ('r', 'm') AND s.schemaname <> 'information_schema'
  ORDER BY s.schemaname, s.relname`;

const SETTINGS_SQL = `
  SELECT current_setting('autovacuum_vacuum_threshold')::float8 AS vt,
    current_setting('autovacuum_vacuum_scale_factor')::float8 AS vs,
    current_setting('autovacuum_vacuum_insert_threshold')::float8 AS it,
    current_setting('autovacuum_vacuum_insert_scale_factor')::float8 AS "is",
    current_setting('autovacuum_analyze_threshold')::float8 AS at,
    current_setting('autovacuum_analyze_scale_factor')::float8 AS "as",
    current_setting('autovacuum_freeze_max_age')::float8 AS fm`;

/** The database's autovacuum settings. */
export async function autovacuumSettings(db: MaintainedDb): Promise<AutovacuumSettings> {
  const { rows } =
    await db.query<Record<"vt" | "vs" | "it" | "is" | "at" | "as" | "fm", number>>(SETTINGS_SQL);
  const r = rows[0];
  if (r === undefined) throw new Error("the database reported no autovacuum settings");
  return {
    vacuumThreshold: r.vt,
    vacuumScaleFactor: r.vs,
    vacuumInsertThreshold: r.it,
    vacuumInsertScaleFactor: r.is,
    analyzeThreshold: r.at,
    analyzeScaleFactor: r.as,
    freezeMaxAge: r.fm,
  };
}

/**
 * Every table's counters, the system catalogs' too (as autovacuum's: their old transaction ids must be frozen
 * like any table's; a toast table is vacuumed with its table).
 */
export async function tableActivity(db: MaintainedDb): Promise<TableActivity[]> {
  const { rows } = await db.query<{
    schema: string;
    table: string;
    rows: number;
    dead_rows: number;
    modified: number;
    inserted: number;
    xid_age: number;
  }>(ACTIVITY_SQL);
  return rows.map((r) => ({
    schema: r.schema,
    table: r.table,
    rows: r.rows,
    deadRows: r.dead_rows,
    modifiedSinceAnalyze: r.modified,
    insertedSinceVacuum: r.inserted,
    xidAge: r.xid_age,
  }));
}

const STATEMENT: Record<MaintenanceAction, string> = {
  vacuum: "VACUUM",
  "vacuum+analyze": "VACUUM (ANALYZE)",
  analyze: "ANALYZE",
};

/**
 * One round: vacuums and analyzes the tables that are due, one statement at a time, and returns what it did
 * (each step with its time). `stopped`, checked before each statement, ends the round early.
 */
export async function maintainOnce(
  db: MaintainedDb,
  stopped: () => boolean = () => false,
): Promise<MaintenanceStep[]> {
  // A session reports its counters at most once a second: those of PGlite's one session are flushed now.
  await db.query("SELECT pg_stat_force_next_flush()");
  const due = dueMaintenance(await tableActivity(db), await autovacuumSettings(db));
  const done: MaintenanceStep[] = [];
  for (const step of due) {
    if (stopped()) break;
    const t0 = performance.now();
    await db.query(`${STATEMENT[step.action]} ${quoteIdent(step.schema)}.${quoteIdent(step.table)}`);
    done.push({ ...step, ms: Math.round((performance.now() - t0) * 10) / 10 });
  }
  return done;
}

const CHECKPOINT_SQL = `
  SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), c.redo_lsn)::float8 AS wal_bytes,
    extract(epoch FROM now() - c.checkpoint_time)::float8 AS age_s,
    (SELECT setting::float8 FROM pg_settings WHERE name = 'checkpoint_timeout') AS timeout_s,
    (SELECT setting::float8 FROM pg_settings WHERE name = 'max_wal_size') AS max_wal_mb,
    (SELECT setting::float8 FROM pg_settings WHERE name = 'checkpoint_completion_target') AS target
  FROM pg_control_checkpoint() c`;

/** The log written since the last checkpoint, and how long ago it was, with the settings that bound them. */
export interface CheckpointState {
  walBytes: number;
  ageSeconds: number;
  timeoutSeconds: number;
  maxWalMiB: number;
  completionTarget: number;
}

/** A checkpoint's own record and what follows it on an idle database: less than this much log. */
const CHECKPOINT_RECORD_BYTES = 512;

/** Why a checkpoint is due by the checkpointer's rules, or null when it is not. */
export function checkpointDue(c: CheckpointState): string | null {
  const walAt = (c.maxWalMiB * 2 ** 20) / (1 + c.completionTarget);
  if (c.walBytes > walAt)
    return `log written since the last checkpoint ${Math.round(c.walBytes)} bytes > ${Math.floor(walAt)}`;
  // Nothing written but the last checkpoint's own record: nothing to checkpoint, however long ago.
  if (c.ageSeconds >= c.timeoutSeconds && c.walBytes > CHECKPOINT_RECORD_BYTES)
    return `last checkpoint ${Math.round(c.ageSeconds)} s ago >= checkpoint_timeout ${c.timeoutSeconds} s`;
  return null;
}

/**
 * Checkpoints when one is due (checkpointDue; `settings` in place of the database's, for tests); returns why and
 * how long it held the database, or null. Reads `pg_control_checkpoint()` and runs CHECKPOINT, which PostgreSQL
 * keeps to privileged roles: for PGlite, whose one user is its owner.
 */
export async function checkpointOnce(
  db: MaintainedDb,
  settings: Partial<Pick<CheckpointState, "timeoutSeconds" | "maxWalMiB">> = {},
): Promise<{ reason: string; ms: number } | null> {
  const { rows } = await db.query<{
    wal_bytes: number;
    age_s: number;
    timeout_s: number;
    max_wal_mb: number;
    target: number;
  }>(CHECKPOINT_SQL);
  const r = rows[0];
  if (r === undefined) throw new Error("the database reported no checkpoint");
  const reason = checkpointDue({
    walBytes: r.wal_bytes,
    ageSeconds: r.age_s,
    timeoutSeconds: r.timeout_s,
    maxWalMiB: r.max_wal_mb,
    completionTarget: r.target,
    ...settings,
  });
  if (reason === null) return null;
  const t0 = performance.now();
  await db.query("CHECKPOINT");
  return { reason, ms: Math.round((performance.now() - t0) * 10) / 10 };
}

export interface EmbeddedMaintenance {
  /** Stops the timer; resolves once a round that is running has ended (it stops before its next table). */
  stop(): Promise<void>;
}

export interface EmbeddedMaintenanceOptions {
  /** ms between the end of one round and the start of the next. */
  intervalMs: number;
  logger?: Logger;
  /** In place of the database's checkpoint settings (tests). */
  checkpointSettings?: Parameters<typeof checkpointOnce>[1];
  /** Called after each round that ran to its end, with what it did. */
  onRound?: (steps: MaintenanceStep[]) => void;
}

/**
 * Runs `maintainOnce`, then `checkpointOnce`, every `intervalMs` (the timer does not keep the process alive). A round that fails is
 * logged as a warning and the next one comes as usual; it never throws.
 */
export function startEmbeddedMaintenance(
  db: MaintainedDb,
  opts: EmbeddedMaintenanceOptions,
): EmbeddedMaintenance {
  const { logger } = opts;
  let stopped = false;
  let timer: NodeJS.Timeout | undefined;
  let running: Promise<void> = Promise.resolve();
  const round = async () => {
    try {
      const steps = await maintainOnce(db, () => stopped);
      for (const s of steps)
        logger?.info(
          { table: `${s.schema}.${s.table}`, action: s.action, reasons: s.reasons, ms: s.ms },
          "embedded database: table maintained (PGlite has no autovacuum of its own)",
        );
      // After the vacuums, whose log it then covers.
      const checkpoint = stopped ? null : await checkpointOnce(db, opts.checkpointSettings);
      if (checkpoint !== null)
        logger?.info(
          { reason: checkpoint.reason, ms: checkpoint.ms },
          "embedded database: checkpoint (PGlite has no checkpointer of its own)",
        );
      opts.onRound?.(steps);
    } catch (err) {
      if (!stopped)
        logger?.warn({ err }, "embedded database: maintenance round failed; the next comes as usual");
    }
  };
  const schedule = () => {
    if (stopped) return;
    timer = setTimeout(() => {
      running = round().finally(schedule);
    }, opts.intervalMs);
    timer.unref();
  };
  schedule();
  return {
    async stop() {
      stopped = true;
      if (timer !== undefined) clearTimeout(timer);
      await running;
    },
  };
}
