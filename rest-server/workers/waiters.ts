/**
 * Check-ins waiting in a long poll (docs/workers.md), woken by a NOTIFY on WORKER_CHANNEL whose payload is their
 * worker's id. One LISTEN per server process, started by the first waiter, feeds a map of waiters by worker id;
 * a waiting check-in holds no database connection. Closing wakes every waiter (the server answers them before
 * it waits for open connections).
 */
import type { Logger } from "pino";
import type { Db } from "../../store/db.ts";
import { WORKER_CHANNEL } from "../../store/types.ts";

/** One check-in's interest in its worker, registered before it reads what to send (so no NOTIFY is missed). */
export interface WorkerWatch {
  /** Resolves on a NOTIFY for the worker (also one that came since watch()), after timeoutMs, on abort or close. */
  wait(timeoutMs: number, signal: AbortSignal): Promise<void>;
  cancel(): void;
}

export interface WorkerWaiters {
  watch(workerId: string): Promise<WorkerWatch>;
  /** How many check-ins are registered now (tests, metrics). */
  readonly size: number;
  readonly closed: boolean;
  /** Wakes every waiter for good and stops listening. */
  close(): Promise<void>;
}

export function createWorkerWaiters(db: Db, logger: Pick<Logger, "warn">): WorkerWaiters {
  const waiters = new Map<string, Set<() => void>>();
  let listening: Promise<(() => Promise<void>) | null> | null = null;
  let closed = false;
  let size = 0;

  const wake = (payload: string) => {
    for (const fn of [...(waiters.get(payload) ?? [])]) fn();
  };
  const listen = () => {
    listening ??= db.listen(WORKER_CHANNEL, wake).catch((err: unknown) => {
      listening = null;
      logger.warn(
        { err },
        "cannot listen for worker notifications; check-ins answer at their long poll's end",
      );
      return null;
    });
    return listening;
  };

  return {
    get size() {
      return size;
    },
    get closed() {
      return closed;
    },
    async watch(workerId) {
      if (!closed) await listen();
      let fired = false;
      let onFire: (() => void) | null = null;
      const fire = () => {
        fired = true;
        onFire?.();
      };
      let set = waiters.get(workerId);
      if (set === undefined) {
        set = new Set();
        waiters.set(workerId, set);
      }
      set.add(fire);
      size++;
      let cancelled = false;
      const cancel = () => {
        if (cancelled) return;
        cancelled = true;
        size--;
        const s = waiters.get(workerId);
        if (s?.delete(fire) && s.size === 0) waiters.delete(workerId);
      };
      return {
        cancel,
        wait(timeoutMs, signal) {
          if (fired || closed || signal.aborted) return Promise.resolve();
          return new Promise<void>((resolve) => {
            const done = () => {
              clearTimeout(timer);
              signal.removeEventListener("abort", done);
              onFire = null;
              resolve();
            };
            const timer = setTimeout(done, timeoutMs);
            signal.addEventListener("abort", done, { once: true });
            onFire = done;
          });
        },
      };
    },
    async close() {
      closed = true;
      for (const set of waiters.values()) for (const fn of [...set]) fn();
      const unlisten = await (listening ?? Promise.resolve(null));
      listening = null;
      await unlisten?.().catch(() => {});
    },
  };
}
