/**
 * Pipelines' SQL (store/migrations/009_pipelines.sql; docs/pipelines.md "Running"): one exported function per
 * statement, `(db, args)`, positional parameters only. Every change of a job's state is a guarded UPDATE (the
 * state it leaves, and for a queued job the bundle it leaves, are in its WHERE clause), so two REST servers
 * moving the same job never both succeed: the loser's statement changes no row.
 */
import type { Db } from "./db.ts";
import { NOW } from "./queries.ts";

export const PIPELINE_JOB_STATES = ["waiting", "queued", "completed", "failed", "skipped"] as const;
export type PipelineJobState = (typeof PIPELINE_JOB_STATES)[number];

/** A job as (app, job id), within one owner's pipeline. */
export interface JobKey {
  app: string;
  jobId: string;
}

export interface StoredPipeline {
  ownerUuid: string;
  name: string;
  /** The validated definition as JSON (lib/pipeline/definition.ts PipelineDefinition). */
  definition: unknown;
  digest: string;
  createdAt: Date;
  updatedAt: Date;
}

export interface PipelineJob {
  ownerUuid: string;
  pipeline: string;
  app: string;
  jobId: string;
  state: PipelineJobState;
  bundleUuid: string | null;
  attempts: number;
  reason: string | null;
  /** The ancestor whose failure this job inherited (it never ran); null otherwise. */
  failedParent: JobKey | null;
  createdAt: Date;
  updatedAt: Date;
}

interface PipelineRow {
  owner_uuid: string;
  name: string;
  definition: unknown;
  digest: string;
  created_at: Date;
  updated_at: Date;
}

interface JobRow {
  owner_uuid: string;
  pipeline: string;
  app: string;
  job_id: string;
  state: PipelineJobState;
  bundle_uuid: string | null;
  attempts: number;
  reason: string | null;
  failed_parent_app: string | null;
  failed_parent_job_id: string | null;
  created_at: Date;
  updated_at: Date;
}

const pipelineFromRow = (r: PipelineRow): StoredPipeline => ({
  ownerUuid: r.owner_uuid,
  name: r.name,
  definition: r.definition,
  digest: r.digest,
  createdAt: new Date(r.created_at),
  updatedAt: new Date(r.updated_at),
});

export const jobFromRow = (r: JobRow): PipelineJob => ({
  ownerUuid: r.owner_uuid,
  pipeline: r.pipeline,
  app: r.app,
  jobId: r.job_id,
  state: r.state,
  bundleUuid: r.bundle_uuid,
  attempts: r.attempts,
  reason: r.reason,
  failedParent:
    r.failed_parent_app === null || r.failed_parent_job_id === null
      ? null
      : { app: r.failed_parent_app, jobId: r.failed_parent_job_id },
  createdAt: new Date(r.created_at),
  updatedAt: new Date(r.updated_at),
});

/** Jobs as one jsonb parameter (`[{app, job_id}]`), for `jsonb_to_recordset`. */
const keysJson = (keys: readonly JobKey[]) =>
  JSON.stringify(keys.map((k) => ({ app: k.app, job_id: k.jobId })));

// ---------------------------------------------------------------------------------------------------------
// Pipelines

/** Creates or replaces an owner's pipeline; `created` says which. Jobs already stored are kept. */
export async function upsertPipeline(
  db: Db,
  p: { ownerUuid: string; name: string; definition: unknown; digest: string },
): Promise<{ pipeline: StoredPipeline; created: boolean }> {
  const { rows } = await db.query<PipelineRow & { created: boolean }>(
    `INSERT INTO pipelines (owner_uuid, name, definition, digest, created_at, updated_at)
     VALUES ($1, $2, $3::jsonb, $4, ${NOW}, ${NOW})
     ON CONFLICT (owner_uuid, name) DO UPDATE SET definition = EXCLUDED.definition, digest = EXCLUDED.digest,
       updated_at = CASE WHEN pipelines.digest = EXCLUDED.digest THEN pipelines.updated_at ELSE EXCLUDED.updated_at END
     RETURNING *, (xmax = 0) AS created`,
    [p.ownerUuid, p.name, JSON.stringify(p.definition), p.digest],
  );
  const r = rows[0]!;
  return { pipeline: pipelineFromRow(r), created: r.created };
}

