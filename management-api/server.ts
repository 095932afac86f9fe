/**
 * The management API server (issue 6; docs/operations.md): a fastify instance served on `management.listen`
 * by the process that runs the dispatcher. Every route, /metrics and /_health/ping included, needs
 * `Authorization: Bearer <management.token>`: no token configured -> 403 auth.forbidden for everything, no
 * header -> 401 auth.missing_token, a wrong token -> 403 auth.forbidden (compared in constant time). Errors,
 * fastify's and Node's own included, are `{ error: { code, message, path? } }` as on the REST server
 * (lib/http-errors.ts); requests are timed as there (management.headersTimeout, requestTimeout); the token
 * never appears in a log.
 */
import Fastify, { type FastifyBaseLogger, type FastifyInstance } from "fastify";
import { pino } from "pino";
import type { Registry } from "prom-client";
import type { Config } from "../config/schema.ts";
import { resolveSecret } from "../config/secrets.ts";
import { createAuthRefusals } from "../lib/auth-refusals.ts";
import type { Clock } from "../lib/clock.ts";
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
import { closeAfterEarlyAnswer, enforceBodyTimeout, httpServerOptions } from "../lib/http-timeouts.ts";
import { type Logger, REDACTED_PATHS } from "../lib/logger.ts";
import { bearerTokenOf, constantTimeEqual } from "../lib/tokens.ts";
import type { Db } from "../store/db.ts";
import { registerManagementRoutes } from "./routes.ts";
import type { ManagementSource } from "./views.ts";

export interface ManagementServerOptions {
  /** management.token (a secret reference, resolved here once), the instance types and scheduler options. */
  config: Config;
  /** The dispatcher (createDispatcher's result): its parts while active. */
  dispatcher: ManagementSource;
  /** For bundle kills. */
  db: Db;
  /** The registry the dispatcher's metrics are on (served at /metrics). */
  registry: Registry;
  /** A pino logger (the server logs through a child of it), or false for no logging. */
  logger: Logger | false;
  clock?: Pick<Clock, "now">;
  /** Milliseconds between the warnings that sum refused tokens (lib/auth-refusals.ts); default a minute. */
  authRefusalLogInterval?: number;
  /** Where env: secrets are read; default process.env. */
  env?: Readonly<Record<string, string | undefined>>;
}

/**
 * Builds the server (not listening: call app.listen). Throws config.missing_secret or config.unreadable_file
 * when management.token points at an unset variable or an unreadable file.
 */
export async function createManagementServer(opts: ManagementServerOptions): Promise<FastifyInstance> {
  const token = resolveSecret(opts.config.management.token, "management.token", opts.env ?? process.env);
  const clock = opts.clock;
  const logger =
    opts.logger === false
      ? pino({ enabled: false })
      : opts.logger.child(
          { component: "management-api" },
          { redact: { paths: REDACTED_PATHS, censor: "[redacted]" } },
        );
  const timeouts = {
    headersTimeout: opts.config.management.headersTimeout,
    requestTimeout: opts.config.management.requestTimeout,
  };
  const app = Fastify({
    loggerInstance: logger as FastifyBaseLogger,
    bodyLimit: 64 * 1024,
    http: httpServerOptions(timeouts),
    frameworkErrors: frameworkErrorsHandler("request.invalid_query"),
    clientErrorHandler: clientErrorHandler(logger as FastifyBaseLogger),
    return503OnClosing: false,
    logController: quietRequests(),
  });
  logRequestsAtDebug(app);
  recordRoutes(app);
  refuseWhileClosing(app);
  enforceBodyTimeout(app, timeouts, logger as FastifyBaseLogger);
  closeAfterEarlyAnswer(app);

  app.addHook("onRequest", async (request) => {
    if (token === "") {
      throw new DispatchCloudError(
        "auth.forbidden",
        "the management API is disabled: management.token is not configured",
      );
    }
    const given = bearerTokenOf(request.headers.authorization);
    if (!constantTimeEqual(given, token)) {
      throw new DispatchCloudError("auth.forbidden", "the token is not the management token");
    }
  });

  app.setNotFoundHandler((request, reply) => {
    sendError(reply, "request.not_found", `no route for ${request.method} ${request.url.split("?")[0]}`);
  });

  app.setErrorHandler(errorHandler("request.invalid_query"));

  // Requests with no token or not the management token (not those refused because none is configured): counted
  // on their own metric, and summed in one warning a minute with the addresses that sent them.
  if (token !== "") {
    const refusals = createAuthRefusals({
      logger: logger as Logger,
      registry: opts.registry,
      interval: opts.authRefusalLogInterval,
      api: "management",
    });
    app.addHook("onError", async (request, _reply, err) => {
      if (err instanceof DispatchCloudError && (err.status === 401 || err.code === "auth.forbidden"))
        refusals.record(request, err.code);
    });
    app.addHook("onClose", async () => refusals.close());
  }

  registerManagementRoutes(app, {
    dispatcher: opts.dispatcher,
    db: opts.db,
    registry: opts.registry,
    nowMs: clock === undefined ? () => Date.now() : () => clock.now(),
  });
  await app.ready();
  return app;
}
