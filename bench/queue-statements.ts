/**
 * bench:queue-statements — the statements that change bundles found by key (the scheduler's claims, the runners'
 * grouped `start` calls, the bundle manager's staging, one bundle's transition, the scheduler's statuses, a runner's
 * heartbeat and log chunk by its token) when the queue grew faster than the table's statistics: a history of
 * --history ended bundles is analyzed, then --queue bundles are submitted (a large batch, or a pipeline's stage
 * becoming ready) and, with autovacuum kept off the table, no ANALYZE follows. Each statement's median time over
 * --rounds rounds is printed so, then again after an ANALYZE. A statement whose plan depends on how many bundles the
 * statistics say are queued reads the whole queue in the first case (store/transitions.ts, KEYED_LOCKS); one that
 * finds its rows by key takes the same time in both.
 *
 * Usage: npm run bench:queue-statements [-- --db pg,pglite] [--history N] [--queue N] [--rounds R]
 * PostgreSQL: DISPATCH_CLOUD_TEST_PG_URL (scripts/test-services.sh starts one and prints it).
 */
import { randomBytes } from "node:crypto";
import { availableParallelism, cpus } from "node:os";
import type { Db } from "../store/db.ts";
import { appendLogChunkByToken, recordHeartbeatByToken, setSchedulingStatuses } from "../store/queries.ts";
import { markRunningByTokens, stageBundle, stageBundles, startBundles } from "../store/transitions.ts";
import { createTestUser, insertTestBundles, openTestDb } from "../test/db.ts";
import { benchArgs } from "./args.ts";

const USAGE =
  "Usage: npm run bench:queue-statements [-- --db pg,pglite] [--history N] [--queue N] [--rounds R]";
const { values } = benchArgs(USAGE, {
  options: {
    db: { type: "string", default: "pg,pglite" },
    history: { type: "string", default: "100000" },
    queue: { type: "string", default: "20000" },
    rounds: { type: "string", default: "30" },
  },
});
const HISTORY = Number(values.history);
const QUEUE = Number(values.queue);
const ROUNDS = Number(values.rounds);
/** Bundles per claim and per staging (a scheduling pass's, a bundle manager page's), per `start` call. */
const GROUP = 20;
const STARTS = 10;
const STATUSES = 250;
const kinds = values.db.split(",");
for (const k of kinds)
  if (k !== "pg" && k !== "pglite") throw new Error(`--db: ${k} is neither pg nor pglite`);
// Each round claims GROUP staged bundles and writes STATUSES others' statuses; two passes of ROUNDS rounds.
if (
  ![HISTORY, QUEUE, ROUNDS].every((n) => Number.isInteger(n) && n > 0) ||
  QUEUE < 2 * ROUNDS * (GROUP + STATUSES)
)
  throw new Error(
    `--history, --queue and --rounds are positive integers, --queue >= ${2 * (GROUP + STATUSES)} x --rounds`,
  );

const progress = (msg: string) => process.stderr.write(`${msg}\n`);
const p50 = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)] ?? Number.NaN;

interface Times {
  claim: number[];
  start: number[];
  stage: number[];
  stageOne: number[];
  statuses: number[];
  heartbeat: number[];
  logChunk: number[];
}

async function timed(into: number[], fn: () => Promise<unknown>): Promise<void> {
  const t0 = performance.now();
  await fn();
  into.push(performance.now() - t0);
}

