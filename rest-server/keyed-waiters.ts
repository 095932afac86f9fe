/**
 * Requests waiting for a NOTIFY about one key (a bundle's log followers, a worker's long-polled check-in). One
 * LISTEN per channel per server process, started by the first waiter, feeds a map of waiters by key; a waiting
 * request holds no database connection. Closing wakes every waiter for good (the server answers them before it
 * waits for open connections) and stops listening.
 */
import type { Db } from "../store/db.ts";

/** One request's interest in a key, registered before it reads the state (so no NOTIFY from then on is missed). */
export interface KeyedWatch {
  /** Resolves on a NOTIFY for the key (also one that came since watch()), after timeoutMs, on abort or close. */
  wait(timeoutMs: number, signal: AbortSignal): Promise<void>;
  cancel(): void;
}

export interface KeyedWaiters {
  watch(key: string): Promise<KeyedWatch>;
  /** How many watches are registered now. */
  readonly size: number;
  readonly closed: boolean;
  close(): Promise<void>;
}

export interface KeyedWaitersOptions {
  db: Db;
  channels: readonly string[];
  /** The key a payload wakes. */
  keyOf(payload: string): string;
  logger: { warn(obj: object, msg: string): void };
  /** Logged when LISTEN fails: what waiters do instead. */
  listenFailed: string;
}

export function createKeyedWaiters(opts: KeyedWaitersOptions): KeyedWaiters {
  const { db, keyOf } = opts;
  const waiters = new Map<string, Set<() => void>>();
  let listening: Promise<(() => Promise<void>)[]> | null = null;
  let closed = false;
  let size = 0;

  const wake = (payload: string) => {
    for (const fn of [...(waiters.get(keyOf(payload)) ?? [])]) fn();
  };
  const listen = () => {
    listening ??= Promise.all(opts.channels.map((c) => db.listen(c, wake))).catch((err: unknown) => {
      listening = null;
      opts.logger.warn({ err }, opts.listenFailed);
      return [];
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
    async watch(key) {
      if (!closed) await listen();
      let fired = false;
      let onFire: (() => void) | null = null;
      const fire = () => {
        fired = true;
        onFire?.();
      };
      let set = waiters.get(key);
      if (set === undefined) {
        set = new Set();
        waiters.set(key, set);
      }
      set.add(fire);
      size++;
      let cancelled = false;
      const cancel = () => {
        if (cancelled) return;
        cancelled = true;
        size--;
        const s = waiters.get(key);
        if (s?.delete(fire) && s.size === 0) waiters.delete(key);
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
      const unlisten = await (listening ?? Promise.resolve([]));
      listening = null;
      await Promise.all(unlisten.map((u) => u().catch(() => {})));
    },
  };
}
