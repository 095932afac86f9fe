/**
 * The pipeline manager (docs/pipelines.md "Running"): bubble down. Beside the bundle manager, in every process
 * that serves the REST API, it moves pipeline jobs on as their bundles finish:
 *
 * - a queued job whose bundle is `ready` -> completed;
 * - `failed` -> a new bundle (the same request again) while attempts < the app's maxAttempts, else failed;
 *   `killed` -> failed (a kill is a decision, not retried);
 * - waiting jobs with a failed parent -> failed, naming the ancestor that ran and failed (repeated down the graph);
 * - waiting jobs whose parents are all completed or skipped -> queued with a new bundle depending on the parents'.
 *
 * It wakes on the bundle NOTIFY channel when a bundle becomes final, polls as a fallback (notified-loop.ts), and
 * its first pass catches up with whatever happened while no manager ran: all it needs is in the tables. Every
 * change is a guarded statement, so several managers (two REST servers) never move a job twice. One pass is
 * `runOnce()`.
 */
import { DispatchCloudError } from "../../lib/errors.ts";
import type { PipelineDefinition } from "../../lib/pipeline/definition.ts";
import { newBundleUuid } from "../../lib/tokens.ts";
import {
  anyOpenJobs,
  type FinishedJob,
  finishedQueuedJobs,
  finishQueuedJob,
  noteWaitingJobs,
  type PipelineRef,
  propagateFailures,
  type ReadyJob,
  readyWaitingJobs,
} from "../../store/pipeline-queries.ts";
import { getBundle, insertBundles, newBundleOf } from "../../store/queries.ts";
import { BUNDLE_CHANNEL, type BundleState, isFinalState } from "../../store/types.ts";
import { notifiedLoop } from "../notified-loop.ts";
import { DefinitionCache, type PipelineEnv, startJobs } from "./jobs.ts";

export interface PipelineManagerOptions extends PipelineEnv {
  /** Fallback pass interval in ms when no notification arrives (default 10 s). */
  pollInterval?: number;
  /** Jobs read per query (default 1000). */
  batchSize?: number;
}

export interface PipelineManager {
  /** One pass; resolves to the number of jobs moved. */
  runOnce(): Promise<number>;
  start(): Promise<void>;
  stop(): Promise<void>;
}

