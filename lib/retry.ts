/**
 * Retrying with exponential backoff inside a time budget, for clients whose failures are sometimes transient
 * (the runner API, the content-addressed store). The caller says which errors are worth another try.
 */

/** Waits `ms`, or rejects with the signal's reason as soon as it aborts. */
export const abortableSleep = (ms: number, signal?: AbortSignal): Promise<void> =>
  new Promise<void>((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const t = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(t);
      reject(signal?.reason);
    };
    signal?.addEventListener("abort", onAbort, { once: true });
  });

export interface BackoffOptions {
  /** How long the tries may go on; a retry that would start after it is not made (the last error is thrown). */
  budgetMs: number;
  /** Which errors are worth another try. */
  isTransient: (err: unknown) => boolean;
  signal?: AbortSignal;
  sleep?: (ms: number, signal?: AbortSignal) => Promise<void>;
  onRetry?: (err: unknown, delayMs: number) => void;
}

/** First delay between tries, and the most it doubles to. */
const FIRST_DELAY_MS = 200;
const MAX_DELAY_MS = 5000;

/** Runs fn (given the try's number, from 0) until it succeeds, fails for good, or the budget is spent. */
export async function retryWithBackoff<T>(
  fn: (attempt: number) => Promise<T>,
  opts: BackoffOptions,
): Promise<T> {
  const sleep = opts.sleep ?? abortableSleep;
  const deadline = Date.now() + opts.budgetMs;
  let delay = FIRST_DELAY_MS;
  for (let attempt = 0; ; attempt++) {
    try {
      return await fn(attempt);
    } catch (err) {
      if (opts.signal?.aborted || !opts.isTransient(err) || Date.now() + delay > deadline) throw err;
      opts.onRetry?.(err, delay);
      await sleep(delay, opts.signal);
      delay = Math.min(delay * 2, MAX_DELAY_MS);
    }
  }
}
