/**
 * The users' API for pipelines (docs/api.md "Pipelines", docs/pipelines.md "Running"): store a definition, run a
 * job (bubble up), rerun one, and read a job with its ancestors. Everything is the caller's own.
 */
import { Type } from "@sinclair/typebox";
import type { FastifyInstance, FastifyRequest } from "fastify";
import { DispatchCloudError } from "../../lib/errors.ts";
import type { PipelineDefinition } from "../../lib/pipeline/definition.ts";
import { validatePipeline } from "../../lib/pipeline/definition.ts";
import {
  descendantsOf,
  getJobs,
  getPipeline,
  type JobKey,
  jobWithAncestors,
  listPipelines,
  noteWaitingJobs,
  type PipelineJob,
  propagateFailures,
  readyWaitingJobs,
  resetJobs,
  upsertPipeline,
} from "../../store/pipeline-queries.ts";
import { callerOf, userAuthHook } from "../auth.ts";
import type { RouteContext } from "../context.ts";
import { invalidBody, validate } from "../validate.ts";
import { bubbleUp, DefinitionCache, definitionDigest, type PipelineEnv, startJobs } from "./jobs.ts";

/** As a definition's `name` (lib/pipeline/definition.ts). */
export const PIPELINE_NAME_PATTERN = "^[A-Za-z][A-Za-z0-9_-]{0,49}$";
const PIPELINE_NAME = new RegExp(PIPELINE_NAME_PATTERN);

export const PipelineRequest = Type.Object(
  {
    definition: Type.Object(
      {},
      { additionalProperties: true, description: "The pipeline definition as JSON (docs/pipelines.md)." },
    ),
  },
  { additionalProperties: false },
);

export const APP_NAME_PATTERN = "^[A-Za-z][A-Za-z0-9_-]{0,49}$";
export const JOB_ID_PATTERN = "^[A-Za-z0-9._-]{1,100}$";
const APP_MESSAGE = "must be 1-50 characters from A-Z a-z 0-9 _ -, starting with a letter";
const JOB_ID_MESSAGE = "must be 1-100 characters from A-Z a-z 0-9 . _ -";

const JOB_FIELDS = {
  app: Type.String({ pattern: APP_NAME_PATTERN, errorMessage: APP_MESSAGE }),
  jobId: Type.String({ pattern: JOB_ID_PATTERN, errorMessage: JOB_ID_MESSAGE }),
};

export const RunRequest = Type.Object(JOB_FIELDS, { additionalProperties: false });
export const RerunRequest = Type.Object(
  {
    ...JOB_FIELDS,
    descendants: Type.Optional(
      Type.Boolean({ default: false, description: "Also every completed or failed descendant." }),
    ),
  },
  { additionalProperties: false },
);

/** A job as the API shows it. */
export interface JobView {
  app: string;
  jobId: string;
  state: PipelineJob["state"];
  bundleUuid: string | null;
  attempts: number;
  reason: string | null;
  failedParent: JobKey | null;
  createdAt: string;
  updatedAt: string;
}

export const jobView = (j: PipelineJob): JobView => ({
  app: j.app,
  jobId: j.jobId,
  state: j.state,
  bundleUuid: j.bundleUuid,
  attempts: j.attempts,
  reason: j.reason,
  failedParent: j.failedParent,
  createdAt: j.createdAt.toISOString(),
  updatedAt: j.updatedAt.toISOString(),
});

/** A node of `GET .../jobs/:app/:jobId`: the job, its bundle's state, and its parents' nodes. */
export type JobTreeNode = JobView & {
  bundleState: string | null;
  /** Set on a job shown already elsewhere in the tree (a shared ancestor); its parents are listed there. */
  repeated?: true;
  parents: JobTreeNode[];
};

function nameParam(request: FastifyRequest): string {
  const name = (request.params as Record<string, string | undefined>)["name"] ?? "";
  if (!PIPELINE_NAME.test(name)) {
    throw new DispatchCloudError(
      "request.invalid_param",
      "name: must be a letter, then up to 49 of A-Z a-z 0-9 _ -",
      { path: "name" },
    );
  }
  return name;
}

