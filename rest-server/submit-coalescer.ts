/**
 * Group insert of single submissions (docs/performance.md, "bench:submit"). A bundle submitted alone costs
 * the database one statement, and most of that statement's cost is per statement, not per row. So while one
 * group's statement is in flight, the submissions that arrive wait for it and then go in together as one
 * multi-row statement (at most MAX_GROUP rows): at low load a submission is inserted at once, as before; under
 * load each statement carries many. Every request still gets its own bundle, and one NOTIFY covers a group.
 *
 * A group's statement that fails (a row the database refuses) is retried one bundle at a time, so a bad
 * submission fails only its own request. Used for bundles without dependencies that no quota applies to; the
 * others keep their own statement or transaction (rest-server/quotas.ts).
 */
import type { Db } from "../store/db.ts";
import { insertBundleRows } from "../store/queries.ts";
import type { Bundle, NewBundle } from "../store/types.ts";

/** Rows per group statement (about 0.5 MB of parameters at the largest allowed bundle). */
export const MAX_GROUP = 1000;

interface Pending {
  uuid: string;
  bundle: NewBundle;
  resolve(b: Bundle): void;
  reject(err: unknown): void;
}

export interface SubmitCoalescer {
  /** Inserts one submitted bundle (no dependencies, so it is inserted `staged`), grouped with the submissions around it. */
  insert(uuid: string, bundle: NewBundle): Promise<Bundle>;
  /** Statements run and bundles they carried, for tests and the bench. */
  stats(): { statements: number; bundles: number; largest: number };
}

export function createSubmitCoalescer(db: Db): SubmitCoalescer {
  let waiting: Pending[] = [];
  let inFlight = false;
  const counts = { statements: 0, bundles: 0, largest: 0 };

  async function run(group: Pending[]): Promise<void> {
    counts.statements++;
    counts.bundles += group.length;
    counts.largest = Math.max(counts.largest, group.length);
    try {
      const rows = await insertBundleRows(db, group, true, "submitted");
      const byUuid = new Map(rows.map((b) => [b.uuid, b]));
      for (const p of group) {
        const b = byUuid.get(p.uuid);
        if (b === undefined) p.reject(new Error(`bundle ${p.uuid} was not returned by its insert`));
        else p.resolve(b);
      }
    } catch (err) {
      if (group.length === 1) {
        group[0]!.reject(err);
        return;
      }
      // Which row was refused is not known: each on its own, so only that one fails.
      for (const p of group) await run([p]);
    }
  }

  async function drain(): Promise<void> {
    inFlight = true;
    try {
      while (waiting.length > 0) {
        const group = waiting.slice(0, MAX_GROUP);
        waiting = waiting.slice(group.length);
        await run(group);
      }
    } finally {
      inFlight = false;
    }
  }

  return {
    insert(uuid, bundle) {
      if (bundle.dependencies.length > 0) {
        return Promise.reject(new Error("the submit coalescer takes bundles without dependencies"));
      }
      return new Promise<Bundle>((resolve, reject) => {
        waiting.push({ uuid, bundle, resolve, reject });
        if (!inFlight) void drain();
      });
    },
    stats: () => ({ ...counts }),
  };
}
