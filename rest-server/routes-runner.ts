/**
 * The runner API, called by crunch-run with its per-bundle token. `start` moves the bundle
 * starting -> running only for the attempt the token was issued for; `heartbeat` records resource usage;
 * `logs` stores log chunks by byte offset (retries are harmless, gaps are refused); `outputs` replaces the
 * bundle's outputs with a tar archive; `dependencies/:index` serves a dependency's outputs as a tar archive;
 * `finish` records the exit; `preempted` reports a spot interruption notice, which requeues the running bundle
 * (running -> staged while attempts remain, else failed); `requeue` does the same for a failure that is the
 * instance's and not the bundle's (the container runtime could not start the container), with the runner's
 * reason. Raw bodies (log chunks, archives) are streamed, never parsed as JSON.
 */
import { type Static, Type } from "@sinclair/typebox";
import type { FastifyInstance, FastifyRequest } from "fastify";
import { formatDigest, parseDigest } from "../lib/cas/digest.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { groupCalls } from "../lib/group-calls.ts";
import { MAX_HAND_OFFS } from "../lib/runner-protocol.ts";
import { outputManifestsByBundle, setOutputManifest } from "../store/cas-queries.ts";
import {
  appendLogChunk,
  appendLogChunkByToken,
  getBundle,
  recordHeartbeat,
  recordHeartbeatByToken,
} from "../store/queries.ts";
import {
  finishBundle,
  loseBundle,
  markRunningByTokens,
  requeueForUnavailableImage,
} from "../store/transitions.ts";
import type { Bundle, LogStream, TransitionResult } from "../store/types.ts";
import {
  authenticateRunner,
  runnerBundleByTokenHash,
  runnerBundleOf,
  runnerTokenHash,
  runnerTokenHashOf,
} from "./auth.ts";
import { readManifestStats } from "./cas/routes.ts";
import type { RouteContext } from "./context.ts";
import { parseCount, parseStream } from "./logs.ts";
import { parseOutputPath } from "./outputs.ts";
import { validate } from "./validate.ts";

const StartRequest = Type.Object({}, { additionalProperties: false });

const StartsRequest = Type.Object(
  {
    tokens: Type.Array(
      Type.String({
        minLength: 1,
        maxLength: 200,
        description: "A runner token, as `start` takes it in the Authorization header.",
        errorMessage: "must be a runner token",
      }),
      {
        minItems: 1,
        maxItems: MAX_HAND_OFFS,
        description: "The runners' tokens, one per bundle (at most one instance's hand-offs of one pass).",
        errorMessage: `must be a list of 1 to ${MAX_HAND_OFFS} runner tokens`,
      },
    ),
  },
  { additionalProperties: false },
);
/** A `starts` body of MAX_HAND_OFFS tokens is about 6 KiB. */
const STARTS_BODY_LIMIT = 64 * 1024;

const ResourceUsage = Type.Record(
  Type.String({ maxLength: 100 }),
  Type.Number({ minimum: 0, maximum: 1e18 }),
  { maxProperties: 100 },
);

const HeartbeatRequest = Type.Object(
  {
    resourceUsage: ResourceUsage,
    status: Type.Optional(
      Type.Union(
        [
          Type.String({
            maxLength: 300,
            pattern: "^[^\\u0000-\\u001f\\u007f]*$",
            errorMessage: "must be a string of at most 300 characters without control characters, or null",
          }),
          Type.Null(),
        ],
        {
          description:
            "What the runner waits for before the container runs (e.g. `pulling IMAGE: 3.1 of 8.4 MB`), shown as the bundle's schedulingStatus; null clears it.",
        },
      ),
    ),
  },
  { additionalProperties: false },
);

const FinishRequest = Type.Object(
  {
    exitCode: Type.Union([Type.Integer({ minimum: 0, maximum: 255 }), Type.Null()], {
      errorMessage: "must be an integer 0..255, or null when the command did not run to an exit status",
    }),
    reason: Type.Optional(Type.String({ maxLength: 1000 })),
    failed: Type.Optional(Type.Boolean()),
    resourceUsage: Type.Optional(ResourceUsage),
    outputManifest: Type.Optional(
      Type.String({
        maxLength: 100,
        description:
          "The digest (<sha256>/<size>) of the outputs' manifest, stored in the content-addressed store and readable by the bundle's owner.",
      }),
    ),
  },
  { additionalProperties: false },
);

