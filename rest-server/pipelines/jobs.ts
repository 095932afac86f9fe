/**
 * Running pipelines (docs/pipelines.md "Running"): what the routes (routes.ts) and the manager (manager.ts)
 * share. Bubble up creates a job and every ancestor not yet stored; starting a job makes its bundle, whose
 * dependencies are its completed parents' bundles, each mounted as `<app>.<jobId>`. Every state change is a
 * guarded statement (store/pipeline-queries.ts), and a job's bundle is inserted in the transaction that moves the
 * job, so two servers never make two bundles for one job.
 */
import { createHash } from "node:crypto";
import { DispatchCloudError } from "../../lib/errors.ts";
import type { Logger } from "../../lib/logger.ts";
import { type PipelineDefinition, validatePipeline } from "../../lib/pipeline/definition.ts";
import { isSkipped, type JobRef, parentsOf, parseJobId, renderBundle } from "../../lib/pipeline/graph.ts";
import { newBundleUuid } from "../../lib/tokens.ts";
import type { Db } from "../../store/db.ts";
import {
  analyzeJobTables,
  failWaitingJob,
  getJobs,
  getPipeline,
  insertJobParents,
  insertJobs,
  type JobKey,
  noteWaitingJobs,
  queueWaitingJobs,
  type ReadyJob,
  readyWaitingJobs,
} from "../../store/pipeline-queries.ts";
import { countActiveBundles, getUser, insertBundles, lockSubmitBucket } from "../../store/queries.ts";
import type { NewBundle } from "../../store/types.ts";
import { type BundleMinimums, parseBundleRequest } from "../bundle-request.ts";
import { type ImageResolver, pinImages } from "../image-resolve.ts";
import { limitsApply, NO_SUBMIT_LIMITS, type SubmitLimits } from "../quotas.ts";

/** What running pipelines needs: the database and what a bundle request needs on this server. */
export interface PipelineEnv {
  db: Db;
  clusterId: string;
  /** maxAttempts of a job's bundle (infrastructure retries: a lost instance) when its template does not say. */
  defaultMaxAttempts: number;
  bundleMinimums: BundleMinimums;
  imageResolvers: readonly ImageResolver[];
  logger: Logger;
  /**
   * Per-user limits (config `quotas`; default none). A job's bundle counts against the owner's
   * maxQueuedBundlesPerUser like any other: jobs past it stay waiting until some of the owner's bundles end.
   */
  submitLimits?: SubmitLimits;
}

/**
 * What startJobs did: jobs queued with a bundle, ready jobs left waiting at the owner's queued-bundle cap, and
 * jobs failed because their bundle request was refused.
 */
export interface StartedJobs {
  started: number;
  held: number;
  failed: number;
}

/** The reason a ready job left waiting at its owner's queued-bundle cap shows (docs/pipelines.md "Quotas"). */
const heldReason = (cap: number): string =>
  `held: its owner has ${cap} unfinished bundles, the most quotas.maxQueuedBundlesPerUser allows; ` +
  "it starts as they end";

/** Rows per multi-row statement of bubble up. */
const CHUNK = 5000;
/** A run that stores at least this many jobs refreshes the tables' statistics (analyzeJobTables) before it reads. */
const ANALYZE_AFTER = 1000;

const keyOf = (j: JobKey): string => `${j.app}\u0000${j.jobId}`;

/**
 * The sha256 of a definition's JSON as the user gave it (stored beside it; a server re-validates a stored
 * definition only when its digest changed).
 */
export function definitionDigest(raw: unknown): string {
  return createHash("sha256").update(JSON.stringify(raw)).digest("hex");
}

/**
 * Definitions read from the store (as the user gave them), validated once per digest; a stored definition this
 * server refuses is remembered too, so the manager's passes do not check it again until it is stored anew.
 */
export class DefinitionCache {
  readonly #byName = new Map<string, { digest: string; def: PipelineDefinition | DispatchCloudError }>();

  /**
   * The owner's pipeline's definition, or null when it does not exist; throws the check's DispatchCloudError
   * when the stored one no longer validates.
   */
  async get(db: Db, ownerUuid: string, name: string): Promise<PipelineDefinition | null> {
    const stored = await getPipeline(db, ownerUuid, name);
    const k = `${ownerUuid}\u0000${name}`;
    if (stored === null) {
      this.#byName.delete(k);
      return null;
    }
    let hit = this.#byName.get(k);
    if (hit === undefined || hit.digest !== stored.digest) {
      let def: PipelineDefinition | DispatchCloudError;
      try {
        def = validatePipeline(stored.definition, "definition");
      } catch (err) {
        if (!(err instanceof DispatchCloudError)) throw err;
        def = err;
      }
      hit = { digest: stored.digest, def };
      this.#byName.set(k, hit);
    }
    if (hit.def instanceof DispatchCloudError) throw hit.def;
    return hit.def;
  }
}

