/**
 * Limits shared by many callers, on the injected Clock: how many may hold a slot at once (ConcurrencyLimit), and
 * how many may start per second (RateLimit). The pool uses them for probes, the SSH executor for new connections.
 */
import type { Clock } from "./clock.ts";

export interface Permit {
  /** Gives the slot back (idempotent). */
  release(): void;
}

const NO_PERMIT: Permit = { release() {} };

interface Holder {
  at: number;
  counted: boolean;
}

/**
 * At most `max` holders at once (0 = no limit), first come first served. A holder that keeps its slot longer than
 * `countForMs` stops counting (its work goes on, its slot goes to the next waiter): what the limit protects is the
 * work of starting things (CPU, bursts of buffers), and something that only waits, a hung instance, must not hold
 * everyone else up.
 */
export class ConcurrencyLimit {
  private readonly holders = new Set<Holder>();
  private readonly waiters: Array<{ resolve: (p: Permit) => void; reject: (err: unknown) => void }> = [];
  private counted = 0;
  private timer: AbortController | null = null;
  /** The most holders ever counted at once, and how many stopped counting for being slow. */
  peak = 0;
  slow = 0;

  constructor(private readonly opts: { max: number; countForMs: number; clock: Clock }) {}

  /** Holders that count against the limit now. */
  get active(): number {
    return this.counted;
  }

  /** Callers waiting for a slot. */
  get waiting(): number {
    return this.waiters.length;
  }

  /** Resolves with a slot; rejects with the signal's reason if it aborts while waiting. */
  acquire(signal?: AbortSignal): Promise<Permit> {
    if (signal?.aborted) return Promise.reject(signal.reason);
    if (this.opts.max <= 0) return Promise.resolve(NO_PERMIT);
    if (this.counted < this.opts.max && this.waiters.length === 0) return Promise.resolve(this.grant());
    return new Promise<Permit>((resolve, reject) => {
      const waiter = {
        resolve: (p: Permit) => {
          signal?.removeEventListener("abort", onAbort);
          resolve(p);
        },
        reject,
      };
      const onAbort = () => {
        const i = this.waiters.indexOf(waiter);
        if (i >= 0) this.waiters.splice(i, 1);
        reject(signal?.reason);
      };
      signal?.addEventListener("abort", onAbort, { once: true });
      this.waiters.push(waiter);
      this.armTimer();
    });
  }

  private grant(): Permit {
    const holder: Holder = { at: this.opts.clock.now(), counted: true };
    this.holders.add(holder);
    this.counted++;
    this.peak = Math.max(this.peak, this.counted);
    let released = false;
    return {
      release: () => {
        if (released) return;
        released = true;
        this.holders.delete(holder);
        this.uncount(holder);
        this.drain();
      },
    };
  }

  private uncount(holder: Holder): void {
    if (!holder.counted) return;
    holder.counted = false;
    this.counted--;
  }

  /** Hands free slots to waiters, oldest first. */
  private drain(): void {
    while (this.waiters.length > 0 && this.counted < this.opts.max) {
      this.waiters.shift()?.resolve(this.grant());
    }
    if (this.waiters.length === 0) {
      this.timer?.abort();
      this.timer = null;
    } else this.armTimer();
  }

  /** While callers wait, one timer for the moment the oldest counted holder becomes slow. */
  private armTimer(): void {
    if (this.timer !== null || !Number.isFinite(this.opts.countForMs)) return;
    let oldest: Holder | undefined;
    for (const h of this.holders) {
      if (h.counted) {
        oldest = h;
        break;
      }
    }
    if (oldest === undefined) return;
    const timer = new AbortController();
    this.timer = timer;
    const { clock, countForMs } = this.opts;
    clock.sleep(Math.max(0, oldest.at + countForMs - clock.now()), timer.signal).then(
      () => {
        if (this.timer !== timer) return;
        this.timer = null;
        const now = clock.now();
        for (const h of this.holders) {
          if (h.counted && now - h.at >= countForMs) {
            this.uncount(h);
            this.slow++;
          }
        }
        this.drain();
      },
      () => {},
    );
  }
}

/**
 * At most `perSecond` starts per second (0 = no limit), with bursts of up to one second's worth, first come first
 * served: each caller reserves the next free moment and sleeps until it.
 */
export class RateLimit {
  private readonly interval: number;
  private readonly burst: number;
  /** The moment the next start is due if nobody had waited (GCRA's theoretical arrival time). */
  private tat = Number.NEGATIVE_INFINITY;

  constructor(
    perSecond: number,
    private readonly clock: Clock,
  ) {
    this.interval = perSecond > 0 ? 1000 / perSecond : 0;
    this.burst = perSecond > 0 ? (Math.max(1, perSecond) - 1) * this.interval : 0;
  }

  /** Resolves when the caller may start; rejects with the signal's reason if it aborts first. */
  async take(signal?: AbortSignal): Promise<void> {
    if (signal?.aborted) throw signal.reason;
    if (this.interval === 0) return;
    const now = this.clock.now();
    this.tat = Math.max(this.tat, now);
    const at = this.tat - this.burst;
    this.tat += this.interval;
    if (at > now) await this.clock.sleep(at - now, signal);
  }
}