/** Printable text without control characters (it ends up in the bundle's state reason). */
const NoticeText = (description: string) =>
  Type.Optional(
    Type.String({
      maxLength: 100,
      pattern: "^[^\\u0000-\\u001f\\u007f]*$",
      description,
      errorMessage: "must be a string of at most 100 characters without control characters",
    }),
  );

/** What the instance metadata service said: the spot instance-action notice's fields. */
const PreemptedRequest = Type.Object(
  {
    action: NoticeText("What the cloud will do to the instance: terminate, stop or hibernate."),
    time: NoticeText("When it will, as the notice says (ISO 8601)."),
  },
  { additionalProperties: false },
);

/** Why the runner gives the bundle back: printable text (it becomes the bundle's state reason). */
const RequeueRequest = Type.Object(
  {
    reason: Type.String({
      minLength: 1,
      maxLength: 1000,
      pattern: "^[^\\u0000-\\u001f\\u007f]*$",
      description: "What failed on the instance, for the bundle's state reason.",
      errorMessage: "must be a string of 1 to 1000 characters without control characters",
    }),
    code: Type.Optional(
      Type.Literal("crunchrun.image_unavailable", {
        description:
          "The image's registry was unavailable: the requeue does not use up an attempt (up to containers.unavailableImageRequeues times).",
        errorMessage: "must be crunchrun.image_unavailable when given",
      }),
    ),
  },
  { additionalProperties: false },
);

/** The state reason of a bundle its runner requeued. */
export function runnerRequeueReason(instanceId: string | null, reason: string): string {
  return `requeued by its runner on instance ${instanceId ?? "(unknown)"}: ${reason}`;
}

/** The state reason of a bundle requeued by a spot interruption notice. */
export function preemptedReason(notice: { action?: string; time?: string }): string {
  return `preempted: spot interruption notice (${notice.action ?? "unknown action"} at ${notice.time ?? "an unknown time"})`;
}

/** Largest log chunk a runner may send in one call. */
export const MAX_LOG_CHUNK = 2 ** 20;

/** Bytes a log chunk may declare to be stored without a token lookup before its body (RouteContext.smallLogChunk). */
const SMALL_LOG_CHUNK_MAX = 64 * 1024;

/**
 * The largest upload that arrives within requestTimeout at minUploadRate (so needs no runner's allowance to be
 * slow), at most 64 KiB: what a client may make the server read before its token is checked. With no
 * minUploadRate no upload has that allowance.
 */
export function smallUploadBytes(t: { requestTimeout: number; minUploadRate: number }): number {
  if (t.minUploadRate <= 0) return SMALL_LOG_CHUNK_MAX;
  return Math.min(SMALL_LOG_CHUNK_MAX, Math.floor((t.minUploadRate * t.requestTimeout) / 1000));
}

const ACTOR = "runner";

/** Runners' `start` calls per grouped statement. */
const MAX_START_GROUP = 200;

function notCurrent(bundle: Bundle, result: TransitionResult & { ok: false }): DispatchCloudError {
  return notCurrentNow(bundle, result.current);
}