export function createPipelineManager(opts: PipelineManagerOptions): PipelineManager {
  const { db } = opts;
  const log = opts.logger.child({ component: "pipeline-manager" });
  const env: PipelineEnv = { ...opts, logger: log };
  const pollInterval = opts.pollInterval ?? 10_000;
  const batchSize = opts.batchSize ?? 1000;
  const definitions = new DefinitionCache();
  /** The refusals already logged (one per stored version of a definition). */
  const reported = new WeakSet<DispatchCloudError>();

  /** The pipeline's definition; null when it is gone, a DispatchCloudError when the stored one no longer validates. */
  async function definitionOf(
    ownerUuid: string,
    pipeline: string,
  ): Promise<PipelineDefinition | DispatchCloudError | null> {
    try {
      return await definitions.get(db, ownerUuid, pipeline);
    } catch (err) {
      if (!(err instanceof DispatchCloudError)) throw err;
      // The cache gives the same error for a stored version until it is stored again: said once, not every pass.
      if (!reported.has(err)) {
        reported.add(err);
        log.error(
          { code: err.code, message: err.message, path: err.path, owner: ownerUuid, pipeline },
          "a stored pipeline definition is no longer valid",
        );
      }
      return err;
    }
  }

  /** One finished bundle's job: completed, retried or failed. True when this manager moved it. */
  async function finish(job: FinishedJob): Promise<boolean> {
    const where = { pipeline: job.pipeline, app: job.app, jobId: job.jobId, bundleUuid: job.bundleUuid };
    if (job.bundleState === "ready") {
      const ok = await finishQueuedJob(db, job, job.bundleUuid, { state: "completed" });
      if (ok) log.info(where, "pipeline job completed");
      return ok;
    }
    const def = await definitionOf(job.ownerUuid, job.pipeline);
    const maxAttempts = (def instanceof DispatchCloudError ? null : def)?.apps[job.app]?.maxAttempts ?? 1;
    const detail = job.bundleReason === null ? "" : `: ${job.bundleReason}`;
    if (job.bundleState === "failed" && job.attempts < maxAttempts) {
      const old = await getBundle(db, job.bundleUuid);
      if (old === null) throw new Error(`bundle ${job.bundleUuid} of a queued job does not exist`);
      const uuid = newBundleUuid(opts.clusterId);
      const ok = await db.transaction(async (tx) => {
        if (!(await finishQueuedJob(tx, job, job.bundleUuid, { state: "queued", retryBundle: uuid })))
          return false;
        await insertBundles(tx, job.ownerUuid, [{ uuid, bundle: newBundleOf(old) }], "submitted");
        return true;
      });
      if (ok) {
        log.info(
          { ...where, retryBundleUuid: uuid, attempt: job.attempts + 1, maxAttempts },
          "pipeline job retried",
        );
      }
      return ok;
    }
    const reason =
      job.bundleState === "killed"
        ? `bundle ${job.bundleUuid} was killed${detail}`
        : `bundle ${job.bundleUuid} failed${detail} (attempt ${job.attempts} of ${maxAttempts})`;
    const ok = await finishQueuedJob(db, job, job.bundleUuid, { state: "failed", reason });
    if (ok) log.warn({ ...where, reason }, "pipeline job failed");
    return ok;
  }

  async function runOnce(): Promise<number> {
    // Most bundles that end are no pipeline's: with no job waiting or queued there is nothing to read.
    if (!(await anyOpenJobs(db))) return 0;
    let moved = 0;
    // Finished bundles, page by page: a moved job leaves the query, and one that could not be moved is left out
    // of the following pages, so that a page of them never hides the jobs behind it. A page that does neither
    // (another server moved its jobs) ends the loop.
    const unmoved: string[] = [];
    for (;;) {
      const finished = await finishedQueuedJobs(db, batchSize, unmoved);
      const unmovedBefore = unmoved.length;
      let progress = 0;
      for (const job of finished) {
        try {
          if (await finish(job)) progress++;
        } catch (err) {
          unmoved.push(job.bundleUuid);
          log.error(
            { err, pipeline: job.pipeline, app: job.app, jobId: job.jobId },
            "could not move a pipeline job",
          );
        }
      }
      moved += progress;
      if (finished.length < batchSize || (progress === 0 && unmoved.length === unmovedBefore)) break;
    }
    // Failures down the graph, a level per statement.
    for (let n = await propagateFailures(db); n > 0; n = await propagateFailures(db)) moved += n;
    // Waiting jobs whose parents are satisfied, grouped by pipeline. Owners found at their queued-bundle cap, and
    // pipelines whose jobs could not be started (a stored definition that no longer validates, an error), are
    // left out of the following pages, so that their jobs do not fill every page and starve the others.
    const capped = new Set<string>();
    const stuck = new Map<string, PipelineRef>();
    for (;;) {
      const ready = await readyWaitingJobs(db, {
        limit: batchSize,
        excludeOwners: [...capped],
        excludePipelines: [...stuck.values()],
      });
      const leftOut = capped.size + stuck.size;
      const groups = new Map<string, ReadyJob[]>();
      for (const j of ready) {
        const k = `${j.ownerUuid}\u0000${j.pipeline}`;
        groups.set(k, [...(groups.get(k) ?? []), j]);
      }
      let progress = 0;
      for (const [k, jobs] of groups) {
        const { ownerUuid, pipeline } = jobs[0]!;
        try {
          const def = await definitionOf(ownerUuid, pipeline);
          if (def === null || def instanceof DispatchCloudError) {
            stuck.set(k, { ownerUuid, pipeline });
            if (def !== null) await noteWaitingJobs(db, ownerUuid, pipeline, "all", invalidReason(def));
            continue;
          }
          const { started, held, failed } = await startJobs(env, def, jobs);
          progress += started + failed;
          if (held > 0) capped.add(ownerUuid);
          else if (started + failed === 0) stuck.set(k, { ownerUuid, pipeline });
        } catch (err) {
          stuck.set(k, { ownerUuid, pipeline });
          const e = err instanceof DispatchCloudError ? { code: err.code, message: err.message } : { err };
          log.error({ ...e, owner: ownerUuid, pipeline }, "could not start pipeline jobs");
        }
      }
      moved += progress;
      if (ready.length < batchSize || (progress === 0 && capped.size + stuck.size === leftOut)) break;
    }
    return moved;
  }

  /** The reason ready jobs of a pipeline whose stored definition no longer validates show while they wait. */
  const invalidReason = (err: DispatchCloudError): string => {
    const where = err.path === undefined ? "" : ` (${err.path})`;
    return `waiting: the stored definition of this pipeline is no longer valid: ${err.message}${where}; store it again (PUT) to go on`;
  };

  const loop = notifiedLoop({
    db,
    channel: BUNDLE_CHANNEL,
    // Payload `<uuid> <state> <changeSeq>`: only a final state can move a job.
    filter: (payload) => {
      const state = payload.split(" ")[1];
      return state !== undefined && isFinalState(state as BundleState);
    },
    pollInterval,
    pass: runOnce,
    log,
    name: "pipeline manager",
  });

  return { runOnce, start: loop.start, stop: loop.stop };
}