export interface BubbleUpResult {
  /** The jobs this run stored (the job itself first when it is new); empty when everything existed. */
  created: JobKey[];
  /** How many of them got a bundle at once. */
  started: number;
  /** Milliseconds spent walking up the graph (parentsOf, and reading which jobs exist), storing the new jobs and
   * edges, and starting the ready ones (their bundles). */
  timings: { walkMs: number; storeMs: number; startMs: number };
}

/**
 * `run`: the job, and bubbling up through parentsOf, every ancestor not yet stored (a stored job, in any state,
 * stops the walk: completed parents are reused, not rerun). A skipped job (valid_if_or) is stored as `skipped`
 * and its parents are not visited. New jobs and their parent edges are inserted in multi-row statements in one
 * transaction; those whose parents are all satisfied then get their bundles. Running it again creates nothing.
 */
export async function bubbleUp(
  env: PipelineEnv,
  ownerUuid: string,
  pipeline: string,
  def: PipelineDefinition,
  root: JobKey,
): Promise<BubbleUpResult> {
  parseJobId(def, root.app, root.jobId);
  const { db } = env;
  const t0 = performance.now();
  const fresh = new Map<
    string,
    { app: string; jobId: string; state: "waiting" | "skipped"; parents: JobRef[] }
  >();
  const visited = new Set<string>([keyOf(root)]);
  let frontier: JobKey[] = [root];
  while (frontier.length > 0) {
    const stored = new Set<string>();
    for (let i = 0; i < frontier.length; i += CHUNK) {
      for (const j of await getJobs(db, ownerUuid, pipeline, frontier.slice(i, i + CHUNK)))
        stored.add(keyOf(j));
    }
    const next: JobKey[] = [];
    for (const job of frontier) {
      if (stored.has(keyOf(job))) continue;
      const skipped = isSkipped(def, job);
      const parents = skipped ? [] : parentsOf(def, job);
      fresh.set(keyOf(job), {
        app: job.app,
        jobId: job.jobId,
        state: skipped ? "skipped" : "waiting",
        parents,
      });
      for (const p of parents) {
        if (visited.has(keyOf(p))) continue;
        visited.add(keyOf(p));
        next.push({ app: p.app, jobId: p.jobId });
      }
    }
    frontier = next;
  }
  const jobs = [...fresh.values()];
  const t1 = performance.now();
  const created = await db.transaction(async (tx) => {
    // Every job first, then the edges of the jobs this run inserted (a job another run stored meanwhile keeps
    // its own edges); every edge's parent is stored by then, in this batch or before.
    const inserted: JobKey[] = [];
    for (let i = 0; i < jobs.length; i += CHUNK) {
      inserted.push(...(await insertJobs(tx, ownerUuid, pipeline, jobs.slice(i, i + CHUNK))));
    }
    const edges = inserted.flatMap((k) =>
      (fresh.get(keyOf(k))?.parents ?? []).map((p) => ({ child: k, parent: { app: p.app, jobId: p.jobId } })),
    );
    for (let i = 0; i < edges.length; i += CHUNK) {
      await insertJobParents(tx, ownerUuid, pipeline, edges.slice(i, i + CHUNK));
    }
    return inserted;
  });
  if (created.length >= ANALYZE_AFTER) await analyzeJobTables(db);
  const t2 = performance.now();
  let started = 0;
  for (let i = 0; i < created.length; i += CHUNK) {
    const ready = await readyWaitingJobs(db, { ownerUuid, pipeline, keys: created.slice(i, i + CHUNK) });
    started += (await startJobs(env, def, ready)).started;
  }
  const t3 = performance.now();
  return { created, started, timings: { walkMs: t1 - t0, storeMs: t2 - t1, startMs: t3 - t2 } };
}

/**
 * The bundle request of a job with its parents' bundles as dependencies (rendered by the definition, then
 * validated as POST /api/v1/bundles validates a body). Throws DispatchCloudError when the result is refused.
 */
export function jobBundle(
  env: PipelineEnv,
  ownerUuid: string,
  pipeline: string,
  def: PipelineDefinition,
  job: ReadyJob | (JobKey & { parents: ReadyJob["parents"] }),
): NewBundle {
  if (def.apps[job.app] === undefined) {
    throw new DispatchCloudError("pipeline.invalid", `app ${job.app} is no longer in pipeline ${pipeline}`, {
      path: `apps.${job.app}`,
    });
  }
  const body: Record<string, unknown> = { ...renderBundle(def, { app: job.app, jobId: job.jobId }) };
  if (typeof body["name"] !== "string" || body["name"] === "")
    body["name"] = `${pipeline} ${job.app} ${job.jobId}`;
  body["dependencies"] = job.parents.map((p) => ({ bundle: p.bundleUuid, name: `${p.app}.${p.jobId}` }));
  return parseBundleRequest(body, ownerUuid, env.defaultMaxAttempts, env.bundleMinimums);
}

