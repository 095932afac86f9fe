import { Writable } from "node:stream";
import pg from "pg";
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it } from "vitest";
import { type BundleQueue, createBundleQueue, notifiedSeq } from "../dispatcher/queue/queue.ts";
import { createLogger } from "../lib/logger.ts";
import type { Db } from "../store/db.ts";
import { changeSeqOlderThan, getBundle, setBundleInputManifests } from "../store/queries.ts";
import { killBundle, stageBundle, startBundle } from "../store/transitions.ts";
import { BUNDLE_CHANNEL, type Bundle, type User } from "../store/types.ts";
import { createTestBundle, createTestUser, describeEachDb, openTestDb, type TestDb } from "./db.ts";
import { FakeClock } from "./fake-clock.ts";
import { silentLogger as logger } from "./fixtures.ts";

const HOUR = 3_600_000;
const actor = "dispatcher";

async function clearBundles(db: Db): Promise<void> {
  await db.query("DELETE FROM bundle_events; DELETE FROM bundle_dependencies; DELETE FROM bundles");
}

/** A staged bundle (created, then staged by a real transition). */
async function stagedBundle(db: Db, owner: User, priority = 500): Promise<Bundle> {
  const b = await createTestBundle(db, owner.uuid, { priority });
  const r = await stageBundle(db, b.uuid, { actor });
  if (!r.ok) throw new Error(`could not stage ${b.uuid}: ${r.reason}`);
  return r.bundle;
}

/** Inserts n bundles in one statement, cycling staged, starting, running, ready; returns the active count. */
async function insertMany(db: Db, owner: User, n: number): Promise<number> {
  await db.query(
    `INSERT INTO bundles (uuid, owner_uuid, name, command, image, env, resources, preemptible, priority, limits,
       dependencies, allow_failed_dependencies, max_attempts, state)
     SELECT 'zzzzz-bndl-' || lpad(i::text, 15, '0'), $1, 'b' || i, '["true"]', 'busybox', '{}',
       '{"vcpus": 1, "ram": 1048576, "scratch": 0, "gpu": null}', false, 1,
       '{"time": null, "disk": null, "network": true}', '[]', false, 3,
       (ARRAY['staged', 'starting', 'running', 'ready'])[i % 4 + 1]
     FROM generate_series(1, $2::int) AS i`,
    [owner.uuid, n],
  );
  return n - Math.floor((n + 1) / 4);
}

