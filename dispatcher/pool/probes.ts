/**
 * When each worker is probed (dispatcher/README.md "Instance states"): every probeInterval (+ up to 10 % jitter,
 * so probes spread out) per worker, one at a time per worker; and at once when asked (probeNow: at most once a
 * second per worker, repeated while the worker still lists a runner whose bundle is staged again, for up to a
 * minute). Every due probe starts at once, unless the operator capped them with maxProbesPerSecond (a token
 * bucket); what bounds the work is maxConcurrentProbes, a pool-wide limit on probes running on open connections
 * (the worker takes a slot once its connection is up, so probes never wait behind SSH handshakes, which the
 * executor paces on its own). A probe counts for at most PROBE_COUNTS_FOR_MS: a hung instance keeps its probe
 * (until the command's timeout) but not its slot. The probe itself is the worker's.
 */
import type { Config } from "../../config/schema.ts";
import type { Clock } from "../../lib/clock.ts";
import { ConcurrencyLimit } from "../../lib/limits.ts";
import type { Worker } from "./worker.ts";

/** How long one probe counts against maxConcurrentProbes; past it, it runs on without a slot. */
export const PROBE_COUNTS_FOR_MS = 5000;

/** probeNow: at most one immediate probe per worker per this long, repeated for at most IMMEDIATE_WINDOW_MS. */
export const IMMEDIATE_PROBE_MS = 1000;
const IMMEDIATE_WINDOW_MS = 60_000;

/** Per-worker probe bookkeeping. */
interface ProbeState {
  probing: boolean;
  nextAt: number;
  /** An immediate probe was asked for (probeNow) and has not started yet. */
  wanted: boolean;
  /** When the last immediate probe started, and when the current run of them was first asked for. */
  immediateAt: number;
  immediateSince: number | null;
}

export interface ProbeScheduler {
  /** Starts the probes that are due (and allowed by the rate); returns them. */
  startDue(workers: Iterable<Worker>): Promise<void>[];
  /** An immediate probe of `w` (rate-limited per worker, repeated while a requeued runner is listed). */
  probeNow(w: Worker): void;
  /** A worker's scheduling state, for the pool's views. */
  probing(w: Worker): boolean;
}

export function createProbeScheduler(opts: {
  config: Config;
  clock: Clock;
  /** Runs the pool's bookkeeping for a probe it starts (tracked, logged). */
  track(p: Promise<void>, w: Worker): void;
}): ProbeScheduler {
  const { clock } = opts;
  const cloud = opts.config.cloud;
  const states = new WeakMap<Worker, ProbeState>();
  const wanted = new Set<Worker>();
  let tokens = cloud.maxProbesPerSecond;
  let tokensAt = clock.now();
  const slots = new ConcurrencyLimit({
    max: cloud.maxConcurrentProbes,
    countForMs: PROBE_COUNTS_FOR_MS,
    clock,
  });

  const stateOf = (w: Worker): ProbeState => {
    let s = states.get(w);
    if (s === undefined) {
      s = {
        probing: false,
        nextAt: 0,
        wanted: false,
        immediateAt: Number.NEGATIVE_INFINITY,
        immediateSince: null,
      };
      states.set(w, s);
    }
    return s;
  };

  /** A deterministic share (0-10 %) of probeInterval, so workers' probes spread out. */
  function jitter(id: string): number {
    let h = 0x811c9dc5;
    for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 0x01000193) >>> 0;
    return Math.floor((h / 2 ** 32) * 0.1 * cloud.probeInterval);
  }

  function takeToken(now: number): boolean {
    const rate = cloud.maxProbesPerSecond;
    if (rate <= 0) return true;
    tokens = Math.min(rate, tokens + ((now - tokensAt) * rate) / 1000);
    tokensAt = now;
    if (tokens < 1) return false;
    tokens -= 1;
    return true;
  }

  /** Starts the immediate probe of `w` if one is wanted and allowed now; true when it started. */
  function startWanted(w: Worker, now: number): boolean {
    const s = stateOf(w);
    if (w.gone || w.placeholder) {
      wanted.delete(w);
      s.wanted = false;
      return false;
    }
    if (!s.wanted || s.probing || now - s.immediateAt < IMMEDIATE_PROBE_MS) return false;
    wanted.delete(w);
    s.wanted = false;
    s.immediateAt = now;
    void probe(w, now);
    return true;
  }

  /** After an immediate probe: another one while a requeued runner is still listed (within the window). */
  function rewant(w: Worker): void {
    const s = stateOf(w);
    if (s.immediateSince === null) return;
    const now = clock.now();
    if (!w.gone && w.requeuedButListed() && now - s.immediateSince < IMMEDIATE_WINDOW_MS) {
      s.wanted = true;
      wanted.add(w);
    } else if (!s.wanted) {
      s.immediateSince = null;
    }
  }

  function probe(w: Worker, now: number): Promise<void> {
    const s = stateOf(w);
    s.probing = true;
    s.nextAt = now + cloud.probeInterval + jitter(w.id);
    const run = w.probe(slots).finally(() => {
      s.probing = false;
      rewant(w);
      // Asked for while this probe ran (its --list may predate the requeue): the next one now, if allowed.
      if (s.wanted) startWanted(w, clock.now());
    });
    opts.track(run, w);
    return run;
  }

  return {
    startDue(workers) {
      const now = clock.now();
      const started: Promise<void>[] = [];
      for (const w of [...wanted]) startWanted(w, now);
      for (const w of workers) {
        if (w.placeholder || w.state === "shutdown") continue;
        const s = stateOf(w);
        if (s.probing || now < s.nextAt) continue;
        if (!takeToken(now)) break;
        started.push(probe(w, now));
      }
      return started;
    },
    probeNow(w) {
      if (w.placeholder || w.state === "shutdown") return;
      const now = clock.now();
      const s = stateOf(w);
      s.immediateSince ??= now;
      s.wanted = true;
      wanted.add(w);
      startWanted(w, now);
    },
    probing: (w) => stateOf(w).probing,
  };
}
