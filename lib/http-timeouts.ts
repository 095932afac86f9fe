/**
 * Timeouts on what clients send, for both HTTP servers. A request's line and headers must arrive within
 * headersTimeout (Node's own check, which answers through the server's clientErrorHandler) and its body
 * within requestTimeout after them (a timer per request, here); a connection that trickles either is closed,
 * answered 408 request.timeout when no answer was sent yet. Only the request is timed, never the answer: a
 * followed log stays open as long as the bundle runs. A runner's upload may take longer than requestTimeout
 * while its bytes keep arriving at minUploadRate on average, so large outputs over a slow link still arrive.
 * An answer sent before its request's body arrived (a 401, say) closes the connection at once: Node would
 * otherwise keep reading the rest of the body to reuse the connection.
 */
import type { IncomingMessage, ServerOptions, ServerResponse } from "node:http";
import type { FastifyBaseLogger, FastifyInstance } from "fastify";
import { closeWithError } from "./http-errors.ts";

export interface ClientTimeouts {
  /** Milliseconds for the request line and headers. */
  headersTimeout: number;
  /** Milliseconds for the body, from the end of the headers. */
  requestTimeout: number;
  /** Bytes per second that extend requestTimeout for uploads marked by allowSlowUpload; 0 = none. */
  minUploadRate?: number;
}

/** setTimeout's largest delay; a longer one would fire at once. */
const MAX_TIMER_MS = 2 ** 31 - 1;

/**
 * Node's http.Server options (fastify's `http` option). Node checks its timeouts every
 * connectionsCheckingInterval (30 s by default), so that follows headersTimeout: at most a second late.
 * Node's own requestTimeout stays 0 (fastify's default too): the body is timed per request by
 * enforceBodyTimeout, which can make room for uploads.
 */
export function httpServerOptions(t: ClientTimeouts): ServerOptions {
  return {
    headersTimeout: t.headersTimeout,
    requestTimeout: 0,
    connectionsCheckingInterval: Math.max(10, Math.min(1000, Math.floor(t.headersTimeout / 4))),
  };
}

const slowUploads = new WeakSet<IncomingMessage>();

/** Lets this request's body take longer than requestTimeout while it arrives at minUploadRate on average. */
export function allowSlowUpload(req: IncomingMessage): void {
  slowUploads.add(req);
}

/**
 * Times every request's body on the server's sockets (requests that fastify.inject makes have none). A
 * request whose body is not complete requestTimeout after its headers (plus bytes received / minUploadRate,
 * when allowed) has its connection closed: answered 408 if nothing was answered yet, else closed silently
 * (say the 401 of a request whose body still trickles).
 */
export function enforceBodyTimeout(app: FastifyInstance, t: ClientTimeouts, log: FastifyBaseLogger): void {
  const rate = t.minUploadRate ?? 0;
  app.server.on("request", (req: IncomingMessage, res: ServerResponse) => {
    const started = Date.now();
    const socket = req.socket;
    const readBefore = socket.bytesRead;
    let timer: NodeJS.Timeout | undefined;
    const arm = (delay: number) => {
      timer = setTimeout(check, Math.min(Math.max(delay, 1), MAX_TIMER_MS));
      timer.unref();
    };
    const check = () => {
      if (req.complete || socket.destroyed) return;
      let allowed = t.requestTimeout;
      if (rate > 0 && slowUploads.has(req)) allowed += ((socket.bytesRead - readBefore) / rate) * 1000;
      const elapsed = Date.now() - started;
      if (elapsed < allowed) {
        arm(allowed - elapsed);
        return;
      }
      log.info(
        { method: req.method, url: (req.url ?? "").split("?")[0]?.slice(0, 200), answered: res.headersSent },
        "closing a connection whose request body did not arrive in time",
      );
      closeWithError(
        socket,
        res.headersSent
          ? undefined
          : {
              code: "request.timeout",
              message: "the request body did not arrive within the server's requestTimeout",
            },
      );
    };
    arm(t.requestTimeout);
    req.once("close", () => clearTimeout(timer));
  });
}

/**
 * Answers sent before their request's body was complete carry `Connection: close`, so Node ends the connection
 * after the answer instead of reading (and waiting for) the rest of the body.
 */
export function closeAfterEarlyAnswer(app: FastifyInstance): void {
  app.addHook("onSend", async (request, reply) => {
    // fastify.inject's requests have no `complete`: only real sockets are concerned.
    if (request.raw.complete === false) reply.header("connection", "close");
  });
}