export async function getPipeline(db: Db, ownerUuid: string, name: string): Promise<StoredPipeline | null> {
  const { rows } = await db.query<PipelineRow>(
    "SELECT * FROM pipelines WHERE owner_uuid = $1 AND name = $2",
    [ownerUuid, name],
  );
  return rows[0] === undefined ? null : pipelineFromRow(rows[0]);
}

/** An owner's pipelines by name, with how many jobs each has in each state. */
export async function listPipelines(
  db: Db,
  ownerUuid: string,
): Promise<(StoredPipeline & { jobs: Partial<Record<PipelineJobState, number>> })[]> {
  const { rows } = await db.query<PipelineRow & { jobs: Record<string, number> | null }>(
    `SELECT p.*, (SELECT jsonb_object_agg(s.state, s.n) FROM (
         SELECT j.state, count(*)::int AS n FROM pipeline_jobs j
         WHERE j.owner_uuid = p.owner_uuid AND j.pipeline = p.name GROUP BY j.state) s) AS jobs
     FROM pipelines p WHERE p.owner_uuid = $1 ORDER BY p.name`,
    [ownerUuid],
  );
  return rows.map((r) => ({ ...pipelineFromRow(r), jobs: r.jobs ?? {} }));
}

// ---------------------------------------------------------------------------------------------------------
// Jobs

/** The stored jobs among `keys` (absent ones are simply not returned). */
export async function getJobs(
  db: Db,
  ownerUuid: string,
  pipeline: string,
  keys: readonly JobKey[],
): Promise<PipelineJob[]> {
  if (keys.length === 0) return [];
  const { rows } = await db.query<JobRow>(
    `SELECT j.* FROM jsonb_to_recordset($3::jsonb) AS k(app text, job_id text)
     JOIN pipeline_jobs j ON j.owner_uuid = $1 AND j.pipeline = $2 AND j.app = k.app AND j.job_id = k.job_id`,
    [ownerUuid, pipeline, keysJson(keys)],
  );
  return rows.map(jobFromRow);
}

/**
 * Inserts new jobs (`waiting` or `skipped`) in one statement. A job that exists already (another run got there
 * first) is left as it is. Returns the keys inserted: only their parent edges are to be inserted.
 */
export async function insertJobs(
  db: Db,
  ownerUuid: string,
  pipeline: string,
  jobs: readonly { app: string; jobId: string; state: "waiting" | "skipped" }[],
): Promise<JobKey[]> {
  if (jobs.length === 0) return [];
  const { rows } = await db.query<{ app: string; job_id: string }>(
    `INSERT INTO pipeline_jobs (owner_uuid, pipeline, app, job_id, state, created_at, updated_at)
     SELECT $1, $2, r.app, r.job_id, r.state, ${NOW}, ${NOW}
     FROM jsonb_to_recordset($3::jsonb) AS r(app text, job_id text, state text)
     ON CONFLICT DO NOTHING
     RETURNING app, job_id`,
    [ownerUuid, pipeline, JSON.stringify(jobs.map((j) => ({ app: j.app, job_id: j.jobId, state: j.state })))],
  );
  return rows.map((r) => ({ app: r.app, jobId: r.job_id }));
}

/** Inserts parent edges (child -> parent) in one statement; both ends must be stored jobs. */
export async function insertJobParents(
  db: Db,
  ownerUuid: string,
  pipeline: string,
  edges: readonly { child: JobKey; parent: JobKey }[],
): Promise<void> {
  if (edges.length === 0) return;
  await db.query(
    `INSERT INTO pipeline_job_parents (owner_uuid, pipeline, app, job_id, parent_app, parent_job_id)
     SELECT $1, $2, r.app, r.job_id, r.parent_app, r.parent_job_id
     FROM jsonb_to_recordset($3::jsonb) AS r(app text, job_id text, parent_app text, parent_job_id text)
     ON CONFLICT DO NOTHING`,
    [
      ownerUuid,
      pipeline,
      JSON.stringify(
        edges.map((e) => ({
          app: e.child.app,
          job_id: e.child.jobId,
          parent_app: e.parent.app,
          parent_job_id: e.parent.jobId,
        })),
      ),
    ],
  );
}

