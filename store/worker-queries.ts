/**
 * Users' own workers (store/migrations/010_workers.sql; docs/workers.md). A worker row is made with its token; a
 * check-in records what the worker reports; the dispatcher reads the live ones and gives them bundles
 * (store/transitions.ts startBundleOnWorker); a check-in picks up the bundles given to it (deliverToWorker).
 */
import { DispatchCloudError } from "../lib/errors.ts";
import type { Db } from "./db.ts";
import { type BundleRow, bundleFromRow, NOW } from "./queries.ts";
import { type Bundle, WORKER_CHANNEL, type Worker, type WorkerResources, type WorkerState } from "./types.ts";

interface WorkerRow {
  id: string;
  owner_uuid: string;
  name: string;
  state: WorkerState;
  disabled_at: Date | null;
  tags: string[];
  resources: WorkerResources | null;
  slots: number;
  version: string | null;
  artifact_sha256: string | null;
  cache: string[];
  running: { uuid: string; attempt: number }[];
  created_at: Date;
  checked_in_at: Date | null;
  checkin_age_ms?: string | number | null;
}

const COLUMNS = `id, owner_uuid, name, state, disabled_at, tags, resources, slots, version, artifact_sha256, cache,
  running, created_at, checked_in_at,
  (extract(epoch FROM (clock_timestamp() - checked_in_at)) * 1000)::bigint AS checkin_age_ms`;

function workerFromRow(r: WorkerRow): Worker {
  return {
    id: r.id,
    ownerUuid: r.owner_uuid,
    name: r.name,
    state: r.state,
    disabledAt: r.disabled_at,
    tags: r.tags,
    resources: r.resources,
    slots: r.slots,
    version: r.version,
    artifactSha256: r.artifact_sha256,
    cache: r.cache,
    running: r.running,
    createdAt: r.created_at,
    checkedInAt: r.checked_in_at,
    checkinAgeMs:
      r.checkin_age_ms === undefined || r.checkin_age_ms === null ? null : Number(r.checkin_age_ms),
  };
}

/** Makes a worker of ownerUuid with the hash of its token; workers.name_taken when the owner has one so named. */
export async function createWorker(
  db: Db,
  w: { id: string; ownerUuid: string; name: string; tokenHash: string },
): Promise<Worker> {
  const { rows } = await db.query<WorkerRow>(
    `INSERT INTO workers (id, owner_uuid, name, token_hash) VALUES ($1, $2, $3, $4)
     ON CONFLICT (owner_uuid, name) DO NOTHING RETURNING ${COLUMNS}`,
    [w.id, w.ownerUuid, w.name, w.tokenHash],
  );
  if (rows.length === 0) {
    throw new DispatchCloudError("workers.name_taken", `you already have a worker named ${w.name}`, {
      path: "name",
    });
  }
  return workerFromRow(rows[0]!);
}

/** The worker a token (by its hash) belongs to, disabled or not; null for an unknown token. */
export async function findWorkerByTokenHash(db: Db, tokenHash: string): Promise<Worker | null> {
  const { rows } = await db.query<WorkerRow>(`SELECT ${COLUMNS} FROM workers WHERE token_hash = $1`, [
    tokenHash,
  ]);
  return rows[0] === undefined ? null : workerFromRow(rows[0]);
}

export async function getWorker(db: Db, id: string): Promise<Worker | null> {
  const { rows } = await db.query<WorkerRow>(`SELECT ${COLUMNS} FROM workers WHERE id = $1`, [id]);
  return rows[0] === undefined ? null : workerFromRow(rows[0]);
}

/** One owner's workers (or every worker: ownerUuid null), by creation. */
export async function listWorkers(db: Db, ownerUuid: string | null): Promise<Worker[]> {
  const { rows } = await db.query<WorkerRow>(
    `SELECT ${COLUMNS} FROM workers WHERE $1::text IS NULL OR owner_uuid = $1 ORDER BY created_at, id`,
    [ownerUuid],
  );
  return rows.map(workerFromRow);
}

