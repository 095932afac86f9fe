/**
 * The REST server: the users' API, the runner API and the health check, on fastify. Every failure, fastify's
 * and Node's own included (lib/http-errors.ts), is `{ error: { code, message, path? } }`, and a caller's
 * mistake is always a 4xx. Bodies are JSON in valid UTF-8 (the runner's raw uploads aside); what clients send
 * is timed (lib/http-timeouts.ts), what the server answers is not.
 */

import { isUtf8 } from "node:buffer";
import { join } from "node:path";
import Fastify, { type FastifyBaseLogger, type FastifyInstance } from "fastify";
import { pino } from "pino";
import type { Registry } from "prom-client";
import { defaultConfig } from "../config/load.ts";
import { createAuthRefusals } from "../lib/auth-refusals.ts";
import type { ClaimsInFlight } from "../lib/claims-in-flight.ts";
import type { Clock } from "../lib/clock.ts";
import { systemClock } from "../lib/clock.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import {
  clientErrorHandler,
  errorHandler,
  frameworkErrorsHandler,
  refuseWhileClosing,
  sendError,
} from "../lib/http-errors.ts";
import { logRequestsAtDebug, quietRequests } from "../lib/http-log.ts";
import { recordRoutes } from "../lib/http-routes.ts";
import {
  allowSlowUpload,
  closeAfterEarlyAnswer,
  enforceBodyTimeout,
  httpServerOptions,
} from "../lib/http-timeouts.ts";
import { type Logger, REDACTED_PATHS } from "../lib/logger.ts";
import type { RuntimeEngine } from "../lib/runner-protocol.ts";
import type { Db } from "../store/db.ts";
import type { Bundle } from "../store/types.ts";
import { TokenCache } from "./auth.ts";
import type { BundleMinimums } from "./bundle-request.ts";
import type { BlobBackend } from "./cas/backend.ts";
import { createFsBackend } from "./cas/backend-fs.ts";
import { type CasGc, createCasGc } from "./cas/gc.ts";
import { createCasMetrics } from "./cas/metrics.ts";
import { cacheTtlFor, ReadableCache } from "./cas/readable-cache.ts";
import { registerCasRoutes } from "./cas/routes.ts";
import { createStoredOutputs } from "./cas/stored-outputs.ts";
import type { RouteContext, WorkerArtifact } from "./context.ts";
import { type ImageResolver, storeImageResolver } from "./image-resolve.ts";
import { registerImageRoutes } from "./images-routes.ts";
import { createLogNotifier } from "./logs.ts";
import { usersApiDocument } from "./openapi.ts";
import { createOutputStore } from "./outputs.ts";
import { registerPipelineRoutes } from "./pipelines/routes.ts";
import { NO_SUBMIT_LIMITS, type SubmitLimits } from "./quotas.ts";
import { registerRunnerRoutes, smallUploadBytes } from "./routes-runner.ts";
import { registerTokenRoutes } from "./routes-tokens.ts";
import { registerUserRoutes } from "./routes-users.ts";
import { createSubmitCoalescer } from "./submit-coalescer.ts";
import { registerWorkerRoutes } from "./workers/routes.ts";
import { createWorkerWaiters, type WorkerWaiters } from "./workers/waiters.ts";