/**
 * Refreshes the planner's statistics of the job tables. After a run that inserted thousands of jobs, PostgreSQL's
 * autovacuum has not looked yet (and PGlite has none): the planner, believing the tables nearly empty, picks nested
 * loops over sequential scans, and readyWaitingJobs over 5,000 new jobs took 44 s instead of 0.1 s.
 */
export async function analyzeJobTables(db: Db): Promise<void> {
  await db.query("ANALYZE pipeline_jobs, pipeline_job_parents");
}

/** A waiting job whose parents are all completed or skipped, with its parents' bundles. */
export interface ReadyJob {
  ownerUuid: string;
  pipeline: string;
  app: string;
  jobId: string;
  /** The completed parents (skipped ones give nothing), each with the bundle that completed it. */
  parents: { app: string; jobId: string; bundleUuid: string }[];
}

/** A user's pipeline, by its owner and name. */
export interface PipelineRef {
  ownerUuid: string;
  pipeline: string;
}

/**
 * Waiting jobs whose every parent is completed or skipped: everywhere (the manager's pass; at most `limit`,
 * leaving out the jobs of `excludeOwners` and of `excludePipelines`), or among `keys` of one pipeline (a run or
 * rerun starting what it can at once).
 */
export async function readyWaitingJobs(
  db: Db,
  args:
    | { limit: number; excludeOwners?: readonly string[]; excludePipelines?: readonly PipelineRef[] }
    | { ownerUuid: string; pipeline: string; keys: readonly JobKey[] },
): Promise<ReadyJob[]> {
  const scoped = "keys" in args;
  if (scoped && args.keys.length === 0) return [];
  // Set-based (joins and one GROUP BY, no subquery per job): the plan stays linear even when the planner's
  // statistics lag behind a run that has just inserted thousands of jobs.
  const waiting = scoped
    ? `SELECT j.owner_uuid, j.pipeline, j.app, j.job_id
       FROM jsonb_to_recordset($3::jsonb) AS k(app text, job_id text)
       JOIN pipeline_jobs j ON j.owner_uuid = $1 AND j.pipeline = $2 AND j.app = k.app AND j.job_id = k.job_id
       WHERE j.state = 'waiting'`
    : `SELECT j.owner_uuid, j.pipeline, j.app, j.job_id FROM pipeline_jobs j
       WHERE j.state = 'waiting' AND j.owner_uuid <> ALL($2::text[])
         AND NOT EXISTS (SELECT 1 FROM unnest($3::text[], $4::text[]) AS x(owner_uuid, pipeline)
           WHERE x.owner_uuid = j.owner_uuid AND x.pipeline = j.pipeline)`;
  const { rows } = await db.query<{
    owner_uuid: string;
    pipeline: string;
    app: string;
    job_id: string;
    parents: { app: string; jobId: string; bundleUuid: string }[] | null;
  }>(
    `WITH w AS (${waiting}), ready AS (
       SELECT w.owner_uuid, w.pipeline, w.app, w.job_id,
         jsonb_agg(jsonb_build_object('app', p.app, 'jobId', p.job_id, 'bundleUuid', p.bundle_uuid)
           ORDER BY p.app, p.job_id) FILTER (WHERE p.state = 'completed') AS parents
       FROM w
       LEFT JOIN pipeline_job_parents e ON e.owner_uuid = w.owner_uuid AND e.pipeline = w.pipeline
         AND e.app = w.app AND e.job_id = w.job_id
       LEFT JOIN pipeline_jobs p ON p.owner_uuid = e.owner_uuid AND p.pipeline = e.pipeline
         AND p.app = e.parent_app AND p.job_id = e.parent_job_id
       GROUP BY w.owner_uuid, w.pipeline, w.app, w.job_id
       HAVING bool_and(e.app IS NULL OR p.state IN ('completed', 'skipped'))
     )
     SELECT * FROM ready ${scoped ? "" : "LIMIT $1"}`,
    scoped
      ? [args.ownerUuid, args.pipeline, keysJson(args.keys)]
      : [
          args.limit,
          args.excludeOwners ?? [],
          (args.excludePipelines ?? []).map((p) => p.ownerUuid),
          (args.excludePipelines ?? []).map((p) => p.pipeline),
        ],
  );
  return rows.map((r) => ({
    ownerUuid: r.owner_uuid,
    pipeline: r.pipeline,
    app: r.app,
    jobId: r.job_id,
    parents: r.parents ?? [],
  }));
}

