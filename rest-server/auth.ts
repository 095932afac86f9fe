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
  WORKER_TOKEN_PREFIX,
} from "../lib/tokens.ts";
import type { Db } from "../store/db.ts";
import { findBundleByRunnerTokenHash, findLiveToken, touchToken } from "../store/queries.ts";
import type { ApiToken, Bundle, User, Worker } from "../store/types.ts";
import { findWorkerByTokenHash } from "../store/worker-queries.ts";

declare module "fastify" {
  interface FastifyRequest {
    /** The authenticated user (users' API routes only). */
    caller: User | null;
    /** The token that authenticated the caller (users' API routes only). */
    callerToken: ApiToken | null;
    /** The bundle whose runner token authenticated the request (runner API routes only). */
    runnerBundle: Bundle | null;
    /** The user's worker whose token authenticated the request (the workers' own routes only). */
    worker: Worker | null;
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

/**
 * A worker token (`dcw_...`) on any route but the worker's own: refused by its prefix alone, before any lookup,
 * so it is never looked for in another table (docs/workers.md).
 */
function refuseWorkerToken(token: string): void {
  if (token.startsWith(WORKER_TOKEN_PREFIX)) {
    throw new DispatchCloudError(
      "workers.worker_token",
      "a worker token may only check in, check out and fetch the runner artifact",
    );
  }
}

/** A token's last use is written at most this often (so authentication is a write only once a minute). */
export const LAST_USED_RESOLUTION_MS = 60_000;

/**
 * How long a token found live is trusted without asking the database again. Revocations through this server
 * clear the cache at once; a change made elsewhere (another server process, SQL) takes effect within this.
 */
export const TOKEN_CACHE_MS = 1000;
const TOKEN_CACHE_MAX = 10_000;

type FoundToken = { user: User; token: ApiToken };

/**
 * Live tokens looked up in the last TOKEN_CACHE_MS, by hash, so a client sending many requests costs the
 * database one lookup a second rather than one a request. Unknown tokens are never cached.
 */
export class TokenCache {
  private readonly entries = new Map<string, { found: FoundToken; at: number }>();

  get(hash: string, nowMs: number): FoundToken | undefined {
    const e = this.entries.get(hash);
    if (e === undefined) return undefined;
    const expires = e.found.token.expiresAt;
    if (nowMs - e.at >= TOKEN_CACHE_MS || nowMs < e.at || (expires !== null && expires.getTime() <= nowMs)) {
      this.entries.delete(hash);
      return undefined;
    }
    return e.found;
  }

  set(hash: string, found: FoundToken, nowMs: number): void {
    this.entries.delete(hash);
    if (this.entries.size >= TOKEN_CACHE_MAX) {
      const oldest = this.entries.keys().next();
      if (oldest.done !== true) this.entries.delete(oldest.value);
    }
    this.entries.set(hash, { found, at: nowMs });
  }

  /** Forgets every token (after a revocation or any change to tokens or users). */
  clear(): void {
    this.entries.clear();
  }
}

/**
 * The user a request's token belongs to, and that token; a revoked or expired (at nowMs) token is
 * auth.invalid_token like an unknown one. With a cache, a token found live in the last TOKEN_CACHE_MS is not
 * looked up again.
 */
export async function authenticateUser(
  db: Db,
  request: FastifyRequest,
  nowMs: number,
  cache?: TokenCache,
): Promise<FoundToken> {
  const token = bearerToken(request);
  refuseWorkerToken(token);
  if (!isTokenShaped(token, USER_TOKEN_PREFIX)) throw invalidToken();
  const hash = hashToken(token);
  const cached = cache?.get(hash, nowMs);
  if (cached !== undefined) return cached;
  const now = new Date(nowMs);
  const found = await findLiveToken(db, hash, now);
  if (found === null) throw invalidToken();
  const last = found.token.lastUsedAt;
  if (last === null || nowMs - last.getTime() >= LAST_USED_RESOLUTION_MS) {
    await touchToken(db, found.token.id, now, LAST_USED_RESOLUTION_MS);
  }
  cache?.set(hash, found, nowMs);
  return found;
}

/** The onRequest hook of the users' API routes: sets request.caller and request.callerToken. */
export function userAuthHook(db: Db, nowMs: () => number, cache?: TokenCache) {
  return async (request: FastifyRequest): Promise<void> => {
    const { user, token } = await authenticateUser(db, request, nowMs(), cache);
    request.caller = user;
    request.callerToken = token;
  };
}

export function requireAdmin(user: User): void {
  if (!user.isAdmin) throw new DispatchCloudError("auth.forbidden", "only an admin user may do this");
}

/** The hash of the request's runner token (auth.* errors for a missing, malformed or worker token). */
export function runnerTokenHashOf(request: FastifyRequest): string {
  return runnerTokenHash(bearerToken(request));
}

/** The hash of a runner token, looked up by it; any other token is auth.invalid_token (or a worker's error). */
export function runnerTokenHash(token: string): string {
  refuseWorkerToken(token);
  if (!isTokenShaped(token, RUNNER_TOKEN_PREFIX)) throw invalidToken();
  return hashToken(token);
}

/** The bundle a runner token belongs to, while that bundle is starting or running. */
export function authenticateRunner(db: Db, request: FastifyRequest): Promise<Bundle> {
  return runnerBundleByTokenHash(db, runnerTokenHashOf(request));
}

/** authenticateRunner, for the hash of a token given other than in the Authorization header. */
export async function runnerBundleByTokenHash(db: Db, tokenHash: string): Promise<Bundle> {
  const bundle = await findBundleByRunnerTokenHash(db, tokenHash);
  if (bundle === null) throw invalidToken();
  if (bundle.state !== "starting" && bundle.state !== "running") {
    throw new DispatchCloudError("runner.not_current", `bundle ${bundle.uuid} is ${bundle.state}`);
  }
  return bundle;
}

/** The worker set by the route's onRequest hook (the workers' own routes). */
export function workerOf(request: FastifyRequest): Worker {
  if (request.worker === null) throw new Error("route has no worker authentication hook");
  return request.worker;
}

/**
 * The worker a worker token (`dcw_...`) belongs to; any other token (a user's, a runner's) is auth.invalid_token
 * here, and a disabled worker's is workers.disabled. Only the token's hash is looked up.
 */
export async function authenticateWorker(db: Db, request: FastifyRequest): Promise<Worker> {
  const token = bearerToken(request);
  if (!isTokenShaped(token, WORKER_TOKEN_PREFIX)) throw invalidToken();
  const worker = await findWorkerByTokenHash(db, hashToken(token));
  if (worker === null) throw invalidToken();
  if (worker.disabledAt !== null) {
    throw new DispatchCloudError(
      "workers.disabled",
      `worker ${worker.id} is disabled; its owner or an admin may enable it`,
    );
  }
  return worker;
}
