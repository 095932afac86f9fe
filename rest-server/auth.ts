/**
 * Bearer-token authentication. User tokens (`dcu_...`) identify a user while they are neither revoked nor
 * expired (by the injected clock); a user may hold several (api_tokens). Runner tokens (`dcr_...`) identify one
 * bundle while it is starting or running (every transition out of those states clears the stored hash, so an old
 * runner's token stops working by itself). Only token hashes are looked up.
 */
import type { FastifyRequest } from "fastify";
import { DispatchCloudError } from "../lib/errors.ts";
import {
  bearerTokenOf,
  hashToken,
  isTokenShaped,
  RUNNER_TOKEN_PREFIX,
  USER_TOKEN_PREFIX,
} from "../lib/tokens.ts";
import type { Db } from "../store/db.ts";
import { findBundleByRunnerTokenHash, findLiveToken, touchToken } from "../store/queries.ts";
import type { ApiToken, Bundle, User } from "../store/types.ts";

declare module "fastify" {
  interface FastifyRequest {
    /** The authenticated user (users' API routes only). */
    caller: User | null;
    /** The token that authenticated the caller (users' API routes only). */
    callerToken: ApiToken | null;
    /** The bundle whose runner token authenticated the request (runner API routes only). */
    runnerBundle: Bundle | null;
  }
}

/** The authenticated caller, which the route's onRequest hook has set. */
export function callerOf(request: FastifyRequest): User {
  if (request.caller === null) throw new Error("route has no user authentication hook");
  return request.caller;
}

/** The token the caller authenticated with, which the route's onRequest hook has set. */
export function callerTokenOf(request: FastifyRequest): ApiToken {
  if (request.callerToken === null) throw new Error("route has no user authentication hook");
  return request.callerToken;
}

/** The runner's bundle, which the route's onRequest hook has set. */
export function runnerBundleOf(request: FastifyRequest): Bundle {
  if (request.runnerBundle === null) throw new Error("route has no runner authentication hook");
  return request.runnerBundle;
}

/** The bearer token of a request; throws auth.missing_token if there is none. */
export function bearerToken(request: FastifyRequest): string {
  return bearerTokenOf(request.headers.authorization);
}

const invalidToken = () => new DispatchCloudError("auth.invalid_token", "the token is not valid");

/** A token's last use is written at most this often (so authentication is a write only once a minute). */
export const LAST_USED_RESOLUTION_MS = 60_000;

/**
 * The user a request's token belongs to, and that token; a revoked or expired (at nowMs) token is
 * auth.invalid_token like an unknown one.
 */
export async function authenticateUser(
  db: Db,
  request: FastifyRequest,
  nowMs: number,
): Promise<{ user: User; token: ApiToken }> {
  const token = bearerToken(request);
  if (!isTokenShaped(token, USER_TOKEN_PREFIX)) throw invalidToken();
  const now = new Date(nowMs);
  const found = await findLiveToken(db, hashToken(token), now);
  if (found === null) throw invalidToken();
  const last = found.token.lastUsedAt;
  if (last === null || nowMs - last.getTime() >= LAST_USED_RESOLUTION_MS) {
    await touchToken(db, found.token.id, now, LAST_USED_RESOLUTION_MS);
  }
  return found;
}

/** The onRequest hook of the users' API routes: sets request.caller and request.callerToken. */
export function userAuthHook(db: Db, nowMs: () => number) {
  return async (request: FastifyRequest): Promise<void> => {
    const { user, token } = await authenticateUser(db, request, nowMs());
    request.caller = user;
    request.callerToken = token;
  };
}

export function requireAdmin(user: User): void {
  if (!user.isAdmin) throw new DispatchCloudError("auth.forbidden", "only an admin user may do this");
}

/** The bundle a runner token belongs to, while that bundle is starting or running. */
export async function authenticateRunner(db: Db, request: FastifyRequest): Promise<Bundle> {
  const token = bearerToken(request);
  if (!isTokenShaped(token, RUNNER_TOKEN_PREFIX)) throw invalidToken();
  const bundle = await findBundleByRunnerTokenHash(db, hashToken(token));
  if (bundle === null) throw invalidToken();
  if (bundle.state !== "starting" && bundle.state !== "running") {
    throw new DispatchCloudError("runner.not_current", `bundle ${bundle.uuid} is ${bundle.state}`);
  }
  return bundle;
}
