/**
 * The error shape `{ error: { code, message, path? } }` for everything the HTTP servers (the REST server and
 * the management API) answer, not only what their routes throw: fastify's own errors (a URL that does not
 * decode, a path parameter too long, body parser errors), what Node's HTTP parser refuses (malformed HTTP,
 * headers too large, headers too slow: answered on the raw socket, which is then closed), and requests that
 * arrive while the server shuts down. A caller's mistake is always a 4xx with a code of lib/errors.ts.
 */
import { STATUS_CODES } from "node:http";
import type { Socket } from "node:net";
import type { FastifyBaseLogger, FastifyError, FastifyInstance, FastifyReply, FastifyRequest } from "fastify";
import { DispatchCloudError, ERROR_CODES, type ErrorCode, errorBody } from "./errors.ts";

/** fastify's own client-error codes, mapped to ours. */
const FASTIFY_CODES: Record<string, ErrorCode> = {
  FST_ERR_CTP_BODY_TOO_LARGE: "request.body_too_large",
  FST_ERR_CTP_INVALID_MEDIA_TYPE: "request.unsupported_media_type",
  FST_ERR_CTP_INVALID_CONTENT_LENGTH: "request.invalid_body",
  FST_ERR_CTP_EMPTY_JSON_BODY: "request.invalid_json",
  FST_ERR_CTP_INVALID_JSON_BODY: "request.invalid_json",
  FST_ERR_CTP_INVALID_TYPE: "request.unsupported_media_type",
  FST_ERR_BAD_URL: "request.invalid_url",
  FST_ERR_INVALID_URL: "request.invalid_url",
  FST_ERR_MAX_PARAM_LENGTH: "request.uri_too_long",
  FST_ERR_NOT_FOUND: "request.not_found",
};

/** Any other client error from below the routes, by its HTTP status. */
const BY_STATUS: Partial<Record<number, ErrorCode>> = {
  404: "request.not_found",
  408: "request.timeout",
  413: "request.body_too_large",
  414: "request.uri_too_long",
  415: "request.unsupported_media_type",
  431: "request.headers_too_large",
};

/** Our messages where fastify's would echo the request or name fastify's internals. */
const MESSAGES: Partial<Record<ErrorCode, string>> = {
  "request.body_too_large": "the request body is larger than the server accepts",
  "request.unsupported_media_type": "the request body must be JSON with Content-Type: application/json",
  "request.invalid_url": "the URL's path has a %-escape that does not decode to UTF-8 (such as %ff)",
  "request.uri_too_long": "a path parameter of the URL is longer than 100 characters",
};

/** Node's HTTP parser errors (the server's `clientError` event), mapped to ours. */
const NODE_CLIENT_CODES: Record<string, ErrorCode> = {
  ERR_HTTP_REQUEST_TIMEOUT: "request.timeout",
  HPE_HEADER_OVERFLOW: "request.headers_too_large",
  HPE_CHUNK_EXTENSIONS_OVERFLOW: "request.body_too_large",
};

const NODE_CLIENT_MESSAGES: Partial<Record<ErrorCode, string>> = {
  "request.timeout": "the request's line and headers did not arrive within the server's headersTimeout",
  "request.headers_too_large": "the request line and headers are larger than 16 KiB",
  "request.body_too_large": "the chunked body's chunk extensions are too large",
  "request.malformed_http": "the request is not valid HTTP/1.1",
};

/**
 * Our code for an error raised below the routes (fastify, or Node under it); `fallback` for another client
 * error (4xx) without a code of its own, undefined for a server error.
 */
export function frameworkErrorCode(err: Error, fallback: ErrorCode): ErrorCode | undefined {
  const mapped = "code" in err && typeof err.code === "string" ? FASTIFY_CODES[err.code] : undefined;
  if (mapped !== undefined) return mapped;
  const status = "statusCode" in err && typeof err.statusCode === "number" ? err.statusCode : 500;
  if (status >= 400 && status < 500) return BY_STATUS[status] ?? fallback;
  return undefined;
}

export function sendError(reply: FastifyReply, code: ErrorCode, message: string, path?: string): void {
  void reply
    .code(ERROR_CODES[code].status)
    .type("application/json")
    .send(errorBody(code, message, path));
}