/** `:app` and `:jobId` of a job's path. */
function jobParams(request: FastifyRequest): JobKey {
  const params = request.params as Record<string, string | undefined>;
  const app = params["app"] ?? "";
  const jobId = params["jobId"] ?? "";
  if (!new RegExp(APP_NAME_PATTERN).test(app)) {
    throw new DispatchCloudError("request.invalid_param", `app: ${APP_MESSAGE}`, { path: "app" });
  }
  if (!new RegExp(JOB_ID_PATTERN).test(jobId)) {
    throw new DispatchCloudError("request.invalid_param", `jobId: ${JOB_ID_MESSAGE}`, { path: "jobId" });
  }
  return { app, jobId };
}

const keyOf = (j: JobKey): string => `${j.app}\u0000${j.jobId}`;

export function registerPipelineRoutes(app: FastifyInstance, ctx: RouteContext, env: PipelineEnv): void {
  const { db } = ctx;
  const onRequest = userAuthHook(db, ctx.nowMs, ctx.tokenCache);
  const definitions = new DefinitionCache();

  async function definitionOf(ownerUuid: string, name: string): Promise<PipelineDefinition> {
    const def = await definitions.get(db, ownerUuid, name);
    if (def === null) throw new DispatchCloudError("pipeline.not_found", `no pipeline ${name}`);
    return def;
  }

  /**
   * Throws pipeline.not_found unless the owner has the pipeline. Reading a pipeline or its jobs does not validate
   * its stored definition: a definition an older server accepted and this one refuses must not hide the jobs.
   */
  async function mustExist(ownerUuid: string, name: string): Promise<void> {
    if ((await getPipeline(db, ownerUuid, name)) === null)
      throw new DispatchCloudError("pipeline.not_found", `no pipeline ${name}`);
  }

  async function oneJob(ownerUuid: string, name: string, key: JobKey): Promise<PipelineJob> {
    const [job] = await getJobs(db, ownerUuid, name, [key]);
    if (job === undefined) {
      throw new DispatchCloudError(
        "pipeline.job_not_found",
        `pipeline ${name} has no job ${key.app} ${key.jobId}`,
      );
    }
    return job;
  }

  app.put("/api/v1/pipelines/:name", { onRequest }, async (request, reply) => {
    const name = nameParam(request);
    const body = validate(PipelineRequest, request.body);
    const def = validatePipeline(body.definition, "definition");
    if (def.name !== name) {
      throw invalidBody(
        "definition.name",
        `must be the pipeline's name in the path, ${JSON.stringify(name)}`,
      );
    }
    const { pipeline, created } = await upsertPipeline(db, {
      ownerUuid: callerOf(request).uuid,
      name,
      definition: body.definition,
      digest: definitionDigest(body.definition),
    });
    // What waiting jobs said about the definition before is no longer so; a pass of the manager says anew why
    // any of them still waits.
    if (!created) await noteWaitingJobs(db, callerOf(request).uuid, name, "all", null);
    return reply.code(created ? 201 : 200).send({
      name: pipeline.name,
      digest: pipeline.digest,
      definition: pipeline.definition,
      createdAt: pipeline.createdAt.toISOString(),
      updatedAt: pipeline.updatedAt.toISOString(),
    });
  });

  app.get("/api/v1/pipelines", { onRequest }, async (request) => {
    const items = await listPipelines(db, callerOf(request).uuid);
    return {
      items: items.map((p) => ({
        name: p.name,
        digest: p.digest,
        apps: Object.keys((p.definition as { apps?: object }).apps ?? {}).sort(),
        jobs: p.jobs,
        createdAt: p.createdAt.toISOString(),
        updatedAt: p.updatedAt.toISOString(),
      })),
    };
  });

  app.get("/api/v1/pipelines/:name", { onRequest }, async (request) => {
    const name = nameParam(request);
    const owner = callerOf(request).uuid;
    const [p] = (await listPipelines(db, owner)).filter((x) => x.name === name);
    if (p === undefined) throw new DispatchCloudError("pipeline.not_found", `no pipeline ${name}`);
    return {
      name,
      digest: p.digest,
      definition: p.definition,
      jobs: p.jobs,
      createdAt: p.createdAt.toISOString(),
      updatedAt: p.updatedAt.toISOString(),
    };
  });

  app.post("/api/v1/pipelines/:name/run", { onRequest }, async (request) => {
    const name = nameParam(request);
    const body = validate(RunRequest, request.body);
    const owner = callerOf(request).uuid;
    const def = await definitionOf(owner, name);
    const root = { app: body.app, jobId: body.jobId };
    if (def.apps[root.app] === undefined) {
      throw invalidBody("app", `pipeline ${name} has no app ${JSON.stringify(root.app)}`);
    }
    const { created, started, timings } = await bubbleUp(env, owner, name, def, root);
    request.log.info(
      { owner, pipeline: name, app: root.app, jobId: root.jobId, created: created.length, started, timings },
      "pipeline run",
    );
    return { job: jobView(await oneJob(owner, name, root)), created, started };
  });

  app.post("/api/v1/pipelines/:name/rerun", { onRequest }, async (request) => {
    const name = nameParam(request);
    const body = validate(RerunRequest, request.body);
    const owner = callerOf(request).uuid;
    const def = await definitionOf(owner, name);
    const key = { app: body.app, jobId: body.jobId };
    const job = await oneJob(owner, name, key);
    if (job.state === "queued") {
      throw new DispatchCloudError(
        "pipeline.job_active",
        `job ${key.app} ${key.jobId} is queued with bundle ${job.bundleUuid}; kill the bundle or wait until it is final`,
      );
    }
    const reset = await db.transaction(async (tx) => {
      const moved = await resetJobs(tx, owner, name, [key], ["completed", "failed", "waiting"]);
      const below = await descendantsOf(tx, owner, name, key);
      const again = below.filter((d) =>
        body.descendants === true
          ? d.state === "completed" || d.state === "failed"
          : d.state === "failed" && d.failedParent !== null && keyOf(d.failedParent) === keyOf(key),
      );
      moved.push(...(await resetJobs(tx, owner, name, again, ["completed", "failed"])));
      return moved;
    });
    // A parent that is still failed fails the job again (naming it); a satisfied one lets it start at once.
    while ((await propagateFailures(db)) > 0);
    const { started } = await startJobs(
      env,
      def,
      await readyWaitingJobs(db, { ownerUuid: owner, pipeline: name, keys: reset }),
    );
    request.log.info({ owner, pipeline: name, ...key, reset: reset.length, started }, "pipeline rerun");
    return { job: jobView(await oneJob(owner, name, key)), reset, started };
  });

  app.get("/api/v1/pipelines/:name/jobs/:app/:jobId", { onRequest }, async (request) => {
    const name = nameParam(request);
    const key = jobParams(request);
    const owner = callerOf(request).uuid;
    await mustExist(owner, name);
    const rows = await jobWithAncestors(db, owner, name, key);
    const byKey = new Map(rows.map((r) => [keyOf(r.job), r]));
    if (!byKey.has(keyOf(key))) {
      throw new DispatchCloudError(
        "pipeline.job_not_found",
        `pipeline ${name} has no job ${key.app} ${key.jobId}`,
      );
    }
    const shown = new Set<string>();
    const node = (k: JobKey): JobTreeNode => {
      const r = byKey.get(keyOf(k))!;
      const base = { ...jobView(r.job), bundleState: r.bundleState };
      if (shown.has(keyOf(k))) return { ...base, repeated: true, parents: [] };
      shown.add(keyOf(k));
      return { ...base, parents: r.parents.filter((p) => byKey.has(keyOf(p))).map(node) };
    };
    return { job: node(key) };
  });
}