/**
 * waiting -> queued with the given bundles (attempts 1), guarded: only jobs still waiting move. Returns the keys
 * that moved; the caller inserts only those bundles, in the same transaction.
 */
export async function queueWaitingJobs(
  db: Db,
  ownerUuid: string,
  pipeline: string,
  jobs: readonly { app: string; jobId: string; bundleUuid: string }[],
): Promise<JobKey[]> {
  if (jobs.length === 0) return [];
  const { rows } = await db.query<{ app: string; job_id: string }>(
    `UPDATE pipeline_jobs j SET state = 'queued', bundle_uuid = r.bundle_uuid, attempts = 1, reason = NULL,
       failed_parent_app = NULL, failed_parent_job_id = NULL, updated_at = ${NOW}
     FROM jsonb_to_recordset($3::jsonb) AS r(app text, job_id text, bundle_uuid text)
     WHERE j.owner_uuid = $1 AND j.pipeline = $2 AND j.app = r.app AND j.job_id = r.job_id AND j.state = 'waiting'
     RETURNING j.app, j.job_id`,
    [
      ownerUuid,
      pipeline,
      JSON.stringify(jobs.map((j) => ({ app: j.app, job_id: j.jobId, bundle_uuid: j.bundleUuid }))),
    ],
  );
  return rows.map((r) => ({ app: r.app, jobId: r.job_id }));
}

/**
 * Says why waiting jobs of one pipeline have not started (their owner is at the queued-bundle cap, the stored
 * definition is no longer valid): `reason` on `jobs`, or with "all" on every waiting job of the pipeline, where
 * it changes and only while they wait; null takes it away (a definition stored again). A job that leaves
 * waiting loses it (queueWaitingJobs, resetJobs). Returns how many rows changed.
 */
export async function noteWaitingJobs(
  db: Db,
  ownerUuid: string,
  pipeline: string,
  jobs: readonly JobKey[] | "all",
  reason: string | null,
): Promise<number> {
  if (jobs.length === 0) return 0;
  const { rowCount } = await db.query(
    `UPDATE pipeline_jobs j SET reason = $3::text, updated_at = ${NOW}
     WHERE j.owner_uuid = $1 AND j.pipeline = $2 AND j.state = 'waiting' AND j.reason IS DISTINCT FROM $3::text
       AND ($4::jsonb IS NULL OR EXISTS (SELECT 1 FROM jsonb_to_recordset($4::jsonb) AS k(app text, job_id text)
         WHERE k.app = j.app AND k.job_id = j.job_id))`,
    [ownerUuid, pipeline, reason, jobs === "all" ? null : keysJson(jobs)],
  );
  return rowCount;
}

/** waiting -> failed with a reason (its bundle could not be made), guarded. */
export async function failWaitingJob(
  db: Db,
  ownerUuid: string,
  pipeline: string,
  job: JobKey,
  reason: string,
): Promise<boolean> {
  const { rowCount } = await db.query(
    `UPDATE pipeline_jobs SET state = 'failed', reason = $5, updated_at = ${NOW}
     WHERE owner_uuid = $1 AND pipeline = $2 AND app = $3 AND job_id = $4 AND state = 'waiting'`,
    [ownerUuid, pipeline, job.app, job.jobId, reason],
  );
  return rowCount > 0;
}

/** A queued job whose bundle is final. */
export interface FinishedJob {
  ownerUuid: string;
  pipeline: string;
  app: string;
  jobId: string;
  bundleUuid: string;
  attempts: number;
  bundleState: "ready" | "failed" | "killed";
  bundleReason: string | null;
}

/**
 * Whether any job is waiting or queued (both on partial indexes): without one, a pipeline manager's pass has
 * nothing to move, and its three queries cost ~30 ms on PGlite for every bundle that ends.
 */
export async function anyOpenJobs(db: Db): Promise<boolean> {
  const { rows } = await db.query<{ open: boolean }>(
    `SELECT EXISTS (SELECT 1 FROM pipeline_jobs WHERE state = 'queued')
         OR EXISTS (SELECT 1 FROM pipeline_jobs WHERE state = 'waiting') AS open`,
  );
  return rows[0]?.open === true;
}