/**
 * The workers the dispatcher may give bundles to or must watch: active or draining (disabled ones too: they get
 * nothing new, but their bundles are watched until they go silent and are lost). With each, how
 * long ago it checked in by the database's clock (checkinAgeMs), so no two machines' clocks are compared.
 */
export async function liveWorkers(db: Db): Promise<Worker[]> {
  const { rows } = await db.query<WorkerRow>(
    `SELECT ${COLUMNS} FROM workers WHERE state IN ('active', 'draining') ORDER BY id`,
  );
  return rows.map(workerFromRow);
}

/** Sets or clears disabled_at; null when there is no such worker (of that owner, when ownerUuid is given). */
export async function setWorkerDisabled(
  db: Db,
  id: string,
  disabled: boolean,
  ownerUuid: string | null,
): Promise<Worker | null> {
  const { rows } = await db.query<WorkerRow>(
    `UPDATE workers SET disabled_at = CASE WHEN $2 THEN coalesce(disabled_at, ${NOW})
       ELSE NULL END
     WHERE id = $1 AND ($3::text IS NULL OR owner_uuid = $3) RETURNING ${COLUMNS}`,
    [id, disabled, ownerUuid],
  );
  if (rows[0] === undefined) return null;
  await notifyWorkers(db, [id]);
  return workerFromRow(rows[0]);
}

/** What a check-in records (already validated). */
export interface CheckinRecord {
  state: "active" | "draining" | "stopped";
  tags: string[];
  resources: WorkerResources;
  slots: number;
  version: string;
  artifactSha256: string | null;
  cache: string[];
  running: { uuid: string; attempt: number }[];
}

/**
 * Records a check-in of worker id (not disabled). NOTIFYs WORKER_CHANNEL when anything the dispatcher places by
 * changed (state, tags, resources, slots, cache, what it runs), so the dispatcher need not wait for its poll.
 * Null when the worker is gone or disabled.
 */
export async function recordCheckin(db: Db, id: string, c: CheckinRecord): Promise<Worker | null> {
  const { rows } = await db.query<WorkerRow & { changed: boolean }>(
    `WITH old AS (SELECT * FROM workers WHERE id = $1 AND disabled_at IS NULL FOR UPDATE),
     upd AS (
       UPDATE workers w SET state = $2, tags = $3::text[], resources = $4::jsonb, slots = $5, version = $6,
         artifact_sha256 = $7, cache = $8::jsonb, running = $9::jsonb,
         checked_in_at = ${NOW}
       FROM old WHERE w.id = old.id
       RETURNING w.*, (old.state IS DISTINCT FROM w.state OR old.tags IS DISTINCT FROM w.tags
         OR old.resources IS DISTINCT FROM w.resources OR old.slots IS DISTINCT FROM w.slots
         OR old.cache IS DISTINCT FROM w.cache OR old.running IS DISTINCT FROM w.running) AS changed
     )
     SELECT upd.*, 0::bigint AS checkin_age_ms FROM upd`,
    [
      id,
      c.state,
      c.tags,
      JSON.stringify(c.resources),
      c.slots,
      c.version,
      c.artifactSha256,
      JSON.stringify(c.cache),
      JSON.stringify(c.running),
    ],
  );
  const r = rows[0];
  if (r === undefined) return null;
  if (r.changed) await notifyWorkers(db, [id]);
  return workerFromRow(r);
}

/**
 * Marks a worker lost when its last check-in is older than timeoutMs (by the database's clock) and it is still
 * active or draining. True when this call marked it (only one caller can).
 */
export async function markWorkerLost(db: Db, id: string, timeoutMs: number): Promise<boolean> {
  const { rows } = await db.query(
    `UPDATE workers SET state = 'lost' WHERE id = $1 AND state IN ('active', 'draining')
       AND checked_in_at < clock_timestamp() - ($2::bigint * interval '1 millisecond') RETURNING id`,
    [id, timeoutMs],
  );
  if (rows.length > 0) await notifyWorkers(db, [id]);
  return rows.length > 0;
}

