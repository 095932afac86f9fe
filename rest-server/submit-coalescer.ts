/**
 * Group insert of single submissions (docs/performance.md, "bench:submit"). A bundle submitted alone costs
 * the database one statement, and most of that statement's cost is per statement, not per row. So while one
 * group's statement is in flight, the submissions that arrive wait for it and then go in together as one
 * multi-row statement (at most MAX_GROUP rows; lib/group-calls.ts): at low load a submission is inserted at once,
 * as before; under load each statement carries many. Every request still gets its own bundle, and one NOTIFY
 * covers a group. The submissions read in one round of the event loop's I/O go together too (`gather: "io"`):
 * PGlite's statements run in this thread, so on PGlite nothing arrives while one is in flight.
 *
 * A group's statement that fails (a row the database refuses) is retried one bundle at a time, so a bad
 * submission fails only its own request. Used for bundles without dependencies that no quota applies to; the
 * others keep their own statement or transaction (rest-server/quotas.ts).
 */

import { groupCalls } from "../lib/group-calls.ts";
import type { Db } from "../store/db.ts";
import { inOrder, insertBundleRows } from "../store/queries.ts";
import type { Bundle, NewBundle } from "../store/types.ts";

/** Rows per group statement (about 0.5 MB of parameters at the largest allowed bundle). */
export const MAX_GROUP = 1000;

export interface SubmitCoalescer {
  /** Inserts one submitted bundle (no dependencies, so it is inserted `staged`), grouped with the submissions around it. */
  insert(uuid: string, bundle: NewBundle): Promise<Bundle>;
  /** Statements run and bundles they carried, for tests and the bench. */
  stats(): { statements: number; bundles: number; largest: number };
}

export function createSubmitCoalescer(db: Db): SubmitCoalescer {
  const groups = groupCalls<{ uuid: string; bundle: NewBundle }, Bundle>({
    max: MAX_GROUP,
    // The submissions read in one round of the event loop go together, also on PGlite (lib/group-calls.ts).
    gather: "io",
    run: async (items) => inOrder(items, await insertBundleRows(db, items, true, "submitted")),
  });
  return {
    insert(uuid, bundle) {
      if (bundle.dependencies.length > 0) {
        return Promise.reject(new Error("the submit coalescer takes bundles without dependencies"));
      }
      return groups.call({ uuid, bundle });
    },
    stats: () => {
      const s = groups.stats();
      return { statements: s.groups, bundles: s.items, largest: s.largest };
    },
  };
}