/** Queued jobs whose bundle is ready, failed or killed (at most `limit`). */
export async function finishedQueuedJobs(
  db: Db,
  limit: number,
  excludeBundles: readonly string[] = [],
): Promise<FinishedJob[]> {
  const { rows } = await db.query<{
    owner_uuid: string;
    pipeline: string;
    app: string;
    job_id: string;
    bundle_uuid: string;
    attempts: number;
    bundle_state: FinishedJob["bundleState"];
    state_reason: string | null;
  }>(
    `SELECT j.owner_uuid, j.pipeline, j.app, j.job_id, j.bundle_uuid, j.attempts, b.state AS bundle_state,
       b.state_reason
     FROM pipeline_jobs j JOIN bundles b ON b.uuid = j.bundle_uuid
     WHERE j.state = 'queued' AND b.state IN ('ready', 'failed', 'killed') AND j.bundle_uuid <> ALL($2::text[])
     LIMIT $1`,
    [limit, excludeBundles],
  );
  return rows.map((r) => ({
    ownerUuid: r.owner_uuid,
    pipeline: r.pipeline,
    app: r.app,
    jobId: r.job_id,
    bundleUuid: r.bundle_uuid,
    attempts: r.attempts,
    bundleState: r.bundle_state,
    bundleReason: r.state_reason,
  }));
}

/**
 * A queued job leaves the bundle `fromBundle`: to `completed`, to `failed` (with a reason), or to `queued` again
 * with a new bundle (`retryBundle`, attempts + 1). Guarded by state and bundle; false when another server moved
 * it first.
 */
export async function finishQueuedJob(
  db: Db,
  job: { ownerUuid: string; pipeline: string; app: string; jobId: string },
  fromBundle: string,
  to: { state: "completed" } | { state: "failed"; reason: string } | { state: "queued"; retryBundle: string },
): Promise<boolean> {
  const { rowCount } = await db.query(
    `UPDATE pipeline_jobs SET state = $6,
       bundle_uuid = coalesce($7, bundle_uuid),
       attempts = attempts + CASE WHEN $7::text IS NULL THEN 0 ELSE 1 END,
       reason = $8, updated_at = ${NOW}
     WHERE owner_uuid = $1 AND pipeline = $2 AND app = $3 AND job_id = $4 AND state = 'queued' AND bundle_uuid = $5`,
    [
      job.ownerUuid,
      job.pipeline,
      job.app,
      job.jobId,
      fromBundle,
      to.state,
      to.state === "queued" ? to.retryBundle : null,
      to.state === "failed" ? to.reason : null,
    ],
  );
  return rowCount > 0;
}

/**
 * One level of failure propagation: waiting jobs with a failed parent become failed, naming the ancestor that
 * ran and failed (the parent's own failed parent when it inherited its failure, else the parent). Returns the
 * number of jobs moved; call again until 0 to reach every descendant.
 */
export async function propagateFailures(db: Db): Promise<number> {
  const { rowCount } = await db.query(
    `UPDATE pipeline_jobs c SET state = 'failed', failed_parent_app = f.app, failed_parent_job_id = f.job_id,
       reason = 'parent ' || f.app || ' ' || f.job_id || ' failed', updated_at = ${NOW}
     FROM (
       SELECT DISTINCT ON (w.owner_uuid, w.pipeline, w.app, w.job_id) w.owner_uuid, w.pipeline, w.app AS c_app,
         w.job_id AS c_job_id, coalesce(p.failed_parent_app, p.app) AS app,
         coalesce(p.failed_parent_job_id, p.job_id) AS job_id
       FROM pipeline_jobs w
       JOIN pipeline_job_parents e ON e.owner_uuid = w.owner_uuid AND e.pipeline = w.pipeline AND e.app = w.app
         AND e.job_id = w.job_id
       JOIN pipeline_jobs p ON p.owner_uuid = e.owner_uuid AND p.pipeline = e.pipeline AND p.app = e.parent_app
         AND p.job_id = e.parent_job_id
       WHERE w.state = 'waiting' AND p.state = 'failed'
       ORDER BY w.owner_uuid, w.pipeline, w.app, w.job_id, e.parent_app, e.parent_job_id
     ) f
     WHERE c.owner_uuid = f.owner_uuid AND c.pipeline = f.pipeline AND c.app = f.c_app AND c.job_id = f.c_job_id
       AND c.state = 'waiting'`,
  );
  return rowCount;
}