export function registerRunnerRoutes(app: FastifyInstance, ctx: RouteContext): void {
  const { db } = ctx;
  const onRequest = async (request: FastifyRequest) => {
    request.runnerBundle = await authenticateRunner(db, request);
  };

  // Two groups in flight: the `starts` of two instances' pools a few ms apart (a burst over two instances) do
  // not wait for each other's statement.
  const starts = groupCalls<string, Bundle | null>({
    max: MAX_START_GROUP,
    concurrency: 2,
    run: async (hashes) => {
      const moved = await markRunningByTokens(db, hashes, ACTOR);
      if (moved.size > 0) ctx.bundlesWritten?.([...moved.values()]);
      // A token given twice in one group moved its bundle once: the second is answered as a retried start is.
      const answered = new Set<string>();
      return hashes.map((h) => {
        const b = moved.get(h);
        if (b === undefined || answered.has(h)) return null;
        answered.add(h);
        return b;
      });
    },
  });

  /**
   * starting -> running for the runner whose token hashes to `tokenHash`. The usual case in one statement: the
   * token's bundle is starting (the bundle waits for this answer); the calls that arrive together (a burst of
   * bundles starting) share that statement. Otherwise a bad or stale token gets the error every runner route
   * gives, and a retried start (the first answer was lost) finds its own attempt (a token is one attempt's)
   * running: success.
   */
  const startRunner = async (
    tokenHash: string,
    log: FastifyRequest["log"],
  ): Promise<{ uuid: string; state: string; attempt: number }> => {
    // Its claim may still be in flight (the dispatcher hands a warm pool the document while it claims).
    await ctx.claimsInFlight?.settled(tokenHash);
    const b = await starts.call(tokenHash);
    if (b !== null) {
      log.info({ bundleUuid: b.uuid, attempt: b.attempt, instanceId: b.instanceId }, "bundle running");
      return { uuid: b.uuid, state: b.state, attempt: b.attempt };
    }
    const bundle = await runnerBundleByTokenHash(db, tokenHash);
    if (bundle.state === "running")
      return { uuid: bundle.uuid, state: bundle.state, attempt: bundle.attempt };
    throw notCurrentNow(bundle, bundle);
  };

  app.post("/api/v1/runner/start", async (request) => {
    const tokenHash = runnerTokenHashOf(request);
    if (request.body !== undefined) {
      try {
        validate(StartRequest, request.body);
      } catch (err) {
        await authenticateRunner(db, request); // a bad token is told so before a bad body, as on every route
        throw err;
      }
    }
    return startRunner(tokenHash, request.log);
  });

  // The `start` calls of several runners at once, each with its own token in the body (no Authorization):
  // made by an instance's warm pool for the bundles the dispatcher handed it together (docs/api.md). Each token
  // gets the answer `start` would give it, in the same order: the bundle, or the error with its HTTP status.
  app.post("/api/v1/runner/starts", { bodyLimit: STARTS_BODY_LIMIT }, async (request) => {
    const body = validate(StartsRequest, request.body);
    const items = await Promise.all(
      body.tokens.map(async (token) => {
        try {
          return await startRunner(runnerTokenHash(token), request.log);
        } catch (err) {
          if (!(err instanceof DispatchCloudError)) throw err;
          return { status: err.status, error: { code: err.code, message: err.message } };
        }
      }),
    );
    return { items };
  });

  app.get("/api/v1/runner/spec", { onRequest }, async (request) => {
    const b = runnerBundleOf(request);
    const manifests = await outputManifestsByBundle(
      db,
      b.dependencies.map((d) => d.bundle),
    );
    return {
      uuid: b.uuid,
      attempt: b.attempt,
      command: b.command,
      image: b.image,
      // Pinned at submit time (docs/images.md): every attempt runs the same image; imageStore when it is ours.
      imagePinned: b.imagePinned ?? null,
      imageStore: b.imageStore ?? null,
      env: b.env,
      resources: b.resources,
      limits: b.limits,
      dependencies: b.dependencies.map((d) => ({ ...d, manifest: manifests.get(d.bundle) ?? null })),
      gpuDevices: b.gpuDevices,
      instanceType: b.instanceType,
      // Outputs go to the content-addressed store, within these limits (checked again at finish).
      ...(ctx.casBackend === null
        ? {}
        : { outputLimits: { files: ctx.maxOutputFiles, bytes: ctx.maxOutputSize } }),
    };
  });

  // The most frequent runner call (each runner's every heartbeatIntervalMs): one statement by the token's hash
  // when the token is current, without looking it up first; otherwise the error every runner route gives.
  app.post("/api/v1/runner/heartbeat", async (request) => {
    const tokenHash = runnerTokenHashOf(request);
    let body: Static<typeof HeartbeatRequest>;
    try {
      body = validate(HeartbeatRequest, request.body);
    } catch (err) {
      await runnerBundleByTokenHash(db, tokenHash); // a bad token is told so before a bad body
      throw err;
    }
    const state = await recordHeartbeatByToken(db, tokenHash, body.resourceUsage, body.status);
    if (state !== null) return { state };
    const bundle = await runnerBundleByTokenHash(db, tokenHash);
    // Current again by now (it was not a moment ago): recorded by the bundle's attempt, as before.
    const again = await recordHeartbeat(db, bundle.uuid, bundle.attempt, body.resourceUsage, body.status);
    if (again === null) throw notCurrentNow(bundle, await getBundle(db, bundle.uuid));
    return { state: again };
  });

  app.post("/api/v1/runner/finish", { onRequest }, async (request) => {
    const bundle = runnerBundleOf(request);
    const body = validate(FinishRequest, request.body);
    if (body.outputManifest !== undefined) {
      const d = parseDigest(body.outputManifest, "outputManifest");
      const backend = ctx.casBackend;
      const stats =
        backend === null
          ? null
          : await readManifestStats(db, backend, { userUuid: bundle.ownerUuid, manifests: [] }, d);
      if (stats === null) {
        throw new DispatchCloudError(
          "cas.unknown_manifest",
          `outputManifest: ${formatDigest(d)} is not a manifest in the store readable by the bundle's owner; upload it first`,
          { path: "outputManifest" },
        );
      }
      if (stats.files > ctx.maxOutputFiles) {
        throw new DispatchCloudError(
          "runner.output_too_many_files",
          `the outputs hold ${stats.files} files, more than the ${ctx.maxOutputFiles} allowed`,
          { path: "outputManifest" },
        );
      }
      if (stats.bytes > ctx.maxOutputSize) throw tooLarge(ctx.maxOutputSize);
      if (!(await setOutputManifest(db, bundle.uuid, bundle.attempt, formatDigest(d), stats.bytes))) {
        throw notCurrentNow(bundle, await getBundle(db, bundle.uuid));
      }
    }
    const result = await finishBundle(db, bundle.uuid, bundle.attempt, {
      exitCode: body.exitCode,
      ...(body.failed === undefined ? {} : { failed: body.failed }),
      ...(body.reason === undefined ? {} : { reason: body.reason }),
      ...(body.resourceUsage === undefined ? {} : { resourceUsage: body.resourceUsage }),
      actor: ACTOR,
    });
    if (!result.ok) throw notCurrent(bundle, result);
    ctx.bundlesWritten?.([result.bundle]);
    // What staging by manifest cost (crunch-run's figures in the usage), for the store's metrics: counted once,
    // by the finish that moved the bundle (a retried finish is refused above and counts nothing).
    const u = body.resourceUsage;
    if (ctx.casMetrics !== null && u !== undefined && u["stagingSeconds"] !== undefined) {
      ctx.casMetrics.vmCacheHits.inc(u["casBlobsHit"] ?? 0);
      ctx.casMetrics.vmCacheMisses.inc(u["casBlobsFetched"] ?? 0);
      ctx.casMetrics.vmBytesFetched.inc(u["casBytesFetched"] ?? 0);
      ctx.casMetrics.stagingSeconds.observe(u["stagingSeconds"]);
    }
    request.log.info(
      {
        bundleUuid: bundle.uuid,
        attempt: bundle.attempt,
        state: result.bundle.state,
        exitCode: result.bundle.exitCode,
        reason: result.bundle.stateReason,
      },
      `bundle ${result.bundle.state}`,
    );
    return { uuid: result.bundle.uuid, state: result.bundle.state, exitCode: result.bundle.exitCode };
  });

  // A starting bundle (the runner has not called start) is 409 too: only a running attempt is requeued here.
  app.post("/api/v1/runner/preempted", { onRequest }, async (request) => {
    const bundle = runnerBundleOf(request);
    const body = validate(PreemptedRequest, request.body ?? {});
    const result = await loseBundle(db, bundle.uuid, bundle.attempt, {
      actor: ACTOR,
      reason: preemptedReason(body),
    });
    if (!result.ok) throw notCurrent(bundle, result);
    ctx.bundlesWritten?.([result.bundle]);
    request.log.info(
      { bundleUuid: bundle.uuid, attempt: bundle.attempt, state: result.bundle.state },
      "runner reported a spot interruption notice",
    );
    return { uuid: result.bundle.uuid, state: result.bundle.state, attempt: result.bundle.attempt };
  });

  // The same transition as `preempted` (store/transitions.ts loseBundle): attempts rules unchanged.
  app.post("/api/v1/runner/requeue", { onRequest }, async (request) => {
    const bundle = runnerBundleOf(request);
    const body = validate(RequeueRequest, request.body);
    const reason = runnerRequeueReason(bundle.instanceId, body.reason);
    const result =
      body.code === "crunchrun.image_unavailable"
        ? await requeueForUnavailableImage(db, bundle.uuid, bundle.attempt, {
            actor: ACTOR,
            reason,
            uncounted: ctx.unavailableImageRequeues,
          })
        : await loseBundle(db, bundle.uuid, bundle.attempt, { actor: ACTOR, reason });
    if (!result.ok) throw notCurrent(bundle, result);
    ctx.bundlesWritten?.([result.bundle]);
    request.log.info(
      { bundleUuid: bundle.uuid, attempt: bundle.attempt, state: result.bundle.state },
      "runner requeued its bundle",
    );
    return { uuid: result.bundle.uuid, state: result.bundle.state, attempt: result.bundle.attempt };
  });

  app.get("/api/v1/runner/dependencies/:index", { onRequest }, async (request, reply) => {
    const bundle = runnerBundleOf(request);
    const raw = (request.params as Record<string, string | undefined>)["index"] ?? "";
    const unavailable = (why: string) =>
      new DispatchCloudError("runner.dependency_unavailable", `dependency ${raw}: ${why}`, { path: "index" });
    if (!/^(0|[1-9][0-9]{0,5})$/.test(raw)) {
      throw new DispatchCloudError("request.invalid_param", "index: must be a whole number", {
        path: "index",
      });
    }
    const dep = bundle.dependencies[Number(raw)];
    if (dep === undefined) throw unavailable(`the bundle has ${bundle.dependencies.length} dependencies`);
    const source = await getBundle(db, dep.bundle);
    if (source === null || source.state !== "ready") {
      throw unavailable(`bundle ${dep.bundle} is ${source?.state ?? "gone"}, not ready`);
    }
    const subpath = parseOutputPath(dep.subpath, "subpath");
    const tar =
      source.outputManifest === undefined
        ? await ctx.outputs.pack(dep.bundle, subpath)
        : (await ctx.storedOutputs.of(source.uuid, source.outputManifest)).pack(subpath);
    if (tar === null) throw unavailable(`bundle ${dep.bundle} has no output ${JSON.stringify(dep.subpath)}`);
    return reply.type("application/x-tar").send(tar);
  });

  // Raw bodies: in a scope of their own, so only these routes accept them (and get them as streams).
  app.register(async (scope) => {
    scope.addContentTypeParser(["application/octet-stream", "application/x-tar"], (_req, payload, done) => {
      done(null, payload);
    });
    // An answer sent before the body was read (an error): close the connection rather than read the rest.
    scope.addHook("onSend", async (request, reply) => {
      if (!request.raw.readableEnded) reply.header("connection", "close");
    });

    // A chunk small enough to arrive within requestTimeout at minUploadRate is stored in one statement that finds
    // the token's bundle (append_log_chunk_by_token). A larger one (or one of unknown length) has its token looked
    // up before its body is read, the only way a runner's upload may be slow (server.ts), then is stored in one
    // statement (append_log_chunk). A bad or stale token gets the error every runner route gives either way.
    const logsOnRequest = async (request: FastifyRequest) => {
      const declared = Number(request.headers["content-length"]);
      if (Number.isSafeInteger(declared) && declared >= 0 && declared <= ctx.smallLogChunk) {
        runnerTokenHashOf(request); // a malformed token is refused before anything is read
        return;
      }
      request.runnerBundle = await authenticateRunner(db, request);
    };
    scope.post("/api/v1/runner/logs", { onRequest: logsOnRequest }, async (request) => {
      let stream: LogStream;
      let offset: number;
      try {
        ({ stream, offset } = parseLogChunkQuery(request.query));
        requireContentType(request, "application/octet-stream");
      } catch (err) {
        if (request.runnerBundle === null) await authenticateRunner(db, request); // the token's error first
        throw err;
      }
      const data = await readBody(request, MAX_LOG_CHUNK);
      const chunk = { stream, offset, data, maxBytes: ctx.maxLogBytesPerStream };
      let stored =
        request.runnerBundle === null
          ? await appendLogChunkByToken(db, { tokenHash: runnerTokenHashOf(request), ...chunk })
          : null;
      if (stored === null) {
        // Looked up before the body, or not a current token: the lookup says why, as on every runner route.
        const b = request.runnerBundle ?? (await runnerBundleByTokenHash(db, runnerTokenHashOf(request)));
        stored = {
          bundle: b,
          result: await appendLogChunk(db, { uuid: b.uuid, attempt: b.attempt, ...chunk }),
        };
      }
      const { bundle, result } = stored;
      if (result.ok)
        return result.truncated ? { stored: result.stored, truncated: true } : { stored: result.stored };
      if (result.reason === "gap") {
        throw new DispatchCloudError(
          "runner.log_gap",
          `${stream} has ${result.stored} bytes; a chunk at offset ${offset} leaves a gap (expectedOffset ${result.stored})`,
          { path: "offset" },
        );
      }
      throw notCurrentNow(bundle, result.current);
    });

    scope.put("/api/v1/runner/outputs", { onRequest }, async (request) => {
      const bundle = runnerBundleOf(request);
      requireContentType(request, "application/x-tar");
      const max = ctx.maxOutputSize;
      const declared = Number(request.headers["content-length"] ?? "0");
      // Headers and padding add to the files' bytes; allow a quarter more (and 1 MiB) of archive overhead.
      const rawLimit = max + Math.floor(max / 4) + 2 ** 20;
      if (declared > rawLimit) throw tooLarge(max);
      const summary = await ctx.outputs.replace(bundle.uuid, limitedBody(request, rawLimit, max), {
        maxBytes: max,
        maxEntries: ctx.maxOutputFiles,
        beforeCommit: async () => {
          const now = await getBundle(db, bundle.uuid);
          if (now?.attempt !== bundle.attempt || (now.state !== "starting" && now.state !== "running")) {
            throw notCurrentNow(bundle, now);
          }
        },
      });
      return summary;
    });
  });
}

