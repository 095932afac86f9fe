/**
 * Requests refused for their token, made visible to the operator without a line per request: a counter by the
 * kind of token (its prefix: user, runner, worker, other, or none) and error code, and every `interval` one
 * warning that sums the refusals of that interval with the client addresses that sent most of them. No token, nor
 * any part of one, is logged or labelled. The REST server counts its 401s (`auth.missing_token`,
 * `auth.invalid_token`); the management API its 401s and its 403s for a wrong management token (`auth.forbidden`),
 * each on its own metric and warning (API_NAMES).
 *
 * Nothing is refused for having been refused before (docs/decisions.md): tokens are 256-bit random strings, and a
 * runner whose bundle ended holds a token that stopped working, so a block by address would stop live runners
 * that share a NAT address with a stale one.
 */
import type { FastifyRequest } from "fastify";
import { Counter, type Registry } from "prom-client";
import type { Logger } from "../lib/logger.ts";
import { bearerTokenOf, RUNNER_TOKEN_PREFIX, USER_TOKEN_PREFIX, WORKER_TOKEN_PREFIX } from "../lib/tokens.ts";

/** Addresses counted separately within one interval; beyond them refusals count in the total only. */
const MAX_ADDRESSES = 10_000;
/** Addresses named in the interval's warning, most refusals first. */
const TOP_ADDRESSES = 10;

export type TokenKind = "user" | "runner" | "worker" | "other" | "none";

/** Which server's refusals: the metric's name and help, and the warning's message. */
export const API_NAMES = {
  rest: {
    metric: "dispatchcloud_rest_auth_refusals_total",
    help: "Requests the REST server refused for their token (401), by the token's kind (its prefix) and error code.",
    message: "requests refused for their token",
  },
  management: {
    metric: "dispatchcloud_management_auth_refusals_total",
    help: "Requests the management API refused for their token (401 none, 403 not the management token), by the token's kind (its prefix) and error code.",
    message: "management API requests refused for their token",
  },
} as const;

export interface AuthRefusals {
  /** Counts one refused request (its token's kind from the Authorization header, the error's code). */
  record(request: FastifyRequest, code: string): void;
  /** Logs what the current interval has, if anything, and starts a new one. */
  flush(): void;
  /** Stops the interval's timer, after a last flush. */
  close(): void;
}

/** The kind of bearer token a request carries, by its prefix only. */
export function tokenKind(authorization: string | undefined): TokenKind {
  let token: string;
  try {
    token = bearerTokenOf(authorization);
  } catch {
    return "none";
  }
  if (token.startsWith(USER_TOKEN_PREFIX)) return "user";
  if (token.startsWith(RUNNER_TOKEN_PREFIX)) return "runner";
  if (token.startsWith(WORKER_TOKEN_PREFIX)) return "worker";
  return "other";
}

export function createAuthRefusals(opts: {
  logger: Logger;
  registry?: Registry | undefined;
  /** Milliseconds between warnings (each sums its interval); default one minute. */
  interval?: number | undefined;
  /** Whose refusals (default the REST server's). */
  api?: keyof typeof API_NAMES;
}): AuthRefusals {
  const names = API_NAMES[opts.api ?? "rest"];
  const counter =
    opts.registry === undefined
      ? null
      : new Counter({
          name: names.metric,
          help: names.help,
          labelNames: ["token", "code"],
          registers: [opts.registry],
        });
  let total = 0;
  let byAddress = new Map<string, number>();
  let kinds = new Map<TokenKind, number>();

  const flush = () => {
    if (total === 0) return;
    const top = [...byAddress.entries()]
      .sort((a, b) => b[1] - a[1])
      .slice(0, TOP_ADDRESSES)
      .map(([address, count]) => ({ address, count }));
    opts.logger.warn(
      {
        refusals: total,
        byToken: Object.fromEntries(kinds),
        addresses: byAddress.size,
        topAddresses: top,
      },
      names.message,
    );
    total = 0;
    byAddress = new Map();
    kinds = new Map();
  };
  const timer = setInterval(flush, opts.interval ?? 60_000);
  timer.unref();

  return {
    record(request, code) {
      const kind = tokenKind(request.headers.authorization);
      counter?.inc({ token: kind, code });
      total++;
      kinds.set(kind, (kinds.get(kind) ?? 0) + 1);
      const address = request.ip;
      const seen = byAddress.get(address);
      if (seen !== undefined) byAddress.set(address, seen + 1);
      else if (byAddress.size < MAX_ADDRESSES) byAddress.set(address, 1);
    },
    flush,
    close() {
      clearInterval(timer);
      flush();
    },
  };
}
