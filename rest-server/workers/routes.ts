/**
 * Users' own machines as workers (docs/workers.md, lib/worker-protocol.ts). Users make a worker and its token
 * (shown once), list their workers (admins: everyone's) and disable or enable them. A worker, with its token,
 * checks in (a long poll: it answers at once when there is a message, else after workers.longPoll), checks out
 * and fetches the runner artifact to upgrade itself. A worker only ever hears of its owner's bundles; a check-in
 * that is refused stores nothing.
 */
import type { FastifyInstance, FastifyReply, FastifyRequest } from "fastify";
import { DispatchCloudError } from "../../lib/errors.ts";
import type { RuntimeEngine, StartDocumentSent } from "../../lib/runner-protocol.ts";
import {
  hashToken,
  newRunnerToken,
  newWorkerId,
  newWorkerToken,
  WORKER_ID_PATTERN,
} from "../../lib/tokens.ts";
import { VERSION } from "../../lib/version.ts";
import type { CheckinResponse, WorkerMessage } from "../../lib/worker-protocol.ts";
import { loseBundle, requeueStarting } from "../../store/transitions.ts";
import type { Worker, WorkerResources } from "../../store/types.ts";
import {
  checkoutWorker,
  createWorker,
  deliverToWorker,
  getWorker,
  listWorkers,
  recordCheckin,
  reportedBundles,
  setWorkerDisabled,
  undeliveredWorkerBundles,
  workerBundles,
} from "../../store/worker-queries.ts";
import { authenticateWorker, callerOf, requireAdmin, userAuthHook, workerOf } from "../auth.ts";
import type { RouteContext } from "../context.ts";
import { validate } from "../validate.ts";
import { CheckinRequest, CheckoutRequest, CreateWorkerRequest, checkPlausible } from "./schemas.ts";
import type { WorkerWaiters } from "./waiters.ts";

export interface WorkerRouteOptions {
  /** workers.longPoll, in ms. */
  longPollMs: number;
  /** dispatcher.runtimeEngine: the runtime a worker's start documents name (the worker may override it). */
  runtimeEngine: RuntimeEngine;
  waiters: WorkerWaiters;
}

/** A worker as the users' API shows it: never its token, nor its hash. */
export function workerView(w: Worker) {
  const iso = (d: Date | null) => (d === null ? null : d.toISOString());
  return {
    id: w.id,
    ownerUuid: w.ownerUuid,
    name: w.name,
    state: w.state,
    disabled: w.disabledAt !== null,
    tags: w.tags,
    resources: w.resources,
    slots: w.slots,
    version: w.version,
    artifactSha256: w.artifactSha256,
    cachedTrees: w.cache.length,
    running: w.running,
    createdAt: w.createdAt.toISOString(),
    checkedInAt: iso(w.checkedInAt),
    checkinAgeMs: w.checkinAgeMs ?? null,
  };
}

const WORKER_ID = new RegExp(WORKER_ID_PATTERN);

function workerIdParam(request: FastifyRequest): string {
  const id = (request.params as Record<string, string | undefined>)["id"] ?? "";
  if (!WORKER_ID.test(id)) {
    throw new DispatchCloudError(
      "request.invalid_param",
      `id: not a worker id: ${JSON.stringify(id.slice(0, 60))}`,
      {
        path: "id",
      },
    );
  }
  return id;
}

/** `?all=true|false` (admins: every user's workers); anything else is refused. */
function parseListQuery(query: unknown): { all: boolean } {
  let all = false;
  for (const [key, raw] of Object.entries((query ?? {}) as Record<string, unknown>)) {
    if (key !== "all") {
      throw new DispatchCloudError("request.invalid_query", `${key}: unknown query parameter; known: all`, {
        path: key,
      });
    }
    if (raw !== "true" && raw !== "false") {
      throw new DispatchCloudError("request.invalid_query", "all: must be true or false", { path: "all" });
    }
    all = raw === "true";
  }
  return { all };
}

const notFound = (id: string) =>
  new DispatchCloudError("workers.not_found", `no worker ${id}`, { path: "id" });

function checkWorkerId(worker: Worker, workerId: string): void {
  if (workerId !== worker.id) {
    throw new DispatchCloudError(
      "workers.wrong_worker",
      `this token is worker ${worker.id}'s, not ${workerId}'s`,
      { path: "workerId" },
    );
  }
}

/** The first free `worker-<n>` among the owner's worker names, n counting on from how many there are. */
function defaultName(existing: readonly Worker[]): string {
  const names = new Set(existing.map((w) => w.name));
  let n = existing.length + 1;
  while (names.has(`worker-${n}`)) n++;
  return `worker-${n}`;
}

/** The URL this request came to (the worker puts its own --api-url in the document anyway). */
function requestUrl(request: FastifyRequest): string {
  return `${request.protocol}://${request.host}`;
}