const tooLarge = (max: number) =>
  new DispatchCloudError("runner.output_too_large", `the outputs are larger than the ${max} bytes allowed`);

function notCurrentNow(
  bundle: Pick<Bundle, "uuid" | "attempt">,
  now: Pick<Bundle, "state" | "attempt"> | null,
): DispatchCloudError {
  const what = now === null ? "is gone" : `is ${now.state} at attempt ${now.attempt}`;
  return new DispatchCloudError(
    "runner.not_current",
    `attempt ${bundle.attempt} no longer owns bundle ${bundle.uuid}: it ${what}`,
  );
}

/** `?stream=stdout|stderr&offset=N`, both required. */
export function parseLogChunkQuery(query: unknown): { stream: LogStream; offset: number } {
  const q = (query ?? {}) as Record<string, unknown>;
  for (const key of Object.keys(q)) {
    if (key !== "stream" && key !== "offset") {
      throw new DispatchCloudError(
        "request.invalid_query",
        `${key}: unknown query parameter; known: stream, offset`,
        {
          path: key,
        },
      );
    }
  }
  if (q["stream"] === undefined || q["offset"] === undefined) {
    const key = q["stream"] === undefined ? "stream" : "offset";
    throw new DispatchCloudError("request.invalid_query", `${key}: required`, { path: key });
  }
  return { stream: parseStream(q["stream"]), offset: parseCount("offset", q["offset"]) };
}