/** ROUNDS rounds, each on bundles of its own (taken from the front of `staged` and `created`). */
async function rounds(db: Db, staged: string[], created: string[]): Promise<Times> {
  const t: Times = {
    claim: [],
    start: [],
    stage: [],
    stageOne: [],
    statuses: [],
    heartbeat: [],
    logChunk: [],
  };
  for (let r = 0; r < ROUNDS; r++) {
    const claim = staged.splice(0, GROUP);
    const queued = staged.splice(0, STATUSES);
    const toStage = created.splice(0, GROUP + 1);
    const tokens = claim.map(() => randomBytes(32).toString("hex"));
    const items = claim.map((uuid, i) => ({
      uuid,
      instanceId: `i-${i % 2}`,
      instanceType: "bench",
      runnerTokenHash: tokens[i] as string,
      gpuDevices: [],
    }));
    const moved: number[] = [];
    await timed(t.claim, async () => moved.push((await startBundles(db, items, "bench")).size));
    await timed(t.start, async () =>
      moved.push((await markRunningByTokens(db, tokens.slice(0, STARTS), "bench")).size),
    );
    const stageItems = toStage.slice(1).map((uuid) => ({ uuid, reason: null }));
    await timed(t.stage, async () => moved.push((await stageBundles(db, stageItems, "bench")).length));
    await timed(t.stageOne, async () =>
      moved.push((await stageBundle(db, toStage[0] as string, { actor: "bench" })).ok ? 1 : 0),
    );
    await timed(t.statuses, async () =>
      moved.push(
        await setSchedulingStatuses(
          db,
          queued,
          queued.map(() => `waiting (round ${r})`),
        ),
      ),
    );
    const token = tokens[0] as string;
    await timed(t.heartbeat, async () =>
      moved.push((await recordHeartbeatByToken(db, token, { cpu: 1 })) === "running" ? 1 : 0),
    );
    const chunk = { tokenHash: token, stream: "stdout" as const, offset: 0, data: Buffer.from("hello\n") };
    await timed(t.logChunk, async () =>
      moved.push((await appendLogChunkByToken(db, chunk))?.result.ok ? 1 : 0),
    );
    const want = [GROUP, STARTS, GROUP, 1, STATUSES, 1, 1];
    if (moved.some((m, i) => m !== want[i]))
      throw new Error(`round ${r}: moved ${moved.join(", ")}, expected ${want.join(", ")}`);
  }
  return t;
}

function report(label: string, t: Times): void {
  const f = (xs: number[]) => `${p50(xs).toFixed(2)} ms`;
  console.log(
    `  ${label}: claim of ${GROUP} ${f(t.claim)}, start of ${STARTS} ${f(t.start)}, staging of ${GROUP} ${f(t.stage)}, staging of 1 ${f(t.stageOne)}, statuses of ${STATUSES} ${f(t.statuses)}, heartbeat ${f(t.heartbeat)}, log chunk ${f(t.logChunk)}`,
  );
}

console.log(
  `bench:queue-statements on ${availableParallelism()} CPUs (${cpus()[0]?.model ?? "?"}): a history of ${HISTORY} ended bundles analyzed, then ${QUEUE} queued; medians of ${ROUNDS} rounds`,
);
for (const kind of kinds as ("pg" | "pglite")[]) {
  const db = await openTestDb(kind);
  try {
    const t0 = performance.now();
    await db.query("ALTER TABLE bundles SET (autovacuum_enabled = false)");
    const owner = (await createTestUser(db)).uuid;
    progress(`bench:queue-statements [${kind}]: ${HISTORY} bundles of history...`);
    await insertTestBundles(db, owner, HISTORY, "submitted");
    await db.query("UPDATE bundles SET state = 'ready'");
    await db.query(kind === "pg" ? "VACUUM ANALYZE bundles" : "ANALYZE bundles");
    progress(`bench:queue-statements [${kind}]: ${QUEUE} queued...`);
    const staged = await insertTestBundles(db, owner, QUEUE, "submitted");
    const created = await insertTestBundles(db, owner, 2 * ROUNDS * (GROUP + 1), "created");
    progress(`bench:queue-statements [${kind}]: set up in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
    console.log(kind === "pg" ? "PostgreSQL" : "PGlite");
    report("statistics from before the queue", await rounds(db, staged, created));
    await db.query("ANALYZE bundles");
    report("after ANALYZE                   ", await rounds(db, staged, created));
  } finally {
    await db.close();
  }
}
