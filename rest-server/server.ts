/**
 * The REST server: the users' API, the runner API and the health check, on fastify. One error handler
 * turns every failure into `{ error: { code, message, path? } }`; a caller's mistake is always a 4xx.
 */
import { join } from "node:path";
import Fastify, {
  type FastifyBaseLogger,
  type FastifyError,
  type FastifyInstance,
  type FastifyReply,
} from "fastify";
import { pino } from "pino";
import type { Clock } from "../lib/clock.ts";
import { DispatchCloudError, ERROR_CODES, type ErrorCode, errorBody } from "../lib/errors.ts";
import { type Logger, REDACTED_PATHS } from "../lib/logger.ts";
import { usersApiDocument } from "../management-api/openapi.ts";
import type { Db } from "../store/db.ts";
import { createLogNotifier, type LogNotifier } from "./logs.ts";
import { createOutputStore, type OutputStore } from "./outputs.ts";
import { NO_SUBMIT_LIMITS, type SubmitLimits } from "./quotas.ts";
import { registerRunnerRoutes } from "./routes-runner.ts";
import { registerTokenRoutes } from "./routes-tokens.ts";
import { registerUserRoutes } from "./routes-users.ts";

export interface RestServerOptions {
  db: Db;
  /** A pino logger (the server logs through a child of it), or false for no logging. */
  logger: Logger | false;
  clusterId: string;
  /** Largest accepted request body, in bytes. */
  maxRequestBodySize: number;
  /** maxAttempts of a bundle whose request does not say. */
  defaultMaxAttempts: number;
  /** Source of "now" for derived timings; defaults to the system clock. */
  clock?: Pick<Clock, "now">;
  /** Where outputs are kept: `<dataDir>/outputs/<bundle uuid>/` (created when the first upload arrives). */
  dataDir: string;
  /** Largest output upload of one bundle, in bytes (the sum of its files); default 10 GiB. */
  maxOutputSize?: number;
  /** How often a log follower re-reads when no notification woke it, in ms; default 5000. */
  logPollInterval?: number;
  /** An instance type's price in dollars per hour (config), for the cost stored at finish; none: no cost. */
  instancePrice?: (instanceType: string) => number | undefined;
  /** Per-user limits (config `quotas`); default: no submission limits, 100 tokens per user. */
  quotas?: SubmitLimits & { maxTokensPerUser: number };
}

/** What the routes need, built once by createRestServer. */
export interface RouteContext {
  db: Db;
  clusterId: string;
  defaultMaxAttempts: number;
  nowMs(): number;
  outputs: OutputStore;
  maxOutputSize: number;
  logNotifier: LogNotifier;
  logPollInterval: number;
  instancePrice(instanceType: string): number | undefined;
  submitLimits: SubmitLimits;
  maxTokensPerUser: number;
}

export const DEFAULT_MAX_OUTPUT_SIZE = 10 * 2 ** 30;
export const DEFAULT_MAX_TOKENS_PER_USER = 100;

/** fastify's own error codes, mapped to ours. */
const FASTIFY_CODES: Record<string, ErrorCode> = {
  FST_ERR_CTP_BODY_TOO_LARGE: "request.body_too_large",
  FST_ERR_CTP_INVALID_MEDIA_TYPE: "request.unsupported_media_type",
  FST_ERR_CTP_INVALID_CONTENT_LENGTH: "request.invalid_body",
  FST_ERR_CTP_EMPTY_JSON_BODY: "request.invalid_json",
  FST_ERR_CTP_INVALID_JSON_BODY: "request.invalid_json",
  FST_ERR_CTP_INVALID_TYPE: "request.unsupported_media_type",
};

const MESSAGES: Partial<Record<ErrorCode, string>> = {
  "request.body_too_large": "the request body is larger than the server accepts",
  "request.unsupported_media_type": "the request body must be JSON with Content-Type: application/json",
};

export async function createRestServer(opts: RestServerOptions): Promise<FastifyInstance> {
  const clock = opts.clock;
  const logger =
    opts.logger === false
      ? pino({ enabled: false })
      : opts.logger.child(
          { component: "rest-server" },
          { redact: { paths: REDACTED_PATHS, censor: "[redacted]" } },
        );
  const ctx: RouteContext = {
    db: opts.db,
    clusterId: opts.clusterId,
    defaultMaxAttempts: opts.defaultMaxAttempts,
    nowMs: clock === undefined ? () => Date.now() : () => clock.now(),
    outputs: createOutputStore(join(opts.dataDir, "outputs")),
    maxOutputSize: opts.maxOutputSize ?? DEFAULT_MAX_OUTPUT_SIZE,
    logNotifier: createLogNotifier(opts.db, logger),
    logPollInterval: opts.logPollInterval ?? 5000,
    instancePrice: opts.instancePrice ?? (() => undefined),
    submitLimits: opts.quotas ?? NO_SUBMIT_LIMITS,
    maxTokensPerUser: opts.quotas?.maxTokensPerUser ?? DEFAULT_MAX_TOKENS_PER_USER,
  };
  const app = Fastify({
    loggerInstance: logger as FastifyBaseLogger,
    bodyLimit: opts.maxRequestBodySize,
    // No schema compiled by fastify may strip unknown fields or coerce types; bodies are validated in
    // the routes (validate.ts), query strings parsed by hand.
    ajv: {
      customOptions: { removeAdditional: false, coerceTypes: false, useDefaults: false, allErrors: false },
    },
    return503OnClosing: true,
  });

  app.decorateRequest("caller", null);
  app.decorateRequest("callerToken", null);
  app.decorateRequest("runnerBundle", null);

  // JSON only. fastify's default parsers (including text/plain) are removed so anything else is a 415.
  app.removeAllContentTypeParsers();
  app.addContentTypeParser("application/json", { parseAs: "string" }, (_req, body, done) => {
    const text = typeof body === "string" ? body : body.toString("utf8");
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

  app.setErrorHandler((err: FastifyError | DispatchCloudError | Error, request, reply) => {
    if (err instanceof DispatchCloudError) {
      if (err.status >= 500) request.log.error({ err }, "request failed");
      sendError(reply, err.code, err.message, err.path);
      return;
    }
    const code = "code" in err && typeof err.code === "string" ? FASTIFY_CODES[err.code] : undefined;
    const status = "statusCode" in err && typeof err.statusCode === "number" ? err.statusCode : 500;
    if (code !== undefined) {
      sendError(reply, code, MESSAGES[code] ?? err.message);
      return;
    }
    if (status >= 400 && status < 500) {
      // Some other client error found by fastify (bad URL, bad header...): still the caller's mistake.
      sendError(reply, status === 404 ? "request.not_found" : "request.invalid_body", err.message);
      return;
    }
    request.log.error({ err }, "unexpected error while handling a request");
    sendError(reply, "internal.error", "internal error; the server log has the details");
  });

  // Log followers end their responses before the server waits for open connections to finish.
  app.addHook("preClose", async () => {
    await ctx.logNotifier.close();
  });

  app.get("/_health/ping", async () => ({ health: "OK" }));
  app.get("/api/v1/openapi.json", async () => usersApiDocument());
  registerUserRoutes(app, ctx);
  registerTokenRoutes(app, ctx);
  registerRunnerRoutes(app, ctx);
  await app.ready();
  return app;
}

function sendError(reply: FastifyReply, code: ErrorCode, message: string, path?: string): void {
  const body = errorBody(code, message, path);
  void reply.code(ERROR_CODES[code].status).type("application/json").send(body);
}
