import type { Clock } from "../lib/clock.ts";

interface Sleeper {
  at: number;
  seq: number;
  resolve: () => void;
}

/**
 * A Clock that moves only when a test says so. `advance(ms)` wakes every sleeper due in that span in time
 * order, letting the promise chains they start run (and schedule further sleeps) before moving on.
 */
export class FakeClock implements Clock {
  private t: number;
  private seq = 0;
  /** A Set: a sleep aborted or woken leaves in O(1) (benches hold thousands of sleepers). */
  private sleepers = new Set<Sleeper>();

  constructor(start = Date.UTC(2026, 0, 1)) {
    this.t = start;
  }

  now(): number {
    return this.t;
  }

  sleep(ms: number, signal?: AbortSignal): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      if (signal?.aborted) {
        reject(signal.reason);
        return;
      }
      const onAbort = () => {
        this.sleepers.delete(sleeper);
        reject(signal?.reason);
      };
      // Like systemClock: a sleep that ends removes its abort listener (loops sleep on one signal for ever).
      const sleeper: Sleeper = {
        at: this.t + Math.max(0, ms),
        seq: this.seq++,
        resolve: () => {
          signal?.removeEventListener("abort", onAbort);
          resolve();
        },
      };
      this.sleepers.add(sleeper);
      signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  /** Number of pending sleeps (a test can wait for a component to reach its next sleep). */
  get pending(): number {
    return this.sleepers.size;
  }

  async advance(ms: number): Promise<void> {
    const end = this.t + ms;
    for (;;) {
      await flushMicrotasks();
      // The earliest due, in time order and then in the order the sleeps began.
      let due: Sleeper | undefined;
      for (const s of this.sleepers) {
        if (s.at <= end && (due === undefined || s.at < due.at || (s.at === due.at && s.seq < due.seq)))
          due = s;
      }
      if (due === undefined) break;
      this.sleepers.delete(due);
      this.t = Math.max(this.t, due.at);
      due.resolve();
    }
    this.t = end;
    await flushMicrotasks();
  }
}

/** Lets already-resolved promise chains run to their next real wait. */
export async function flushMicrotasks(rounds = 20): Promise<void> {
  for (let i = 0; i < rounds; i++) await new Promise<void>((r) => setImmediate(r));
}
