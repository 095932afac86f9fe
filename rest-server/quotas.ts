/**
 * Per-user submission limits (config `quotas`): at most maxQueuedBundlesPerUser non-final bundles at once, and a
 * token bucket of submissionBurst submissions refilled at submissionsPerSecond. The checks and the insert run in
 * one transaction that holds the user's quota row (store/queries.ts lockSubmitBucket), so parallel submissions of
 * one user are counted exactly: the cap is never exceeded, by any number of REST server processes. A refused
 * submission spends nothing. Admins are exempt (docs/decisions.md).
 */
import type { FastifyReply } from "fastify";
import { ERROR_CODES, type ErrorCode, errorBody } from "../lib/errors.ts";
import type { Db } from "../store/db.ts";
import {
  countActiveBundles,
  lockSubmitBucket,
  type SubmitBucket,
  saveSubmitBucket,
} from "../store/queries.ts";
import type { User } from "../store/types.ts";

export interface SubmitLimits {
  /** 0 = unlimited. */
  maxQueuedBundlesPerUser: number;
  /** Bucket refill rate; 0 = unlimited. */
  submissionsPerSecond: number;
  /** Bucket size (>= 1). */
  submissionBurst: number;
}

/** What createRestServer uses when it is given no limits (tests, embedders): none. */
export const NO_SUBMIT_LIMITS: SubmitLimits = {
  maxQueuedBundlesPerUser: 0,
  submissionsPerSecond: 0,
  submissionBurst: 1,
};

export type SubmitRefusal =
  | { reason: "queued"; limit: number; active: number; asked: number }
  | { reason: "rate"; retryAfterSeconds: number; perSecond: number; burst: number };

/** The bucket at nowMs: refilled for the time since it was last refilled, never above burst. */
export function refillBucket(bucket: SubmitBucket, nowMs: number, limits: SubmitLimits): SubmitBucket {
  const last = bucket.refilledAt.getTime();
  const elapsedSeconds = Math.max(0, nowMs - last) / 1000;
  return {
    tokens: Math.min(limits.submissionBurst, bucket.tokens + elapsedSeconds * limits.submissionsPerSecond),
    refilledAt: new Date(Math.max(last, nowMs)),
  };
}

/** Whole seconds until a bucket holding `tokens` has one to spend (at least 1). */
export function retryAfterSeconds(tokens: number, perSecond: number): number {
  return Math.max(1, Math.ceil((1 - tokens) / perSecond));
}

/** Whether a submission of `owner` is checked against `limits` at all (admins and unlimited setups are not). */
export function limitsApply(owner: User, limits: SubmitLimits): boolean {
  return !owner.isAdmin && (limits.maxQueuedBundlesPerUser > 0 || limits.submissionsPerSecond > 0);
}

/**
 * Runs `insert` (of `count` new bundles) unless it would take the owner over a limit; admins are never limited.
 * A request spends one submission from the bucket whatever its size (the rate guards requests); the queued cap
 * counts every bundle (a batch that would go past it is refused whole). The refusal says which limit and, for
 * the rate, when to try again.
 */
export async function insertWithinLimits<T>(
  db: Db,
  args: {
    owner: User;
    count: number;
    limits: SubmitLimits;
    nowMs: number;
    insert: (tx: Db) => Promise<T>;
  },
): Promise<{ ok: true; value: T } | { ok: false; refusal: SubmitRefusal }> {
  const { limits, owner, count } = args;
  const maxQueued = limits.maxQueuedBundlesPerUser;
  const rate = limits.submissionsPerSecond;
  if (!limitsApply(owner, limits)) return { ok: true, value: await args.insert(db) };
  return db.transaction(async (tx) => {
    const stored = await lockSubmitBucket(tx, {
      userUuid: owner.uuid,
      burst: limits.submissionBurst,
      now: new Date(args.nowMs),
    });
    const bucket = refillBucket(stored, args.nowMs, limits);
    if (rate > 0 && bucket.tokens < 1) {
      return {
        ok: false,
        refusal: {
          reason: "rate",
          retryAfterSeconds: retryAfterSeconds(bucket.tokens, rate),
          perSecond: rate,
          burst: limits.submissionBurst,
        },
      };
    }
    if (maxQueued > 0) {
      const active = await countActiveBundles(tx, owner.uuid, maxQueued);
      if (active + count > maxQueued) {
        return { ok: false, refusal: { reason: "queued", limit: maxQueued, active, asked: count } };
      }
    }
    if (rate > 0) await saveSubmitBucket(tx, owner.uuid, { ...bucket, tokens: bucket.tokens - 1 });
    return { ok: true, value: await args.insert(tx) };
  });
}

/** The 429 answer to a refused submission, in the API's error shape (a rate refusal with Retry-After). */
export function sendRefusal(reply: FastifyReply, refusal: SubmitRefusal): FastifyReply {
  let code: ErrorCode;
  let message: string;
  if (refusal.reason === "rate") {
    code = "quota.rate_limited";
    message =
      `too many submissions: at most ${refusal.perSecond} per second (${refusal.burst} at once) per user; ` +
      `try again in ${refusal.retryAfterSeconds} s`;
    void reply.header("retry-after", String(refusal.retryAfterSeconds));
  } else {
    code = "quota.queued_bundles";
    message =
      refusal.asked === 1
        ? `you already have ${refusal.limit} bundles that are not finished, the most one user may have ` +
          "(quotas.maxQueuedBundlesPerUser); submit again once some have finished"
        : `these ${refusal.asked} bundles and the ${refusal.active} of yours that are not finished would be ` +
          `more than ${refusal.limit}, the most one user may have (quotas.maxQueuedBundlesPerUser); ` +
          "submit fewer, or again once some have finished";
  }
  return reply.code(ERROR_CODES[code].status).type("application/json").send(errorBody(code, message));
}
