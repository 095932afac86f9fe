/**
 * Check-ins waiting in a long poll (docs/workers.md), woken by a NOTIFY on WORKER_CHANNEL whose payload is their
 * worker's id. One LISTEN per server process, started by the first waiter, feeds a map of waiters by worker id;
 * a waiting check-in holds no database connection. Closing wakes every waiter (the server answers them before
 * it waits for open connections).
 */
import type { Logger } from "pino";
import type { Db } from "../../store/db.ts";
import { WORKER_CHANNEL } from "../../store/types.ts";
import { createKeyedWaiters, type KeyedWaiters, type KeyedWatch } from "../keyed-waiters.ts";

export type WorkerWatch = KeyedWatch;
export type WorkerWaiters = KeyedWaiters;

export function createWorkerWaiters(db: Db, logger: Pick<Logger, "warn">): WorkerWaiters {
  return createKeyedWaiters({
    db,
    channels: [WORKER_CHANNEL],
    keyOf: (payload) => payload,
    logger,
    listenFailed: "cannot listen for worker notifications; check-ins answer at their long poll's end",
  });
}
