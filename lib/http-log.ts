/**
 * Request logging for the fastify servers: one line per request at debug level, not fastify's two lines at
 * info (a `submit --wait` polls every second, and people at a terminal should see what matters: bundles
 * changing state, instances created and shut down, errors). Servers pass `logController: quietRequests()` and
 * call logRequestsAtDebug once.
 */
import { type FastifyInstance, LogController } from "fastify";

/** Fastify's own per-request lines turned off (logRequestsAtDebug writes one instead). */
export function quietRequests(): LogController {
  return new LogController({ disableRequestLogging: true });
}

export function logRequestsAtDebug(app: FastifyInstance): void {
  app.addHook("onResponse", async (request, reply) => {
    request.log.debug(
      {
        method: request.method,
        url: request.url.split("?")[0],
        statusCode: reply.statusCode,
        ms: Math.round(reply.elapsedTime),
      },
      "request completed",
    );
  });
}