/** Every descendant of a job (children, their children, ...), each once. */
export async function descendantsOf(
  db: Db,
  ownerUuid: string,
  pipeline: string,
  job: JobKey,
): Promise<PipelineJob[]> {
  const { rows } = await db.query<JobRow>(
    `WITH RECURSIVE d(app, job_id) AS (
       SELECT e.app, e.job_id FROM pipeline_job_parents e
       WHERE e.owner_uuid = $1 AND e.pipeline = $2 AND e.parent_app = $3 AND e.parent_job_id = $4
       UNION
       SELECT e.app, e.job_id FROM d JOIN pipeline_job_parents e
         ON e.owner_uuid = $1 AND e.pipeline = $2 AND e.parent_app = d.app AND e.parent_job_id = d.job_id
     )
     SELECT j.* FROM d JOIN pipeline_jobs j ON j.owner_uuid = $1 AND j.pipeline = $2 AND j.app = d.app
       AND j.job_id = d.job_id`,
    [ownerUuid, pipeline, job.app, job.jobId],
  );
  return rows.map(jobFromRow);
}

/**
 * Jobs back to `waiting` for a rerun (attempts 0, no bundle, no reason), guarded: only jobs in one of `fromStates`
 * move. Returns the keys that moved.
 */
export async function resetJobs(
  db: Db,
  ownerUuid: string,
  pipeline: string,
  keys: readonly JobKey[],
  fromStates: readonly PipelineJobState[],
): Promise<JobKey[]> {
  if (keys.length === 0) return [];
  const { rows } = await db.query<{ app: string; job_id: string }>(
    `UPDATE pipeline_jobs j SET state = 'waiting', bundle_uuid = NULL, attempts = 0, reason = NULL,
       failed_parent_app = NULL, failed_parent_job_id = NULL, updated_at = ${NOW}
     FROM jsonb_to_recordset($3::jsonb) AS k(app text, job_id text)
     WHERE j.owner_uuid = $1 AND j.pipeline = $2 AND j.app = k.app AND j.job_id = k.job_id
       AND j.state = ANY($4::text[])
     RETURNING j.app, j.job_id`,
    [ownerUuid, pipeline, keysJson(keys), [...fromStates]],
  );
  return rows.map((r) => ({ app: r.app, jobId: r.job_id }));
}

/** A job or an ancestor of it, with its parents' keys and its bundle's state. */
export interface AncestorRow {
  job: PipelineJob;
  bundleState: string | null;
  parents: JobKey[];
}

/** A job and every ancestor of it (each once), each with its parents' keys; empty when the job does not exist. */
export async function jobWithAncestors(
  db: Db,
  ownerUuid: string,
  pipeline: string,
  job: JobKey,
): Promise<AncestorRow[]> {
  const { rows } = await db.query<JobRow & { bundle_state: string | null; parents: JobKey[] | null }>(
    `WITH RECURSIVE a(app, job_id) AS (
       SELECT $3::text, $4::text
       UNION
       SELECT e.parent_app, e.parent_job_id FROM a JOIN pipeline_job_parents e
         ON e.owner_uuid = $1 AND e.pipeline = $2 AND e.app = a.app AND e.job_id = a.job_id
     )
     SELECT j.*, b.state AS bundle_state, (
         SELECT jsonb_agg(jsonb_build_object('app', e.parent_app, 'jobId', e.parent_job_id)
           ORDER BY e.parent_app, e.parent_job_id)
         FROM pipeline_job_parents e
         WHERE e.owner_uuid = $1 AND e.pipeline = $2 AND e.app = j.app AND e.job_id = j.job_id) AS parents
     FROM a JOIN pipeline_jobs j ON j.owner_uuid = $1 AND j.pipeline = $2 AND j.app = a.app AND j.job_id = a.job_id
     LEFT JOIN bundles b ON b.uuid = j.bundle_uuid`,
    [ownerUuid, pipeline, job.app, job.jobId],
  );
  return rows.map((r) => ({ job: jobFromRow(r), bundleState: r.bundle_state, parents: r.parents ?? [] }));
}