/** `db`, noting the parameters of each of the queue's incremental reads ([after, limit, holes?]) in `reads`. */
function spyOnReads(real: TestDb, reads: unknown[][]): Db {
  return {
    kind: real.kind,
    query: (sql, params) => {
      if (/^SELECT \* FROM bundles WHERE \(?change_seq >/.test(sql)) reads.push([...(params ?? [])]);
      return real.query(sql, params);
    },
    transaction: (fn) => real.transaction(fn),
    listen: (channel, onPayload) => real.listen(channel, onPayload),
    tryAdvisoryLock: (key) => real.tryAdvisoryLock(key),
    close: () => real.close(),
  };
}

/** Resolves once pred() holds after a queue change (checked at once, then after each notification). */
function when(queue: BundleQueue, pred: () => boolean): Promise<void> {
  return new Promise((resolve) => {
    if (pred()) {
      resolve();
      return;
    }
    const off = queue.subscribe(() => {
      if (pred()) {
        off();
        resolve();
      }
    });
  });
}

describe("notifiedSeq", () => {
  it("reads the change_seq of a one-row NOTIFY and nothing else", () => {
    expect(notifiedSeq("zzzzz-bndl-0123456789abcde starting 42")).toBe(42);
    expect(notifiedSeq("* staged 20")).toBeNull();
    expect(notifiedSeq("* created 1")).toBeNull();
    expect(notifiedSeq("zzzzz-bndl-0123456789abcde starting")).toBeNull();
    expect(notifiedSeq("zzzzz-bndl-0123456789abcde starting 4x")).toBeNull();
    expect(notifiedSeq("zzzzz-bndl-0123456789abcde starting -3")).toBeNull();
    expect(notifiedSeq("zzzzz-bndl-0123456789abcde starting 1e400")).toBeNull();
    expect(notifiedSeq("")).toBeNull();
  });
});

describeEachDb("bundle queue", (getDb) => {
  let owner: User;
  let queue: BundleQueue | undefined;
  let clock: FakeClock;

  beforeAll(async () => {
    owner = await createTestUser(getDb());
  });
  beforeEach(async () => {
    await clearBundles(getDb());
    clock = new FakeClock();
  });
  afterEach(async () => {
    await queue?.stop();
    queue = undefined;
  });

  const newQueue = (over: { pageSize?: number; fullReloadInterval?: number } = {}) => {
    queue = createBundleQueue({ db: getDb(), clock, logger, pollInterval: HOUR, ...over });
    return queue;
  };

  it("keeps a bundle's input manifests; bad contents are no inputs and a warning, never a failed read", async () => {
    const lines: string[] = [];
    const sink = new Writable({
      write(chunk, _enc, done) {
        lines.push(String(chunk));
        done();
      },
    });
    queue = createBundleQueue({
      db: getDb(),
      clock,
      logger: createLogger({ level: "warn", format: "json", destination: sink }),
      pollInterval: HOUR,
    });
    const plain = await stagedBundle(getDb(), owner);
    const withInputs = await stagedBundle(getDb(), owner);
    const bad = await stagedBundle(getDb(), owner);
    const inputs = [
      { digest: `${"a".repeat(64)}/100`, bytes: 5_000_000 },
      { digest: `${"b".repeat(64)}/200`, bytes: 7 },
    ];
    expect(await setBundleInputManifests(getDb(), withInputs.uuid, inputs)).toBe(true);
    await getDb().query(`UPDATE bundles SET input_manifests = $2::jsonb WHERE uuid = $1`, [
      bad.uuid,
      JSON.stringify([{ digest: "not-a-digest", bytes: 1 }]),
    ]);
    await queue.start();
    expect(queue.get(plain.uuid)?.inputManifests ?? []).toEqual([]);
    expect(queue.get(withInputs.uuid)?.inputManifests).toEqual(inputs);
    expect(queue.get(bad.uuid)?.state).toBe("staged");
    expect(queue.get(bad.uuid)?.inputManifests ?? []).toEqual([]);
    const warned = lines.map((l) => JSON.parse(l) as { msg: string; bundleUuid: string; reason: string });
    expect(warned).toEqual([
      expect.objectContaining({
        msg: "bad input_manifests: no locality for it",
        bundleUuid: bad.uuid,
        reason: expect.stringMatching(/^input_manifests ignored: \[0\]\.digest: /),
      }),
    ]);
    // A new row of it with the same bad contents (a status write): no second warning.
    await getDb().query(`UPDATE bundles SET scheduling_status = 'x' WHERE uuid = $1`, [bad.uuid]);
    await queue.refresh();
    expect(queue.get(bad.uuid)?.schedulingStatus).toBe("x");
    expect(lines).toHaveLength(1);
    // Changed later (a new change_seq): read again incrementally.
    await getDb().query(`UPDATE bundles SET input_manifests = '{"x": 1}'::jsonb WHERE uuid = $1`, [
      withInputs.uuid,
    ]);
    await queue.refresh();
    expect(queue.get(withInputs.uuid)?.inputManifests ?? []).toEqual([]);
    expect(queue.get(withInputs.uuid)?.inputManifestsProblem).toBe(
      "input_manifests ignored: not a JSON array",
    );
    expect(await setBundleInputManifests(getDb(), plain.uuid, inputs.slice(1))).toBe(true);
    expect(await setBundleInputManifests(getDb(), plain.uuid, inputs.slice(1))).toBe(false);
    await queue.refresh();
    expect(queue.get(plain.uuid)?.inputManifests).toEqual(inputs.slice(1));
  });

  it("loads every active bundle, over several pages, and none of the others", async () => {
    const db = getDb();
    const active = await insertMany(db, owner, 12_000);
    expect(active).toBe(9_000);
    const q = newQueue();
    await q.start();
    expect(q.size).toBe(9_000);
    const states = new Map<string, number>();
    for (const b of q.all()) states.set(b.state, (states.get(b.state) ?? 0) + 1);
    expect(Object.fromEntries(states)).toEqual({ staged: 3_000, starting: 3_000, running: 3_000 });
    expect(q.get("zzzzz-bndl-000000000000001")?.state).toBe("starting");
    expect(q.get("zzzzz-bndl-000000000000003")).toBeUndefined(); // ready
    // Re-reading changes nothing.
    expect(await q.refresh()).toBe(0);
    expect(q.size).toBe(9_000);
  });

  it("applies incremental changes: updates, new active bundles, final and created ones left out", async () => {
    const db = getDb();
    const [a, b, c] = [
      await stagedBundle(db, owner),
      await stagedBundle(db, owner),
      await stagedBundle(db, owner),
    ];
    const created = await createTestBundle(db, owner.uuid);
    const laterCreated = await createTestBundle(db, owner.uuid);
    // Not started (no loop, no NOTIFY): only these explicit reads change it; the first reads from scratch.
    const q = newQueue();
    expect(await q.refresh()).toBe(3);
    expect([...q.all()].map((x) => x.uuid).sort()).toEqual([a!.uuid, b!.uuid, c!.uuid].sort());
    let notified = 0;
    q.subscribe(() => notified++);

    await db.query("UPDATE bundles SET priority = 7 WHERE uuid = $1", [a!.uuid]);
    await db.query("UPDATE bundles SET state = 'ready' WHERE uuid = $1", [b!.uuid]);
    await db.query("UPDATE bundles SET state = 'staged' WHERE uuid = $1", [created.uuid]);
    await db.query("UPDATE bundles SET priority = 8 WHERE uuid = $1", [laterCreated.uuid]);
    expect(await q.refresh()).toBe(3);
    expect(notified).toBe(1);
    expect(q.get(a!.uuid)?.priority).toBe(7);
    expect(q.get(b!.uuid)).toBeUndefined();
    expect(q.get(created.uuid)?.state).toBe("staged");
    expect(q.get(laterCreated.uuid)).toBeUndefined();
    expect(q.size).toBe(3);

    // Idempotent: nothing new, nothing applied, no notification.
    expect(await q.refresh()).toBe(0);
    expect(notified).toBe(1);

    // Transitions: starting stays, killed leaves.
    const started = await startBundle(db, c!.uuid, {
      instanceId: "i-1",
      instanceType: "t.small",
      runnerTokenHash: "a".repeat(64),
      gpuDevices: [],
      actor,
    });
    expect(started.ok).toBe(true);
    await killBundle(db, a!.uuid, { actor, reason: "test" });
    await q.refresh();
    expect(q.get(c!.uuid)?.state).toBe("starting");
    expect(q.get(a!.uuid)).toBeUndefined();
    expect(q.size).toBe(2);
  });

  it("is woken by NOTIFY alone (poll interval 1 h, clock never advanced)", async () => {
    const db = getDb();
    const a = await stagedBundle(db, owner);
    const q = newQueue();
    await q.start();
    await q.refresh();
    const t = clock.now();

    const started = when(q, () => q.get(a.uuid)?.state === "starting");
    const r = await startBundle(db, a.uuid, {
      instanceId: "i-1",
      instanceType: "t.small",
      runnerTokenHash: "b".repeat(64),
      gpuDevices: [0],
      actor,
    });
    expect(r.ok).toBe(true);
    await started;
    expect(q.get(a.uuid)?.gpuDevices).toEqual([0]);

    const gone = when(q, () => q.get(a.uuid) === undefined);
    await killBundle(db, a.uuid, { actor, reason: "test" });
    await gone;

    const b = await createTestBundle(db, owner.uuid);
    const added = when(q, () => q.get(b.uuid) !== undefined);
    await stageBundle(db, b.uuid, { actor });
    await added;
    expect(clock.now()).toBe(t);
  });

  it("is not woken by a NOTIFY naming a change it already has (applied in process); is by one naming a change it lacks", async () => {
    const db = getDb();
    const reads: unknown[][] = [];
    const a = await stagedBundle(db, owner);
    const b = await stagedBundle(db, owner);
    queue = createBundleQueue({ db: spyOnReads(db, reads), clock, logger, pollInterval: HOUR });
    const q = queue;
    await q.start();
    await q.refresh();
    const notifyChange = (x: Bundle) =>
      db.query("SELECT pg_notify($1, $2)", [BUNDLE_CHANNEL, `${x.uuid} ${x.state} ${x.changeSeq}`]);

    // A's change, applied as the dispatcher applies its own transitions, then its NOTIFY: nothing to read.
    await db.query("UPDATE bundles SET priority = 7 WHERE uuid = $1", [a.uuid]);
    const changedA = (await getBundle(db, a.uuid))!;
    q.apply(changedA);
    reads.length = 0;
    await notifyChange(changedA);
    await new Promise((r) => setTimeout(r, 200));
    expect(reads).toEqual([]);

    // B's change, not applied: its NOTIFY wakes one read, which brings it.
    await db.query("UPDATE bundles SET priority = 8 WHERE uuid = $1", [b.uuid]);
    const changedB = (await getBundle(db, b.uuid))!;
    const seenB = when(q, () => q.get(b.uuid)?.priority === 8);
    await notifyChange(changedB);
    await seenB;
    expect(reads.length).toBe(1);
  });

  it("apply(): a newer row wins at once, an older one is ignored, a final one removes", async () => {
    const db = getDb();
    const a = await stagedBundle(db, owner);
    const q = newQueue();
    await q.start();
    await q.refresh();
    let notified = 0;
    q.subscribe(() => notified++);

    const r = await startBundle(db, a.uuid, {
      instanceId: "i-2",
      instanceType: "t.small",
      runnerTokenHash: "c".repeat(64),
      gpuDevices: [],
      actor,
    });
    if (!r.ok) throw new Error(r.reason);
    q.apply(r.bundle);
    expect(q.get(a.uuid)?.state).toBe("starting");
    expect(notified).toBe(1);

    q.apply(a); // the older staged row
    expect(q.get(a.uuid)?.state).toBe("starting");
    expect(notified).toBe(1);

    const k = await killBundle(db, a.uuid, { actor, reason: "test" });
    if (!k.ok) throw new Error(k.reason);
    q.apply(k.bundle);
    expect(q.get(a.uuid)).toBeUndefined();
    expect(notified).toBe(2);
    q.apply(r.bundle); // stale again: stays out once a read has settled
    await q.refresh();
    expect(q.get(a.uuid)).toBeUndefined();
    // The read brought the final row apply() had already had (its NOTIFY): nobody is told twice.
    expect(notified).toBe(2);
  });

  it("tells its listeners what changed: {uuid, from, to} with the row, final rows included", async () => {
    const db = getDb();
    const a = await stagedBundle(db, owner);
    const q = newQueue();
    const seen: string[] = [];
    q.subscribe((changes) => {
      for (const c of changes)
        seen.push(`${c.uuid === a.uuid ? "a" : c.uuid} ${c.from} -> ${c.to} #${c.bundle.changeSeq}`);
    });
    await q.start();
    const started = await startBundle(db, a.uuid, {
      instanceId: "i-1",
      instanceType: "small",
      runnerTokenHash: "x".repeat(64),
      gpuDevices: [],
      actor,
    });
    if (!started.ok) throw new Error("start refused");
    await q.refresh();
    const killed = await killBundle(db, a.uuid, { actor, reason: "test" });
    if (!killed.ok) throw new Error("kill refused");
    await q.refresh();
    // A bundle the queue never held shows up only once it is final.
    const b = await createTestBundle(db, owner.uuid);
    await q.refresh();
    const bKilled = await killBundle(db, b.uuid, { actor, reason: "test" });
    if (!bKilled.ok) throw new Error("kill refused");
    await q.refresh();
    expect(seen).toEqual([
      `a null -> staged #${a.changeSeq}`,
      `a staged -> starting #${started.bundle.changeSeq}`,
      `a starting -> killed #${killed.bundle.changeSeq}`,
      `${b.uuid} null -> killed #${bKilled.bundle.changeSeq}`,
    ]);
  });

  it("a slow full re-read drops a row the incremental reads cannot see", async () => {
    const db = getDb();
    const a = await stagedBundle(db, owner);
    const b = await stagedBundle(db, owner);
    const q = newQueue({ fullReloadInterval: 300_000 });
    await q.start();
    await q.refresh();
    expect(q.size).toBe(2);
    // Without the trigger, change_seq stays put: no incremental read will ever see this change.
    await db.query("ALTER TABLE bundles DISABLE TRIGGER bundles_touch");
    try {
      await db.query("UPDATE bundles SET state = 'failed' WHERE uuid = $1", [a.uuid]);
    } finally {
      await db.query("ALTER TABLE bundles ENABLE TRIGGER bundles_touch");
    }
    await q.refresh();
    expect(q.get(a.uuid)?.state).toBe("staged");

    const dropped = when(q, () => q.get(a.uuid) === undefined);
    await clock.advance(300_000);
    await dropped;
    expect(q.get(b.uuid)?.state).toBe("staged");
    expect(q.size).toBe(1);
  });

  it("changeSeqOlderThan: the newest change_seq written at least that long ago", async () => {
    const db = getDb();
    const a = await stagedBundle(db, owner);
    const b = await stagedBundle(db, owner);
    expect(await changeSeqOlderThan(db, 60_000)).toBe(0);
    await db.query("ALTER TABLE bundles DISABLE TRIGGER bundles_touch");
    try {
      await db.query("UPDATE bundles SET updated_at = now() - interval '1 hour' WHERE uuid = $1", [a.uuid]);
    } finally {
      await db.query("ALTER TABLE bundles ENABLE TRIGGER bundles_touch");
    }
    expect(await changeSeqOlderThan(db, 60_000)).toBe(a.changeSeq);
    expect(await changeSeqOlderThan(db, 2 * HOUR)).toBe(0);
    expect(b.changeSeq).toBeGreaterThan(a.changeSeq);
  });

  it("stops: no reads after stop()", async () => {
    const db = getDb();
    const a = await stagedBundle(db, owner);
    const q = newQueue();
    await q.start();
    await q.refresh();
    await q.stop();
    let notified = 0;
    q.subscribe(() => notified++);
    await killBundle(db, a.uuid, { actor, reason: "test" });
    await clock.advance(2 * HOUR);
    expect(notified).toBe(0);
    expect(q.get(a.uuid)?.state).toBe("staged");
  });
});

// A transaction that took a lower change_seq but commits after a higher one was read only happens with
// concurrent connections, which PGlite (one connection) cannot have.
describe("bundle queue: late-committing transactions [pg]", () => {
  let db: TestDb | undefined;
  let setupError: unknown;
  beforeAll(async () => {
    try {
      db = await openTestDb("pg");
    } catch (err) {
      setupError = err;
    }
  });
  afterAll(async () => {
    await db?.close();
  });

  /**
   * A queue on a FakeClock, not started (noting its reads' parameters in `reads` when given), and a second
   * connection for transactions that commit late.
   */
  async function queueAndConnection(db: TestDb, reads?: unknown[][]) {
    const clock = new FakeClock();
    const q = createBundleQueue({
      db: reads === undefined ? db : spyOnReads(db, reads),
      clock,
      logger,
      pollInterval: HOUR,
      watermarkDelay: 2000,
    });
    const other = new pg.Client({ connectionString: db.url });
    await other.connect();
    return { clock, q, other };
  }

  /**
   * Two staged bundles (a, b), a second connection for transactions that commit late, and a started queue on a
   * FakeClock (noting its reads' parameters in `reads` when given) that has read the load's window and is past it.
   */
  async function lateCommitQueue(db: TestDb, reads?: unknown[][]) {
    await clearBundles(db);
    const owner = await createTestUser(db);
    const a = await stagedBundle(db, owner, 1);
    const b = await stagedBundle(db, owner, 1);
    const { clock, q, other } = await queueAndConnection(db, reads);
    await q.start();
    for (let i = 0; i < 2; i++) {
      await clock.advance(3000);
      await q.refresh();
    }
    const end = async () => {
      await q.stop();
      await other.end();
    };
    return { owner, a, b, clock, q, other, end };
  }

  it("does not miss a row whose transaction commits after a higher change_seq was read", async () => {
    if (!db) throw setupError;
    const { a, b, clock, q, other, end } = await lateCommitQueue(db);
    try {
      for (const round of [1, 2]) {
        await other.query("BEGIN");
        await other.query("UPDATE bundles SET priority = $2 WHERE uuid = $1", [a.uuid, 100 + round]);
        await db.query("UPDATE bundles SET priority = $2 WHERE uuid = $1", [b.uuid, 200 + round]);
        await q.refresh();
        expect(q.get(b.uuid)?.priority).toBe(200 + round);
        expect(q.get(a.uuid)?.priority).not.toBe(100 + round);
        await other.query("COMMIT");
        const seqA = (await getBundle(db, a.uuid))!.changeSeq;
        const seqB = (await getBundle(db, b.uuid))!.changeSeq;
        expect(seqA).toBeLessThan(seqB);

        await clock.advance(3000);
        await q.refresh();
        expect(q.get(a.uuid)?.priority).toBe(100 + round);
        expect(q.get(a.uuid)?.changeSeq).toBe(seqA);
      }
    } finally {
      await end();
    }
  });

  it("reads a late commit at the next read, asking only for the rows above the last one read and the holes", async () => {
    if (!db) throw setupError;
    // The incremental reads' parameters: [after, limit, holes?].
    const reads: unknown[][] = [];
    const { owner, a, b, clock, q, other, end } = await lateCommitQueue(db, reads);
    try {
      await insertMany(db, owner, 30);
      await q.refresh();
      const top = (await getBundle(db, b.uuid))!.changeSeq;
      await clock.advance(3000);
      await q.refresh();
      reads.length = 0;

      // A takes its number, B a higher one and commits first.
      await other.query("BEGIN");
      await other.query("UPDATE bundles SET priority = 7 WHERE uuid = $1", [a.uuid]);
      await db.query("UPDATE bundles SET priority = 8 WHERE uuid = $1", [b.uuid]);
      await q.refresh();
      const seqB = q.get(b.uuid)!.changeSeq;
      expect(q.get(b.uuid)?.priority).toBe(8);
      await other.query("COMMIT");
      const seqA = (await getBundle(db, a.uuid))!.changeSeq;
      expect(seqA).toBe(seqB - 1);
      // The next read, with no time passed, asks for A's number and the rows above B's, and gets A.
      await q.refresh();
      expect(q.get(a.uuid)?.priority).toBe(7);
      expect(reads.length).toBe(2);
      expect(Number(reads[0]![0])).toBeGreaterThanOrEqual(top);
      expect(reads[0]!.length).toBe(2); // no holes: nothing else asked for
      expect(reads[1]).toEqual([seqB, 5000, [seqA]]);
      // Once filled, the hole is asked for no more.
      await q.refresh();
      expect(reads[2]).toEqual([seqB, 5000]);
    } finally {
      await end();
    }
  });

  it("does not read again the rows applied to it, and asks for the sequences they skipped", async () => {
    if (!db) throw setupError;
    const reads: unknown[][] = [];
    const { a, b, q, end } = await lateCommitQueue(db, reads);
    try {
      // A changes (not applied), then B's change is applied as the REST server or a transition does.
      await db.query("UPDATE bundles SET priority = 5 WHERE uuid = $1", [a.uuid]);
      const changed = await db.query<{ change_seq: string }>(
        "UPDATE bundles SET priority = 6 WHERE uuid = $1 RETURNING change_seq",
        [b.uuid],
      );
      const row = (await getBundle(db, b.uuid))!;
      expect(row.changeSeq).toBe(Number(changed.rows[0]!.change_seq));
      q.apply(row);
      expect(q.get(b.uuid)?.priority).toBe(6);
      reads.length = 0;
      await q.refresh();
      // Only A's sequence, skipped by the applied row, is asked for; nothing above B's.
      expect(reads).toEqual([[row.changeSeq, 5000, [row.changeSeq - 1]]]);
      expect(q.get(a.uuid)?.priority).toBe(5);
      await q.refresh();
      expect(reads[1]).toEqual([row.changeSeq, 5000]);
    } finally {
      await end();
    }
  });

  it("with more holes than it names, reads every row above the safe sequence until they are safe", async () => {
    if (!db) throw setupError;
    const { a, b, clock, q, other, end } = await lateCommitQueue(db);
    try {
      await other.query("BEGIN");
      await other.query("UPDATE bundles SET priority = 9 WHERE uuid = $1", [a.uuid]);
      // 25,000 numbers nobody writes, then B: the gap is more than the queue names one by one.
      await db.query("SELECT nextval('bundle_change_seq') FROM generate_series(1, 25000)");
      await db.query("UPDATE bundles SET priority = 10 WHERE uuid = $1", [b.uuid]);
      await q.refresh();
      expect(q.get(b.uuid)?.priority).toBe(10);
      await other.query("COMMIT");
      await clock.advance(1000);
      await q.refresh();
      expect(q.get(a.uuid)?.priority).toBe(9);
    } finally {
      await end();
    }
  });

  it("reads the load's window of fresh rows once, then names the numbers it lacked and asks for them alone", async () => {
    if (!db) throw setupError;
    await clearBundles(db);
    // As on a new database: the numbers the tests before took (and their 25,000 unused ones) are not in the way.
    await db.query("ALTER SEQUENCE bundle_change_seq RESTART");
    const owner = await createTestUser(db);
    const a = await stagedBundle(db, owner, 1);
    const reads: unknown[][] = [];
    const { clock, q, other } = await queueAndConnection(db, reads);
    try {
      // A takes its number and commits late; 40 rows written after it are committed before the load.
      await other.query("BEGIN");
      await other.query("UPDATE bundles SET priority = 77 WHERE uuid = $1", [a.uuid]);
      const active = await insertMany(db, owner, 40);
      await q.start();
      expect(q.size).toBe(active + 1);
      // Every row of the window is young: the first read (the loop's, after the load) takes all of them again.
      await when(q, () => reads.length === 1);
      expect(reads[0]).toEqual([0, 5000]);
      const held = new Set(
        (await db.query<{ seq: string }>("SELECT change_seq AS seq FROM bundles")).rows.map((r) =>
          Number(r.seq),
        ),
      );
      const top = Math.max(...held);
      // The numbers no row had: A's first one (its row changed again when it was staged) and its late one.
      const lacked = Array.from({ length: top }, (_, i) => i + 1).filter((n) => !held.has(n));
      await other.query("COMMIT");
      const seqA = (await getBundle(db, a.uuid))!.changeSeq;
      expect(lacked).toContain(seqA);
      expect(lacked.length).toBeLessThanOrEqual(3);
      // The next read, no time passed: the rows above the last one read and those numbers, not the window again.
      await q.refresh();
      expect(reads[1]).toEqual([top, 5000, lacked]);
      expect(q.get(a.uuid)?.priority).toBe(77);
      // A's number, read, is asked for no more; the others are until they are safe.
      await q.refresh();
      const dead = lacked.filter((n) => n !== seqA);
      expect(reads[2]).toEqual(dead.length > 0 ? [top, 5000, dead] : [top, 5000]);
      await clock.advance(3000);
      await q.refresh();
      await q.refresh();
      expect(reads.at(-1)).toEqual([top, 5000]);
    } finally {
      await q.stop();
      await other.end();
    }
  });

  it("does not miss a row whose transaction commits after the initial load", async () => {
    if (!db) throw setupError;
    const owner = await createTestUser(db);
    const a = await stagedBundle(db, owner, 1);
    const b = await stagedBundle(db, owner, 1);
    const clock = new FakeClock();
    const q = createBundleQueue({ db, clock, logger, pollInterval: HOUR, watermarkDelay: 2000 });
    const other = new pg.Client({ connectionString: db.url });
    await other.connect();
    try {
      await other.query("BEGIN");
      await other.query("UPDATE bundles SET priority = 42 WHERE uuid = $1", [a.uuid]);
      await db.query("UPDATE bundles SET priority = 43 WHERE uuid = $1", [b.uuid]);
      await q.start(); // loads A as it was, B as it is now
      expect(q.get(a.uuid)?.priority).toBe(1);
      expect(q.get(b.uuid)?.priority).toBe(43);
      await other.query("COMMIT");
      await clock.advance(3000);
      await q.refresh();
      expect(q.get(a.uuid)?.priority).toBe(42);
    } finally {
      await q.stop();
      await other.end();
    }
  });
});
