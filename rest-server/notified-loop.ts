/**
 * The loop of the REST server's managers (bundle manager, pipeline manager): a pass runs when a NOTIFY on the
 * channel passes the filter, and every pollInterval as a fallback (notifications can be lost). One pass at a
 * time; a pass requested while one runs runs once more after it, however many requests came.
 */
import type { Logger } from "../lib/logger.ts";
import type { Db } from "../store/db.ts";

export interface NotifiedLoopOptions {
  db: Pick<Db, "listen">;
  channel: string;
  /** Whether a notification's payload calls for a pass. */
  filter: (payload: string) => boolean;
  /** Fallback pass interval in ms when no notification arrives. */
  pollInterval: number;
  /** One pass; a throw is logged and the loop goes on. */
  pass: () => Promise<unknown>;
  log: Logger;
  /** Names the loop in the error logged when a pass throws (`<name> pass failed`). */
  name: string;
}

export interface NotifiedLoop {
  /** Listens, starts the poll timer and runs a first pass (catching up with what happened before). */
  start(): Promise<void>;
  /** Stops listening and polling; resolves once a running pass has ended. */
  stop(): Promise<void>;
}

/** The longest rest between two passes under a stream of notifications. */
const MAX_REST_MS = 100;

export function notifiedLoop(opts: NotifiedLoopOptions): NotifiedLoop {
  const { db, log } = opts;
  let timer: NodeJS.Timeout | undefined;
  let unlisten: (() => unknown) | undefined;
  let running: Promise<void> | undefined;
  let again = false;
  let stopped = true;

  function trigger(): void {
    if (stopped) return;
    if (running !== undefined) {
      again = true;
      return;
    }
    running = (async () => {
      for (;;) {
        again = false;
        const t0 = performance.now();
        try {
          await opts.pass();
        } catch (err) {
          log.error({ err }, `${opts.name} pass failed`);
        }
        if (!again || stopped) break;
        // Woken while it ran: under a stream of submissions, rest as long as the pass took (at most 0.1 s)
        // so the passes take at most half the database's time and each does more at once. On PGlite, whose
        // one connection also serves every request, a pass per submission cost more than the submission.
        await new Promise((r) => setTimeout(r, Math.min(MAX_REST_MS, performance.now() - t0)));
      }
    })().finally(() => {
      running = undefined;
    });
  }

  return {
    async start() {
      if (!stopped) return;
      stopped = false;
      unlisten = await db.listen(opts.channel, (payload: string) => {
        if (opts.filter(payload)) trigger();
      });
      timer = setInterval(trigger, opts.pollInterval);
      timer.unref();
      trigger();
    },
    async stop() {
      stopped = true;
      if (timer !== undefined) clearInterval(timer);
      timer = undefined;
      await unlisten?.();
      unlisten = undefined;
      await running;
    },
  };
}