function requireContentType(request: FastifyRequest, type: string): void {
  const got = (request.headers["content-type"] ?? "").split(";")[0]!.trim().toLowerCase();
  if (got !== type) {
    throw new DispatchCloudError(
      "request.unsupported_media_type",
      `this request's body must be sent with Content-Type: ${type}`,
    );
  }
}

/** The body as an async iterable of Buffers ("" when there is none). */
function bodyChunks(request: FastifyRequest): AsyncIterable<unknown> {
  const body = request.body as AsyncIterable<unknown> | undefined | null;
  if (body !== undefined && body !== null && Symbol.asyncIterator in Object(body)) return body;
  return (async function* () {})();
}

/** Reads a whole (small) body, refusing more than max bytes. */
async function readBody(request: FastifyRequest, max: number): Promise<Buffer> {
  const declared = Number(request.headers["content-length"] ?? "0");
  const over = () =>
    new DispatchCloudError("request.body_too_large", `a log chunk may hold at most ${max} bytes`);
  if (declared > max) throw over();
  const parts: Buffer[] = [];
  let length = 0;
  try {
    for await (const c of bodyChunks(request)) {
      const buf = typeof c === "string" ? Buffer.from(c) : (c as Buffer);
      length += buf.length;
      if (length > max) throw over();
      parts.push(buf);
    }
  } catch (err) {
    if (err instanceof DispatchCloudError) throw err;
    throw interrupted(err);
  }
  return Buffer.concat(parts, length);
}

const interrupted = (err: unknown) =>
  new DispatchCloudError("request.invalid_body", "the request body was interrupted", { cause: err });

/** The body, refusing (runner.output_too_large) past rawLimit bytes; a broken upload is request.invalid_body. */
async function* limitedBody(request: FastifyRequest, rawLimit: number, max: number): AsyncGenerator<Buffer> {
  let length = 0;
  const it = bodyChunks(request)[Symbol.asyncIterator]();
  for (;;) {
    let next: IteratorResult<unknown>;
    try {
      next = await it.next();
    } catch (err) {
      throw interrupted(err);
    }
    if (next.done === true) return;
    const buf = typeof next.value === "string" ? Buffer.from(next.value) : (next.value as Buffer);
    length += buf.length;
    if (length > rawLimit) throw tooLarge(max);
    yield buf;
  }
}