export interface RestServerOptions {
  db: Db;
  /** A pino logger (the server logs through a child of it), or false for no logging. */
  logger: Logger | false;
  clusterId: string;
  /** Largest accepted request body, in bytes. */
  maxRequestBodySize: number;
  /** Largest body of a batch submission, in bytes; default restServer.maxBatchRequestBodySize's. */
  maxBatchRequestBodySize?: number;
  /** maxAttempts of a bundle whose request does not say. */
  defaultMaxAttempts: number;
  /** Source of "now" for derived timings; defaults to the system clock. */
  clock?: Pick<Clock, "now">;
  /** Where outputs are kept: `<dataDir>/outputs/<bundle uuid>/` (created when the first upload arrives). */
  dataDir: string;
  /** Largest output upload of one bundle, in bytes (the sum of its files); default 10 GiB. */
  maxOutputSize?: number;
  /** Most entries (files, directories, links) of one bundle's outputs; default restServer.maxOutputFiles's. */
  maxOutputFiles?: number;
  /** Bytes kept of one log stream per attempt, then a truncation notice; default maxLogBytesPerStream's. */
  maxLogBytesPerStream?: number;
  /** How often a log follower re-reads when no notification woke it, in ms; default 5000. */
  logPollInterval?: number;
  /** Milliseconds for a request's line and headers (restServer.headersTimeout; default its default). */
  headersTimeout?: number;
  /** Milliseconds for a request's body after its headers (restServer.requestTimeout). */
  requestTimeout?: number;
  /** restServer.trustedProxies: requests through them are from the address X-Forwarded-For gives (request.ip). */
  trustedProxies?: readonly string[];
  /** Bytes per second at which a runner's upload may outlast requestTimeout (restServer.minUploadRate). */
  minUploadRate?: number;
  /** The smallest RAM and vCPUs a bundle may ask for (restServer.minBundleRam, minBundleVcpus). */
  bundleMinimums?: BundleMinimums;
  /** Per-user limits (config `quotas`); default: no submission limits, 100 tokens per user. */
  quotas?: SubmitLimits & { maxTokensPerUser: number };
  /** The content-addressed store (config `cas`); defaults: the filesystem under `<dataDir>/cas`, cas's defaults. */
  cas?: CasServerOptions;
  /**
   * Image resolvers tried after the store's own (images pushed with `dispatch-cloud images push`) when a bundle is
   * submitted: a registry resolver pins tags to digests (docs/images.md "Pinning"). Default none.
   */
  imageResolvers?: ImageResolver[];
  /**
   * Told of the bundle rows this server wrote, once committed (whole rows): new bundles, and the transitions of
   * the runners' `start`, `finish`, `preempted` and `requeue` calls. `serve` hands them to its own dispatcher's
   * queue, which then need not wait for the NOTIFY and its read. Default: nobody.
   */
  onBundlesWritten?: (bundles: readonly Bundle[]) => void;
  /**
   * The claims of the dispatcher in the same process (`serve`), which a runner's `start` waits for before it
   * looks its token up (RouteContext.claimsInFlight). Default: none.
   */
  claimsInFlight?: ClaimsInFlight;
  /** containers.unavailableImageRequeues (default its default). */
  unavailableImageRequeues?: number;
  /** Users' own workers (docs/workers.md). */
  workers?: WorkerServerOptions;
  /** Registry for the REST server's own metrics (requests refused for their token); none: no such metrics. */
  metricsRegistry?: Registry;
  /** Milliseconds between the warnings that sum requests refused for their token (lib/auth-refusals.ts); 1 minute. */
  authRefusalLogInterval?: number;
}

export interface WorkerServerOptions {
  /** workers.longPoll, in ms (default its default). */
  longPoll?: number;
  /** dispatcher.runtimeEngine, named in the start documents handed to workers (default its default). */
  runtimeEngine?: RuntimeEngine;
  /**
   * The runner artifact workers upgrade to: the file the dispatcher deploys (cli/runner-artifact.ts). None: workers
   * are never told to drain or upgrade, and GET /api/v1/workers/artifact answers workers.no_artifact.
   */
  artifact?: WorkerArtifact | null;
}

export interface CasServerOptions {
  /** Where blobs are kept; default createFsBackend(`<dataDir>/cas`). Closed with the server. */
  backend?: BlobBackend;
  /** How long an unreferenced blob lives after it was last touched (cas.retention), in ms. */
  retention?: number;
  /** Milliseconds between collections (cas.gcInterval); 0 = none (gcOnce only). Default 0. */
  gcInterval?: number;
  /** cas.maxBatchBytes. */
  maxBatchBytes?: number;
  /** Registry for the store's metrics; none: no metrics. */
  metricsRegistry?: Registry;
  /** Sleeps of the periodic collection (FakeClock in tests); default the system clock's. */
  sleep?: (ms: number, signal?: AbortSignal) => Promise<void>;
}

export type { RouteContext } from "./context.ts";

export const DEFAULT_MAX_OUTPUT_SIZE = 10 * 2 ** 30;
export const DEFAULT_MAX_TOKENS_PER_USER = 100;

declare module "fastify" {
  interface FastifyInstance {
    /** The content-addressed store's garbage collection (gcOnce for tests and operators). */
    casGc: CasGc;
    /** Workers' check-ins waiting in their long poll (rest-server/workers/waiters.ts). */
    workerWaiters: WorkerWaiters;
  }
}