/** Bundles whose current attempt is with this worker (starting or running). */
export async function workerBundles(db: Db, workerId: string): Promise<Bundle[]> {
  const { rows } = await db.query<BundleRow>(
    "SELECT * FROM bundles WHERE worker_id = $1 AND state IN ('starting', 'running') ORDER BY starting_at, uuid",
    [workerId],
  );
  return rows.map(bundleFromRow);
}

/**
 * Hands bundle uuid's attempt to its worker: records the runner token's hash and when, only while the bundle is
 * still starting on that worker in that attempt and was not handed over before. The bundle, or null when the
 * guard did not hold (the dispatcher requeued it, another check-in delivered it, ...).
 */
export async function deliverToWorker(
  db: Db,
  uuid: string,
  attempt: number,
  workerId: string,
  runnerTokenHash: string,
): Promise<Bundle | null> {
  const { rows } = await db.query<BundleRow>(
    `UPDATE bundles SET runner_token_hash = $4, worker_delivered_at = ${NOW}
     WHERE uuid = $1 AND attempt = $2 AND worker_id = $3 AND state = 'starting' AND worker_delivered_at IS NULL
     RETURNING *`,
    [uuid, attempt, workerId, runnerTokenHash],
  );
  return rows[0] === undefined ? null : bundleFromRow(rows[0]);
}

/** NOTIFYs WORKER_CHANNEL once per worker id. */
export async function notifyWorkers(db: Db, ids: readonly string[]): Promise<void> {
  for (const id of new Set(ids)) await db.query("SELECT pg_notify($1, $2)", [WORKER_CHANNEL, id]);
}

/**
 * Bundles of ownerUuid's that are starting on this worker and were not handed to a check-in yet (deliverToWorker).
 * Another user's bundle given to it (which the dispatcher never does) is never handed over: it stays undelivered
 * until the delivery timeout requeues it.
 */
export async function undeliveredWorkerBundles(
  db: Db,
  workerId: string,
  ownerUuid: string,
): Promise<Bundle[]> {
  const { rows } = await db.query<BundleRow>(
    `SELECT * FROM bundles WHERE worker_id = $1 AND owner_uuid = $2 AND state = 'starting'
       AND worker_delivered_at IS NULL
     ORDER BY starting_at, uuid`,
    [workerId, ownerUuid],
  );
  return rows.map(bundleFromRow);
}

/** What a check-in needs to know of a bundle it reports running: whose it is and where its attempt is. */
export interface ReportedBundle {
  uuid: string;
  ownerUuid: string;
  state: Bundle["state"];
  attempt: number;
  workerId: string | null;
}

/** The bundles of these uuids that exist (in no particular order). */
export async function reportedBundles(db: Db, uuids: readonly string[]): Promise<ReportedBundle[]> {
  if (uuids.length === 0) return [];
  const { rows } = await db.query<{
    uuid: string;
    owner_uuid: string;
    state: Bundle["state"];
    attempt: number;
    worker_id: string | null;
  }>("SELECT uuid, owner_uuid, state, attempt, worker_id FROM bundles WHERE uuid = ANY($1::text[])", [
    [...new Set(uuids)],
  ]);
  return rows.map((r) => ({
    uuid: r.uuid,
    ownerUuid: r.owner_uuid,
    state: r.state,
    attempt: r.attempt,
    workerId: r.worker_id,
  }));
}

/** A worker checked out: state stopped, nothing running. NOTIFYs WORKER_CHANNEL. Null when it is gone. */
export async function checkoutWorker(db: Db, id: string): Promise<Worker | null> {
  const { rows } = await db.query<WorkerRow>(
    `UPDATE workers SET state = 'stopped', running = '[]'::jsonb, checked_in_at = ${NOW}
     WHERE id = $1 RETURNING ${COLUMNS}`,
    [id],
  );
  if (rows[0] === undefined) return null;
  await notifyWorkers(db, [id]);
  return workerFromRow(rows[0]);
}
