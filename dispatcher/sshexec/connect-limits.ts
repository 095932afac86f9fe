/**
 * Connection set-up limits shared by all SSH executors of one dispatcher: a handshake and key exchange cost far
 * more than a command on an open connection, so they are paced apart from probes (issue 21).
 */
import type { Clock } from "../../lib/clock.ts";
import { ConcurrencyLimit, type Permit, RateLimit } from "../../lib/limits.ts";

/**
 * Connection set-up limits shared by many executors: at most `maxPerSecond` connect attempts start per second
 * and at most `maxConcurrent` are under way at once (one slower than CONNECT_COUNTS_FOR_MS stops counting, so an
 * unreachable instance never holds up the others); 0 = no limit.
 */
export interface ConnectLimits {
  /** Waits for a connect attempt's turn; release the permit when the attempt has ended either way. */
  acquire(signal: AbortSignal): Promise<Permit>;
  stats(): { connecting: number; waiting: number; peak: number; slow: number };
}

/** How long one connect attempt counts against maxConcurrent; past it, it goes on without a slot. */
export const CONNECT_COUNTS_FOR_MS = 5000;

export function createConnectLimits(opts: {
  maxPerSecond: number;
  maxConcurrent: number;
  clock: Clock;
}): ConnectLimits {
  const rate = new RateLimit(opts.maxPerSecond, opts.clock);
  const slots = new ConcurrencyLimit({
    max: opts.maxConcurrent,
    countForMs: CONNECT_COUNTS_FOR_MS,
    clock: opts.clock,
  });
  return {
    async acquire(signal) {
      const permit = await slots.acquire(signal);
      try {
        await rate.take(signal);
      } catch (err) {
        permit.release();
        throw err;
      }
      return permit;
    },
    stats: () => ({ connecting: slots.active, waiting: slots.waiting, peak: slots.peak, slow: slots.slow }),
  };
}