export async function createRestServer(opts: RestServerOptions): Promise<FastifyInstance> {
  const clock = opts.clock;
  const defaults = defaultConfig().restServer;
  const logger =
    opts.logger === false
      ? pino({ enabled: false })
      : opts.logger.child(
          { component: "rest-server" },
          { redact: { paths: REDACTED_PATHS, censor: "[redacted]" } },
        );
  const timeouts = {
    headersTimeout: opts.headersTimeout ?? defaults.headersTimeout,
    requestTimeout: opts.requestTimeout ?? defaults.requestTimeout,
    minUploadRate: opts.minUploadRate ?? defaults.minUploadRate,
  };
  const { onBundlesWritten } = opts;
  const ctx: RouteContext = {
    db: opts.db,
    clusterId: opts.clusterId,
    defaultMaxAttempts: opts.defaultMaxAttempts,
    nowMs: clock === undefined ? () => Date.now() : () => clock.now(),
    outputs: createOutputStore(join(opts.dataDir, "outputs")),
    maxOutputSize: opts.maxOutputSize ?? DEFAULT_MAX_OUTPUT_SIZE,
    maxOutputFiles: opts.maxOutputFiles ?? defaults.maxOutputFiles,
    maxLogBytesPerStream: opts.maxLogBytesPerStream ?? defaults.maxLogBytesPerStream,
    smallLogChunk: smallUploadBytes(timeouts),
    logNotifier: createLogNotifier(opts.db, logger),
    logPollInterval: opts.logPollInterval ?? 5000,
    bundleMinimums: opts.bundleMinimums ?? {
      ram: defaults.minBundleRam,
      vcpus: defaults.minBundleVcpus,
    },
    submitLimits: opts.quotas ?? NO_SUBMIT_LIMITS,
    submitCoalescer: createSubmitCoalescer(opts.db),
    bundlesWritten:
      onBundlesWritten === undefined
        ? null
        : (bundles) => {
            // The write is committed whatever the listener does: its failure is logged, never answered.
            try {
              onBundlesWritten(bundles);
            } catch (err) {
              logger.error({ err, count: bundles.length }, "telling of written bundles failed");
            }
          },
    claimsInFlight: opts.claimsInFlight ?? null,
    tokenCache: new TokenCache(),
    maxBatchBodySize: opts.maxBatchRequestBodySize ?? defaults.maxBatchRequestBodySize,
    maxTokensPerUser: opts.quotas?.maxTokensPerUser ?? DEFAULT_MAX_TOKENS_PER_USER,
    casBackend: null,
    storedOutputs: createStoredOutputs(() => ctx.casBackend),
    casMetrics: null,
    casReadable: new ReadableCache({
      ttlMs: cacheTtlFor(opts.cas?.retention ?? defaultConfig().cas.retention),
      nowMs: clock === undefined ? () => Date.now() : () => clock.now(),
    }),
    // The insert statements themselves pin an image of the owner's in the store (no extra query per submission);
    // with other resolvers, the store is asked first here too, so a registry is never asked about a store image.
    imageResolvers:
      (opts.imageResolvers ?? []).length === 0
        ? []
        : [storeImageResolver(opts.db), ...(opts.imageResolvers ?? [])],
    unavailableImageRequeues:
      opts.unavailableImageRequeues ?? defaultConfig().containers.unavailableImageRequeues,
    runnerArtifact: opts.workers?.artifact ?? null,
  };
  const app = Fastify({
    loggerInstance: logger as FastifyBaseLogger,
    bodyLimit: opts.maxRequestBodySize,
    // No schema compiled by fastify may strip unknown fields or coerce types; bodies are validated in
    // the routes (validate.ts), query strings parsed by hand.
    ajv: {
      customOptions: { removeAdditional: false, coerceTypes: false, useDefaults: false, allErrors: false },
    },
    http: httpServerOptions(timeouts),
    frameworkErrors: frameworkErrorsHandler("request.invalid_body"),
    clientErrorHandler: clientErrorHandler(logger as FastifyBaseLogger),
    return503OnClosing: false,
    logController: quietRequests(),
    trustProxy:
      opts.trustedProxies !== undefined && opts.trustedProxies.length > 0 ? [...opts.trustedProxies] : false,
  });
  logRequestsAtDebug(app);
  recordRoutes(app);
  refuseWhileClosing(app);
  enforceBodyTimeout(app, timeouts, logger as FastifyBaseLogger);
  closeAfterEarlyAnswer(app);

  app.decorateRequest("caller", null);
  app.decorateRequest("callerToken", null);
  app.decorateRequest("runnerBundle", null);
  app.decorateRequest("worker", null);

  // JSON only. fastify's default parsers (including text/plain) are removed so anything else is a 415.
  app.removeAllContentTypeParsers();
  // Parsed from bytes: invalid UTF-8 is refused, not decoded to U+FFFD (nothing a client sends is coerced).
  app.addContentTypeParser("application/json", { parseAs: "buffer" }, (_req, body, done) => {
    const bytes = typeof body === "string" ? Buffer.from(body, "utf8") : body;
    if (!isUtf8(bytes)) {
      done(new DispatchCloudError("request.invalid_json", "the request body is not valid UTF-8"), undefined);
      return;
    }
    const text = bytes.toString("utf8");
    if (text.trim() === "") {
      done(null, undefined);
      return;
    }
    try {
      done(null, JSON.parse(text));
    } catch (err) {
      const at = /position (\d+)/.exec(err instanceof Error ? err.message : "");
      const where = at === null ? "" : ` (at character ${at[1]})`;
      done(
        new DispatchCloudError("request.invalid_json", `the request body is not valid JSON${where}`),
        undefined,
      );
    }
  });

  app.setNotFoundHandler((request, reply) => {
    sendError(reply, "request.not_found", `no route for ${request.method} ${request.url.split("?")[0]}`);
  });

  app.setErrorHandler(errorHandler("request.invalid_body"));

  // Requests refused for their token: counted, and summed in one warning a minute (lib/auth-refusals.ts).
  const refusals = createAuthRefusals({
    logger: logger as Logger,
    registry: opts.metricsRegistry,
    interval: opts.authRefusalLogInterval,
  });
  app.addHook("onError", async (request, _reply, err) => {
    if (err instanceof DispatchCloudError && err.status === 401) refusals.record(request, err.code);
  });
  app.addHook("onClose", async () => refusals.close());

  // A runner's upload (its token checked by the route's onRequest hook) may outlast requestTimeout while its
  // bytes keep coming at restServer.minUploadRate; anybody else's body must arrive within requestTimeout.
  app.addHook("preHandler", async (request) => {
    if (request.runnerBundle !== null) allowSlowUpload(request.raw);
  });

  // Log followers and workers' long polls end their responses before the server waits for open connections.
  const workerWaiters = createWorkerWaiters(opts.db, logger);
  app.decorate("workerWaiters", workerWaiters);
  app.addHook("preClose", async () => {
    await Promise.all([ctx.logNotifier.close(), workerWaiters.close()]);
  });

  const casDefaults = defaultConfig().cas;
  const casBackend = opts.cas?.backend ?? createFsBackend(join(opts.dataDir, "cas"));
  const partialDir = join(opts.dataDir, "cas-partial");
  const casGc = createCasGc({
    db: opts.db,
    backend: casBackend,
    clock: { now: ctx.nowMs },
    retentionMs: opts.cas?.retention ?? casDefaults.retention,
    partialDir,
    logger,
    // Blobs were removed: what this server remembers of who may read them goes too (readable-cache.ts).
    onCollected: () => ctx.casReadable.clear(),
  });
  app.decorate("casGc", casGc);
  const gcInterval = opts.cas?.gcInterval ?? 0;
  if (gcInterval > 0) casGc.start(gcInterval, opts.cas?.sleep ?? systemClock.sleep);
  app.addHook("onClose", async () => {
    await casGc.stop();
    await casBackend.close();
  });
  ctx.casBackend = casBackend;

  app.get("/_health/ping", async () => ({ health: "OK" }));
  app.get("/api/v1/openapi.json", async () => usersApiDocument());
  registerUserRoutes(app, ctx);
  registerTokenRoutes(app, ctx);
  registerImageRoutes(app, ctx);
  registerPipelineRoutes(app, ctx, {
    db: ctx.db,
    clusterId: ctx.clusterId,
    defaultMaxAttempts: ctx.defaultMaxAttempts,
    bundleMinimums: ctx.bundleMinimums,
    imageResolvers: ctx.imageResolvers,
    logger: logger as Logger,
    submitLimits: ctx.submitLimits,
  });
  registerRunnerRoutes(app, ctx);
  registerWorkerRoutes(app, ctx, {
    longPollMs: opts.workers?.longPoll ?? defaultConfig().workers.longPoll,
    runtimeEngine: opts.workers?.runtimeEngine ?? defaultConfig().dispatcher.runtimeEngine,
    waiters: workerWaiters,
  });
  ctx.casMetrics =
    opts.cas?.metricsRegistry === undefined ? null : createCasMetrics(opts.cas.metricsRegistry, opts.db);
  registerCasRoutes(app, ctx, {
    backend: casBackend,
    partialDir,
    maxBatchBytes: opts.cas?.maxBatchBytes ?? casDefaults.maxBatchBytes,
    metrics: ctx.casMetrics,
  });
  await app.ready();
  return app;
}
