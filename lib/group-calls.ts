/**
 * Calls that arrive together go to the database as one statement (docs/performance.md): most of a small
 * statement's cost is per statement, not per row. Calls made in the same turn of the event loop, and those that
 * arrive while a group's statement is in flight (while `concurrency` groups are), form the next group (at most
 * `max` items); a lone call waits only for a microtask (or, with `gather: "io"`, for the end of the event loop's
 * round of I/O callbacks). Each caller still gets its own result. A group whose
 * statement throws is run again one item at a time, so a bad item fails only its own call.
 */

export interface GroupCalls<I, R> {
  /** One call: resolves with this item's result from its group's run. */
  call(item: I): Promise<R>;
  /** Groups run and items they carried, for tests and the benches. */
  stats(): { groups: number; items: number; largest: number };
}

interface Pending<I, R> {
  item: I;
  resolve(r: R): void;
  reject(err: unknown): void;
}

export function groupCalls<I, R>(opts: {
  max: number;
  /**
   * Groups in flight at once (default 1). With 2, calls that arrive while one group is in flight go at once as
   * a second group instead of waiting for the first: two bursts a few ms apart (two instances' starts) do not
   * queue behind each other, and calls wait only while both are in flight.
   */
  concurrency?: number;
  /**
   * When a group starts with nothing in flight: "turn" (the default) once this turn's microtasks have run, so it
   * holds the calls made in this turn; "io" once the event loop's current round of I/O callbacks is done
   * (setImmediate), so it also holds the calls of the other requests that arrived in that round. "io" is for
   * calls made from HTTP requests to a database that runs in this thread (PGlite): its statement never leaves the
   * thread, so no request is read while one is in flight, and with "turn" each request would go alone.
   */
  gather?: "turn" | "io";
  /** Runs one group; returns one result per item, in the items' order. */
  run(items: I[]): Promise<R[]>;
}): GroupCalls<I, R> {
  const concurrency = Math.max(1, opts.concurrency ?? 1);
  const gatherIo = opts.gather === "io";
  let waiting: Pending<I, R>[] = [];
  /** Groups in flight, and whether a start of the next is already due (at the end of this turn, or round with "io"). */
  let inFlight = 0;
  let due = false;
  const counts = { groups: 0, items: 0, largest: 0 };

  async function runGroup(group: Pending<I, R>[]): Promise<void> {
    counts.groups++;
    counts.items += group.length;
    counts.largest = Math.max(counts.largest, group.length);
    let results: R[];
    try {
      results = await opts.run(group.map((p) => p.item));
      if (results.length !== group.length) {
        throw new Error(`a group of ${group.length} gave ${results.length} results`);
      }
    } catch (err) {
      if (group.length === 1) {
        group[0]!.reject(err);
        return;
      }
      // Which item the statement refused is not known: each on its own, so only that one fails.
      for (const p of group) await runGroup([p]);
      return;
    }
    for (const [i, p] of group.entries()) p.resolve(results[i]!);
  }

  /** Starts groups of the waiting calls while fewer than `concurrency` are in flight. */
  function pump(): void {
    while (inFlight < concurrency && waiting.length > 0) {
      const group = waiting.slice(0, opts.max);
      waiting = waiting.slice(group.length);
      inFlight++;
      void runGroup(group).finally(() => {
        inFlight--;
        pump();
      });
    }
  }

  return {
    call(item) {
      return new Promise<R>((resolve, reject) => {
        waiting.push({ item, resolve, reject });
        if (due || inFlight >= concurrency) return;
        due = true;
        const start = () => {
          due = false;
          pump();
        };
        if (gatherIo) setImmediate(start);
        else queueMicrotask(start);
      });
    },
    stats: () => ({ ...counts }),
  };
}