/**
 * How many more bundles (at most `wanted`) `ownerUuid` may have unfinished under quotas.maxQueuedBundlesPerUser;
 * `wanted` when no cap applies (none configured, or an admin). With `lock` (in a transaction) the user's quota
 * row is locked as submissions lock it, so that a submission and a pipeline cannot both take the last places;
 * without, it is an estimate.
 */
async function roomUnderCap(
  db: Db,
  limits: SubmitLimits,
  ownerUuid: string,
  wanted: number,
  lock: boolean,
): Promise<number> {
  const cap = limits.maxQueuedBundlesPerUser;
  if (cap <= 0) return wanted;
  const owner = await getUser(db, ownerUuid);
  if (owner === null || !limitsApply(owner, limits)) return wanted;
  if (lock)
    await lockSubmitBucket(db, { userUuid: ownerUuid, burst: limits.submissionBurst, now: new Date() });
  return Math.max(0, Math.min(wanted, cap - (await countActiveBundles(db, ownerUuid, cap))));
}

/**
 * Ready jobs (waiting, every parent completed or skipped) of one pipeline -> queued, each with a new bundle: one
 * transaction moving them (guarded: only jobs still waiting) and inserting the bundles of those that moved, with
 * one notification. A job whose bundle cannot be made (its rendered request is refused) is failed with the reason.
 * Jobs that would take the owner past quotas.maxQueuedBundlesPerUser stay waiting (`held`), with a reason that
 * says so (heldReason); the manager starts them as the owner's bundles end.
 */
export async function startJobs(
  env: PipelineEnv,
  def: PipelineDefinition,
  ready: readonly ReadyJob[],
): Promise<StartedJobs> {
  if (ready.length === 0) return { started: 0, held: 0, failed: 0 };
  const { db } = env;
  const log = env.logger;
  const limits = env.submitLimits ?? NO_SUBMIT_LIMITS;
  const { ownerUuid, pipeline } = ready[0]!;
  // An estimate first, so that jobs past the cap are neither rendered nor pinned (which may ask a registry) on
  // every pass that finds their owner still at it; the transaction counts again, exactly.
  const fits = await roomUnderCap(db, limits, ownerUuid, ready.length, false);
  const items: { job: ReadyJob; uuid: string; bundle: NewBundle }[] = [];
  let seen = 0;
  let failed = 0;
  for (const job of ready) {
    if (items.length >= fits) break;
    seen++;
    try {
      items.push({
        job,
        uuid: newBundleUuid(env.clusterId),
        bundle: jobBundle(env, job.ownerUuid, job.pipeline, def, job),
      });
    } catch (err) {
      if (!(err instanceof DispatchCloudError)) throw err;
      const where = err.path === undefined ? "" : ` (${err.path})`;
      const reason = `its bundle request was refused: ${err.message}${where}`;
      if (await failWaitingJob(db, job.ownerUuid, job.pipeline, job, reason)) {
        failed++;
        log.warn({ pipeline: job.pipeline, app: job.app, jobId: job.jobId, reason }, "pipeline job failed");
      }
    }
  }
  const notSeen: JobKey[] = ready.slice(seen);
  const pinned = await pinImages(
    env.imageResolvers,
    items.map((it) => it.bundle),
  );
  const result =
    items.length === 0
      ? { started: 0, held: notSeen }
      : await db.transaction(async (tx) => {
          const room = await roomUnderCap(tx, limits, ownerUuid, items.length, true);
          const allowed = items.slice(0, room);
          const held = [...notSeen, ...items.slice(room).map((it) => it.job)];
          if (allowed.length === 0) return { started: 0, held };
          const keys = await queueWaitingJobs(
            tx,
            ownerUuid,
            pipeline,
            allowed.map((it) => ({ app: it.job.app, jobId: it.job.jobId, bundleUuid: it.uuid })),
          );
          const won = new Set(keys.map(keyOf));
          const toInsert = allowed.flatMap((it, i) =>
            won.has(keyOf(it.job)) ? [{ uuid: it.uuid, bundle: pinned[i]! }] : [],
          );
          await insertBundles(tx, ownerUuid, toInsert, "submitted");
          return { started: toInsert.length, held };
        });
  const where = { pipeline, owner: ownerUuid };
  if (result.started > 0) log.info({ ...where, jobs: result.started }, "pipeline jobs queued");
  if (result.held.length > 0) {
    await noteWaitingJobs(db, ownerUuid, pipeline, result.held, heldReason(limits.maxQueuedBundlesPerUser));
    log.info(
      { ...where, jobs: result.held.length },
      "pipeline jobs left waiting: their owner is at quotas.maxQueuedBundlesPerUser",
    );
  }
  return { started: result.started, held: result.held.length, failed };
}