/** Aborted when the client goes away before it got its answer. */
function abortOnHangUp(reply: FastifyReply): AbortController {
  const ac = new AbortController();
  reply.raw.once("close", () => ac.abort());
  return ac;
}

export function registerWorkerRoutes(
  app: FastifyInstance,
  ctx: RouteContext,
  opts: WorkerRouteOptions,
): void {
  const { db } = ctx;
  const userAuth = userAuthHook(db, ctx.nowMs, ctx.tokenCache);
  const workerAuth = async (request: FastifyRequest) => {
    request.worker = await authenticateWorker(db, request);
  };

  // ---- users' routes --------------------------------------------------------------------------------------

  app.post("/api/v1/workers", { onRequest: userAuth }, async (request, reply) => {
    const caller = callerOf(request);
    const body = validate(CreateWorkerRequest, request.body ?? {});
    const token = newWorkerToken();
    const make = async (name: string) =>
      createWorker(db, {
        id: newWorkerId(ctx.clusterId),
        ownerUuid: caller.uuid,
        name,
        tokenHash: hashToken(token),
      });
    let worker: Worker;
    if (body.name !== undefined) worker = await make(body.name);
    else {
      // A default name another request took meanwhile: the next free one (a few tries, then the conflict).
      for (let tries = 1; ; tries++) {
        try {
          worker = await make(defaultName(await listWorkers(db, caller.uuid)));
          break;
        } catch (err) {
          if (!(err instanceof DispatchCloudError && err.code === "workers.name_taken") || tries >= 5)
            throw err;
        }
      }
    }
    request.log.info({ workerId: worker.id, owner: caller.uuid }, "worker created");
    // The only time the token is ever shown; the database keeps its hash.
    return reply.code(201).send({ worker: workerView(worker), token });
  });

  app.get("/api/v1/workers", { onRequest: userAuth }, async (request) => {
    const caller = callerOf(request);
    const { all } = parseListQuery(request.query);
    if (all) requireAdmin(caller);
    const workers = await listWorkers(db, all ? null : caller.uuid);
    return { items: workers.map(workerView) };
  });

  for (const action of ["disable", "enable"] as const) {
    app.post(`/api/v1/workers/:id/${action}`, { onRequest: userAuth }, async (request) => {
      const id = workerIdParam(request);
      const caller = callerOf(request);
      const w = await setWorkerDisabled(db, id, action === "disable", caller.isAdmin ? null : caller.uuid);
      if (w === null) throw notFound(id);
      request.log.info({ workerId: id, by: caller.uuid }, `worker ${action}d`);
      return workerView(w);
    });
  }

  // ---- the worker's own routes ----------------------------------------------------------------------------

  /** Run messages for the bundles the dispatcher gave this worker that no check-in picked up yet. */
  const runMessages = async (request: FastifyRequest, worker: Worker): Promise<WorkerMessage[]> => {
    const workerId = worker.id;
    const out: WorkerMessage[] = [];
    for (const b of await undeliveredWorkerBundles(db, workerId, worker.ownerUuid)) {
      const token = newRunnerToken();
      const delivered = await deliverToWorker(db, b.uuid, b.attempt, workerId, hashToken(token));
      if (delivered === null) continue;
      // Never registryAuth: the operators' registry credentials do not go to users' machines (docs/workers.md).
      const startDocument: StartDocumentSent = {
        uuid: delivered.uuid,
        attempt: delivered.attempt,
        apiUrl: requestUrl(request),
        token,
        instanceType: "worker",
        gpuDevices: delivered.gpuDevices,
        runtimeEngine: opts.runtimeEngine,
        warmSupervisors: 0,
      };
      out.push({ type: "run", uuid: delivered.uuid, attempt: delivered.attempt, startDocument });
      request.log.info(
        { workerId, uuid: delivered.uuid, attempt: delivered.attempt },
        "bundle handed to worker",
      );
    }
    return out;
  };

  app.post("/api/v1/workers/checkin", { onRequest: workerAuth }, async (request, reply) => {
    const worker = workerOf(request);
    // Steps 1-4 store nothing: token, shape, plausibility, identity, the bundles it claims.
    const body = validate(CheckinRequest, request.body ?? {});
    checkPlausible(body);
    checkWorkerId(worker, body.workerId);
    const reported = new Map(
      (
        await reportedBundles(
          db,
          body.running.map((e) => e.uuid),
        )
      ).map((b) => [b.uuid, b]),
    );
    for (const [i, e] of body.running.entries()) {
      const b = reported.get(e.uuid);
      // The same answer whether the bundle is another user's or does not exist: nothing is learnt of it.
      if (b === undefined || b.ownerUuid !== worker.ownerUuid) {
        throw new DispatchCloudError("workers.not_assigned", `bundle ${e.uuid} is not one of your bundles`, {
          path: `running[${i}].uuid`,
        });
      }
    }

    const artifact = ctx.runnerArtifact;
    const outdated =
      artifact !== null && body.artifactSha256 !== "" && body.artifactSha256 !== artifact.sha256;
    const resources: WorkerResources = {
      vcpus: body.resources.vcpus,
      ram: body.resources.ram,
      freeDisk: body.resources.freeDisk,
      gpu:
        body.resources.gpu === null
          ? null
          : {
              stack: body.resources.gpu.stack,
              deviceCount: body.resources.gpu.deviceCount,
              vram: body.resources.gpu.vram,
              driverVersion: body.resources.gpu.driverVersion ?? null,
              hardwareTarget: body.resources.gpu.hardwareTarget ?? null,
            },
    };
    const recorded = await recordCheckin(db, worker.id, {
      state: body.draining || outdated ? "draining" : "active",
      tags: body.tags,
      resources,
      slots: body.slots,
      version: body.version,
      artifactSha256: body.artifactSha256 === "" ? null : body.artifactSha256,
      cache: body.cache,
      running: body.running,
    });
    if (recorded === null)
      throw new DispatchCloudError("workers.disabled", `worker ${worker.id} is disabled`);

    const messages: WorkerMessage[] = [];
    for (const e of body.running) {
      const b = reported.get(e.uuid)!;
      const current =
        (b.state === "starting" || b.state === "running") &&
        b.workerId === worker.id &&
        b.attempt === e.attempt;
      if (current) continue;
      const reason =
        b.state === "staged" || b.state === "starting" || b.state === "running"
          ? "given back to the queue"
          : `the bundle is ${b.state}`;
      messages.push({ type: "kill", uuid: e.uuid, attempt: e.attempt, reason });
    }
    // Registered before the deliveries are read, so a bundle given to it from now on wakes this check-in.
    const deadline = performance.now() + opts.longPollMs;
    let watch = await opts.waiters.watch(worker.id);
    try {
      messages.push(...(await runMessages(request, worker)));
      if (outdated) {
        messages.push({
          type: "drain",
          reason: `version ${body.version} (${body.artifactSha256.slice(0, 12)}) differs from the server's ${VERSION} (${artifact.sha256.slice(0, 12)})`,
        });
        if (body.running.length === 0 && (await workerBundles(db, worker.id)).length === 0) {
          messages.push({
            type: "upgrade",
            sha256: artifact.sha256,
            bytes: artifact.content.length,
            version: VERSION,
          });
        }
      }
      // The long poll. A NOTIFY that gives nothing to send (this or another check-in of the worker recorded a
      // change, which the dispatcher is told of on the same channel) does not end it.
      const hangUp = messages.length === 0 ? abortOnHangUp(reply) : null;
      while (messages.length === 0 && hangUp !== null) {
        const left = deadline - performance.now();
        if (left <= 0 || opts.waiters.closed || hangUp.signal.aborted) break;
        await watch.wait(left, hangUp.signal);
        watch.cancel();
        if (opts.waiters.closed || hangUp.signal.aborted || performance.now() >= deadline) break;
        watch = await opts.waiters.watch(worker.id);
        const now = await getWorker(db, worker.id);
        if (now === null || now.disabledAt !== null) {
          throw new DispatchCloudError("workers.disabled", `worker ${worker.id} is disabled`);
        }
        messages.push(...(await runMessages(request, worker)));
      }
    } finally {
      watch.cancel();
    }
    const answer: CheckinResponse = {
      workerId: worker.id,
      serverVersion: VERSION,
      artifactSha256: artifact?.sha256 ?? "",
      messages,
    };
    return answer;
  });

  app.post("/api/v1/workers/checkout", { onRequest: workerAuth }, async (request) => {
    const worker = workerOf(request);
    const body = validate(CheckoutRequest, request.body ?? {});
    checkWorkerId(worker, body.workerId);
    // Stopped first, so the dispatcher gives it nothing more while its bundles go back.
    await checkoutWorker(db, worker.id);
    const requeued: string[] = [];
    if (body.handBack === true) {
      const args = { actor: `worker ${worker.id}`, reason: "the worker handed it back" };
      for (const b of await workerBundles(db, worker.id)) {
        const result =
          b.state === "starting"
            ? await requeueStarting(db, b.uuid, b.attempt, args)
            : await loseBundle(db, b.uuid, b.attempt, args);
        if (result.ok && result.bundle.state === "staged") requeued.push(b.uuid);
      }
    }
    request.log.info(
      { workerId: worker.id, handBack: body.handBack === true, requeued },
      "worker checked out",
    );
    return { requeued };
  });

  app.get("/api/v1/workers/artifact", { onRequest: workerAuth }, async (_request, reply) => {
    const artifact = ctx.runnerArtifact;
    if (artifact === null) {
      throw new DispatchCloudError(
        "workers.no_artifact",
        "this server has no runner artifact to offer (it runs from sources)",
      );
    }
    return reply
      .header("content-type", "application/octet-stream")
      .header("x-artifact-sha256", artifact.sha256)
      .send(artifact.content);
  });
}
