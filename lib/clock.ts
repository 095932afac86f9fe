/** Time as the dispatcher sees it. Injected everywhere so tests drive it with FakeClock (test/fake-clock.ts). */
export interface Clock {
  /** Milliseconds since the epoch. */
  now(): number;
  /** Resolves after ms (rejects with the signal's reason if it aborts first). */
  sleep(ms: number, signal?: AbortSignal): Promise<void>;
}

export const systemClock: Clock = {
  now: () => Date.now(),
  sleep: (ms, signal) =>
    new Promise<void>((resolve, reject) => {
      if (signal?.aborted) {
        reject(signal.reason);
        return;
      }
      const onAbort = () => {
        clearTimeout(timer);
        reject(signal?.reason);
      };
      const timer = setTimeout(() => {
        signal?.removeEventListener("abort", onAbort);
        resolve();
      }, ms);
      signal?.addEventListener("abort", onAbort, { once: true });
    }),
};
