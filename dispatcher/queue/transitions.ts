/**
 * The one owner of the dispatcher's bundle transitions (Arvados: the container queue's Lock/Unlock/Cancel):
 * claim (staged -> starting, with a fresh runner token), requeue (starting -> staged), lose (running -> staged,
 * or failed once attempts are used up) and fail (staged -> failed). Each is the store's guarded statement; the
 * row it returns, or the row as it is now when the guard did not hold, is applied to the queue at once, so the
 * next pass need not wait for NOTIFY. The pool, sync and the scheduler ask this module; none writes a
 * transition itself. Database errors are thrown (each caller has its own retry rule).
 */
import type { ClaimsInFlight } from "../../lib/claims-in-flight.ts";
import { groupCalls } from "../../lib/group-calls.ts";
import type { Logger } from "../../lib/logger.ts";
import { hashToken, newRunnerToken } from "../../lib/tokens.ts";
import type { Db } from "../../store/db.ts";
import {
  failStaged,
  loseBundle,
  requeueStarting,
  type StartItem,
  startBundle,
  startBundleOnWorker,
  startBundles,
} from "../../store/transitions.ts";
import type { Bundle, TransitionResult } from "../../store/types.ts";
import type { QueueView } from "../types.ts";

export type ClaimResult =
  | { ok: true; bundle: Bundle /** The runner token; only its hash is stored. */; token: string }
  | { ok: false; reason: "not_found" | "wrong_state" | "wrong_attempt"; current: Bundle | null };

export interface BundleTransitions {
  /**
   * staged -> starting on an instance: the next attempt, the instance, its GPU devices, what the attempt is
   * charged per hour of running (StartItem.pricePerHour; null: nothing), a runner token (`token`, made by a
   * caller that sends it before the claim answers; else a new one). With `fromAttempt`, only a bundle at that
   * attempt now is claimed (the caller has named the next one already).
   */
  claim(
    uuid: string,
    on: {
      instanceId: string;
      instanceType: string;
      gpuDevices: readonly number[];
      pricePerHour: number | null;
      token?: string;
      fromAttempt?: number;
    },
  ): Promise<ClaimResult>;
  /**
   * staged -> starting on a user's own worker (docs/workers.md): the next attempt, the worker, its GPU devices.
   * No runner token: the REST server makes one when the worker's check-in picks the bundle up.
   */
  claimOnWorker(
    uuid: string,
    on: { workerId: string; gpuDevices: readonly number[] },
  ): Promise<TransitionResult>;
  /** starting -> staged: the runner never started (or failed before `start`); counts the attempt. */
  requeue(uuid: string, attempt: number, reason: string): Promise<TransitionResult>;
  /** running -> staged while attempts remain, else failed: the instance was lost or preempted. */
  lose(uuid: string, attempt: number, reason: string): Promise<TransitionResult>;
  /** staged -> failed: it can never run (no type fits it, or its attempts are used up). */
  fail(uuid: string, reason: string): Promise<TransitionResult>;
}

const ACTOR = "dispatcher";

/** Claims per grouped statement: a pass that starts more makes more statements. */
const MAX_CLAIM_GROUP = 200;

export function createBundleTransitions(opts: {
  db: Db;
  /** Where rows are applied (the dispatcher's BundleQueue); none: nothing is applied. */
  queue?: Pick<QueueView, "apply"> | undefined;
  logger: Logger;
  /** Where each claim is recorded until it answers (a REST server in the same process waits there). */
  claimsInFlight?: ClaimsInFlight | undefined;
}): BundleTransitions {
  const { db, queue } = opts;
  const log = opts.logger.child({ component: "transitions" });

  const applied = (result: TransitionResult, what: string, uuid: string): TransitionResult => {
    const row = result.ok ? result.bundle : result.current;
    if (row !== null) queue?.apply(row);
    if (result.ok) log.debug({ bundle: uuid, state: result.bundle.state }, what);
    else log.debug({ bundle: uuid, reason: result.reason, state: result.current?.state }, `${what}: lost`);
    return result;
  };

  const claims = groupCalls<StartItem, Bundle | null>({
    max: MAX_CLAIM_GROUP,
    run: async (items) => {
      // By token hash: a uuid given twice moved once, with one of the two tokens; the other is asked alone.
      const moved = await startBundles(db, items, ACTOR);
      return items.map((i) => moved.get(i.runnerTokenHash) ?? null);
    },
  });

  return {
    claim(uuid, on) {
      const token = on.token ?? newRunnerToken();
      const item: StartItem = {
        uuid,
        instanceId: on.instanceId,
        instanceType: on.instanceType,
        runnerTokenHash: hashToken(token),
        gpuDevices: [...on.gpuDevices],
        pricePerHour: on.pricePerHour,
        fromAttempt: on.fromAttempt ?? null,
      };
      const claimed = (async (): Promise<ClaimResult> => {
        // The claims of one pass go as one statement; one that it did not move is asked alone, which says why.
        const grouped = await claims.call(item);
        const result: TransitionResult =
          grouped !== null
            ? { ok: true, bundle: grouped }
            : await startBundle(db, uuid, { ...item, actor: ACTOR });
        applied(result, "claimed", uuid);
        return result.ok
          ? { ok: true, bundle: result.bundle, token }
          : { ok: false, reason: result.reason, current: result.current };
      })();
      opts.claimsInFlight?.add(item.runnerTokenHash, claimed);
      return claimed;
    },
    async claimOnWorker(uuid, on) {
      const result = await startBundleOnWorker(db, uuid, {
        workerId: on.workerId,
        gpuDevices: [...on.gpuDevices],
        actor: ACTOR,
      });
      return applied(result, "given to a worker", uuid);
    },
    async requeue(uuid, attempt, reason) {
      return applied(await requeueStarting(db, uuid, attempt, { actor: ACTOR, reason }), "requeued", uuid);
    },
    async lose(uuid, attempt, reason) {
      return applied(await loseBundle(db, uuid, attempt, { actor: ACTOR, reason }), "lost", uuid);
    },
    async fail(uuid, reason) {
      return applied(await failStaged(db, uuid, { actor: ACTOR, reason }), "failed", uuid);
    },
  };
}