/**
 * The error handler of a server (fastify's setErrorHandler): a DispatchCloudError as it is, fastify's client
 * errors mapped (`fallback` for those without a code of their own), anything else a logged internal.error.
 */
export function errorHandler(fallback: ErrorCode) {
  return (err: FastifyError | DispatchCloudError | Error, request: FastifyRequest, reply: FastifyReply) => {
    if (err instanceof DispatchCloudError) {
      if (err.status === 503) request.log.warn({ err }, "request refused");
      else if (err.status >= 500) request.log.error({ err }, "request failed");
      sendError(reply, err.code, err.message, err.path);
      return;
    }
    const code = frameworkErrorCode(err, fallback);
    if (code !== undefined) {
      sendError(reply, code, MESSAGES[code] ?? err.message);
      return;
    }
    request.log.error({ err }, "unexpected error while handling a request");
    sendError(reply, "internal.error", "internal error; the server log has the details");
  };
}

/** fastify's `frameworkErrors` option: errors found before routing (bad URL encoding, too long a parameter). */
export function frameworkErrorsHandler(fallback: ErrorCode) {
  return (err: FastifyError, request: FastifyRequest, reply: FastifyReply): void => {
    const code = frameworkErrorCode(err, fallback);
    if (code === undefined) {
      request.log.error({ err }, "unexpected error before routing a request");
      sendError(reply, "internal.error", "internal error; the server log has the details");
      return;
    }
    sendError(reply, code, MESSAGES[code] ?? err.message);
  };
}

/** How long a socket answered and ended by closeWithError may take to drain before it is destroyed. */
const CLOSE_GRACE_MS = 1000;

/**
 * Closes a connection below fastify. With `answer`, and while the socket can still be written, it first gets
 * that error as a whole HTTP response (`Connection: close`); a socket whose current response has begun is
 * destroyed without a word, as a second response would corrupt the first.
 */
export function closeWithError(socket: Socket, answer?: { code: ErrorCode; message: string }): void {
  if (socket.destroyed) return;
  if (answer === undefined || !socket.writable) {
    socket.destroy();
    return;
  }
  const status = ERROR_CODES[answer.code].status;
  const body = JSON.stringify(errorBody(answer.code, answer.message));
  socket.end(
    `HTTP/1.1 ${status} ${STATUS_CODES[status] ?? "Error"}\r\nContent-Type: application/json\r\n` +
      `Content-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`,
  );
  // Ending (not destroying) lets the answer reach a client that is still sending; it gets a moment to read it.
  const timer = setTimeout(() => socket.destroy(), CLOSE_GRACE_MS);
  timer.unref();
  socket.once("close", () => clearTimeout(timer));
}

/**
 * fastify's `clientErrorHandler` option: Node's HTTP parser refused a request (malformed, headers too large
 * or too slow). The answer is written on the socket unless a response is already under way on it.
 */
export function clientErrorHandler(log: FastifyBaseLogger) {
  return (err: Error & { code?: string }, socket: Socket): void => {
    if (err.code === "ECONNRESET" || socket.destroyed) return;
    const code = NODE_CLIENT_CODES[err.code ?? ""] ?? "request.malformed_http";
    log.info({ code, cause: err.code }, "closing a connection after a client error");
    const current = (socket as Socket & { _httpMessage?: { headersSent?: boolean } | null })._httpMessage;
    if (current?.headersSent === true) {
      closeWithError(socket);
      return;
    }
    closeWithError(socket, { code, message: NODE_CLIENT_MESSAGES[code] ?? "the request was refused" });
  };
}

/**
 * Requests arriving while the server closes get 503 request.server_closing in the error shape (with
 * `Connection: close`), not fastify's own 503 body. Pass `return503OnClosing: false` to fastify with it.
 */
export function refuseWhileClosing(app: FastifyInstance): void {
  let closing = false;
  app.addHook("preClose", async () => {
    closing = true;
  });
  app.addHook("onRequest", async (_request, reply) => {
    if (!closing) return;
    reply.header("connection", "close");
    throw new DispatchCloudError("request.server_closing", "the server is shutting down; try again shortly");
  });
}
