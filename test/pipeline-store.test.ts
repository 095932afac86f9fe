/**
 * store/pipeline-queries.ts on PostgreSQL and PGlite: pipelines, jobs and their edges, the guarded moves, failure
 * propagation, descendants and ancestors.
 */
import { expect, it } from "vitest";
import type { Db } from "../store/db.ts";
import {
  descendantsOf,
  failWaitingJob,
  finishedQueuedJobs,
  finishQueuedJob,
  getJobs,
  getPipeline,
  insertJobParents,
  insertJobs,
  type JobKey,
  jobWithAncestors,
  listPipelines,
  propagateFailures,
  queueWaitingJobs,
  readyWaitingJobs,
  resetJobs,
  upsertPipeline,
} from "../store/pipeline-queries.ts";
import { finishBundle, killBundle, markRunning, stageBundle, startBundle } from "../store/transitions.ts";
import type { Bundle } from "../store/types.ts";
import { createTestBundle, createTestUser, describeEachDb } from "./db.ts";

const k = (app: string, jobId: string): JobKey => ({ app, jobId });

/** A bundle driven through the real transitions to a final state. */
async function finalBundle(db: Db, owner: string, state: "ready" | "failed" | "killed"): Promise<Bundle> {
  const b = await createTestBundle(db, owner, { maxAttempts: 1 });
  if (state === "killed") {
    const r = await killBundle(db, b.uuid, { actor: "test", reason: "stop" });
    if (!r.ok) throw new Error("kill refused");
    return r.bundle;
  }
  await stageBundle(db, b.uuid, { actor: "test" });
  await startBundle(db, b.uuid, {
    instanceId: "i-1",
    instanceType: "small",
    runnerTokenHash: `h-${b.uuid}`,
    gpuDevices: [],
    actor: "test",
  });
  await markRunning(db, b.uuid, 1, { actor: "test" });
  const r = await finishBundle(db, b.uuid, 1, { exitCode: state === "ready" ? 0 : 3, actor: "test" });
  if (!r.ok) throw new Error("finish refused");
  return r.bundle;
}

describeEachDb("pipeline store", (getDb) => {
  const db = () => getDb();
  let n = 0;
  /** A fresh owner and pipeline. */
  async function pipeline(): Promise<{ owner: string; name: string }> {
    const owner = (await createTestUser(db())).uuid;
    const name = `p${++n}`;
    await upsertPipeline(db(), { ownerUuid: owner, name, definition: { name, apps: {} }, digest: "d1" });
    return { owner, name };
  }
  /** a <- b <- c (c's parent is b, b's is a), plus s skipped as a second parent of b. */
  async function chain(owner: string, name: string): Promise<void> {
    await insertJobs(db(), owner, name, [
      { app: "a", jobId: "1", state: "waiting" },
      { app: "s", jobId: "1", state: "skipped" },
      { app: "b", jobId: "1", state: "waiting" },
      { app: "c", jobId: "1", state: "waiting" },
    ]);
    await insertJobParents(db(), owner, name, [
      { child: k("b", "1"), parent: k("a", "1") },
      { child: k("b", "1"), parent: k("s", "1") },
      { child: k("c", "1"), parent: k("b", "1") },
    ]);
  }

  it("stores a pipeline, replaces it, and lists it with its job counts", async () => {
    const owner = (await createTestUser(db())).uuid;
    const first = await upsertPipeline(db(), {
      ownerUuid: owner,
      name: "x",
      definition: { v: 1 },
      digest: "d1",
    });
    expect(first.created).toBe(true);
    const second = await upsertPipeline(db(), {
      ownerUuid: owner,
      name: "x",
      definition: { v: 2 },
      digest: "d2",
    });
    expect(second.created).toBe(false);
    expect((await getPipeline(db(), owner, "x"))?.definition).toEqual({ v: 2 });
    expect(await getPipeline(db(), owner, "nope")).toBeNull();
    await insertJobs(db(), owner, "x", [
      { app: "a", jobId: "1", state: "waiting" },
      { app: "a", jobId: "2", state: "skipped" },
    ]);
    const [listed] = await listPipelines(db(), owner);
    expect(listed).toMatchObject({ name: "x", digest: "d2", jobs: { waiting: 1, skipped: 1 } });
  });

  it("inserts a job once: a second insert of the same key changes nothing and returns nothing", async () => {
    const { owner, name } = await pipeline();
    expect(await insertJobs(db(), owner, name, [{ app: "a", jobId: "1", state: "waiting" }])).toEqual([
      k("a", "1"),
    ]);
    expect(
      await insertJobs(db(), owner, name, [
        { app: "a", jobId: "1", state: "skipped" },
        { app: "a", jobId: "2", state: "waiting" },
      ]),
    ).toEqual([k("a", "2")]);
    const jobs = await getJobs(db(), owner, name, [k("a", "1"), k("a", "2"), k("a", "3")]);
    expect(jobs.map((j) => [j.jobId, j.state]).sort()).toEqual([
      ["1", "waiting"],
      ["2", "waiting"],
    ]);
  });

  it("a waiting job is ready once every parent is completed or skipped, with the completed parents' bundles", async () => {
    const { owner, name } = await pipeline();
    await chain(owner, name);
    const all = { ownerUuid: owner, pipeline: name, keys: [k("a", "1"), k("b", "1"), k("c", "1")] };
    expect((await readyWaitingJobs(db(), all)).map((j) => j.app)).toEqual(["a"]);
    const bundleA = await createTestBundle(db(), owner);
    expect(await queueWaitingJobs(db(), owner, name, [{ ...k("a", "1"), bundleUuid: bundleA.uuid }])).toEqual(
      [k("a", "1")],
    );
    // Guarded: a second server's move of the same job changes nothing.
    expect(await queueWaitingJobs(db(), owner, name, [{ ...k("a", "1"), bundleUuid: "other" }])).toEqual([]);
    expect(await readyWaitingJobs(db(), all)).toEqual([]);
    expect(
      await finishQueuedJob(db(), { ownerUuid: owner, pipeline: name, ...k("a", "1") }, bundleA.uuid, {
        state: "completed",
      }),
    ).toBe(true);
    const ready = await readyWaitingJobs(db(), all);
    expect(ready).toEqual([
      {
        ownerUuid: owner,
        pipeline: name,
        app: "b",
        jobId: "1",
        parents: [{ app: "a", jobId: "1", bundleUuid: bundleA.uuid }],
      },
    ]);
    // The unscoped pass finds it too.
    expect(
      (await readyWaitingJobs(db(), { limit: 100000 })).some((j) => j.pipeline === name && j.app === "b"),
    ).toBe(true);
  });

  it("finishes a queued job only from the bundle it has, and retries with attempts + 1", async () => {
    const { owner, name } = await pipeline();
    await insertJobs(db(), owner, name, [{ app: "a", jobId: "1", state: "waiting" }]);
    const failed = await finalBundle(db(), owner, "failed");
    await queueWaitingJobs(db(), owner, name, [{ ...k("a", "1"), bundleUuid: failed.uuid }]);
    const seen = (await finishedQueuedJobs(db(), 100000)).filter(
      (j) => j.pipeline === name && j.ownerUuid === owner,
    );
    expect(seen).toEqual([
      expect.objectContaining({
        app: "a",
        jobId: "1",
        bundleUuid: failed.uuid,
        attempts: 1,
        bundleState: "failed",
      }),
    ]);
    const job = { ownerUuid: owner, pipeline: name, ...k("a", "1") };
    const retry = await createTestBundle(db(), owner);
    expect(await finishQueuedJob(db(), job, failed.uuid, { state: "queued", retryBundle: retry.uuid })).toBe(
      true,
    );
    // The old bundle is no longer the job's: a second server's move from it fails.
    expect(await finishQueuedJob(db(), job, failed.uuid, { state: "failed", reason: "x" })).toBe(false);
    const [j] = await getJobs(db(), owner, name, [k("a", "1")]);
    expect(j).toMatchObject({ state: "queued", bundleUuid: retry.uuid, attempts: 2 });
    // Not final yet: not among the finished.
    expect(
      (await finishedQueuedJobs(db(), 100000)).some((f) => f.pipeline === name && f.ownerUuid === owner),
    ).toBe(false);
    const killed = await killBundle(db(), retry.uuid, { actor: "test", reason: "stop" });
    expect(killed.ok).toBe(true);
    expect(
      (await finishedQueuedJobs(db(), 100000)).find((f) => f.pipeline === name && f.ownerUuid === owner)
        ?.bundleState,
    ).toBe("killed");
  });

  it("propagates a failure down every level, naming the ancestor that ran and failed", async () => {
    const { owner, name } = await pipeline();
    await chain(owner, name);
    expect(await failWaitingJob(db(), owner, name, k("a", "1"), "boom")).toBe(true);
    expect(await failWaitingJob(db(), owner, name, k("a", "1"), "again")).toBe(false);
    let levels = 0;
    while ((await propagateFailures(db())) > 0) levels++;
    expect(levels).toBe(2);
    const jobs = await getJobs(db(), owner, name, [k("b", "1"), k("c", "1"), k("s", "1")]);
    const by = Object.fromEntries(jobs.map((j) => [j.app, j]));
    expect(by["b"]).toMatchObject({
      state: "failed",
      failedParent: k("a", "1"),
      reason: "parent a 1 failed",
    });
    expect(by["c"]).toMatchObject({ state: "failed", failedParent: k("a", "1") });
    expect(by["s"]).toMatchObject({ state: "skipped", failedParent: null });
  });

  it("finds descendants and ancestors, and resets jobs for a rerun (guarded by state)", async () => {
    const { owner, name } = await pipeline();
    await chain(owner, name);
    expect((await descendantsOf(db(), owner, name, k("a", "1"))).map((j) => j.app).sort()).toEqual([
      "b",
      "c",
    ]);
    const tree = await jobWithAncestors(db(), owner, name, k("c", "1"));
    const by = Object.fromEntries(tree.map((r) => [r.job.app, r]));
    expect(Object.keys(by).sort()).toEqual(["a", "b", "c", "s"]);
    expect(by["b"]?.parents).toEqual([k("a", "1"), k("s", "1")]);
    expect(by["c"]?.parents).toEqual([k("b", "1")]);
    expect(await jobWithAncestors(db(), owner, name, k("c", "2"))).toEqual([]);

    await failWaitingJob(db(), owner, name, k("a", "1"), "boom");
    while ((await propagateFailures(db())) > 0);
    // A skipped job is not reset; failed ones are.
    expect(await resetJobs(db(), owner, name, [k("a", "1"), k("s", "1")], ["completed", "failed"])).toEqual([
      k("a", "1"),
    ]);
    const [a] = await getJobs(db(), owner, name, [k("a", "1")]);
    expect(a).toMatchObject({ state: "waiting", attempts: 0, reason: null, bundleUuid: null });
  });

  it("keeps one owner's jobs apart from another's pipeline of the same name", async () => {
    const { owner, name } = await pipeline();
    const other = (await createTestUser(db())).uuid;
    await upsertPipeline(db(), { ownerUuid: other, name, definition: {}, digest: "d" });
    await insertJobs(db(), owner, name, [{ app: "a", jobId: "1", state: "waiting" }]);
    expect(await getJobs(db(), other, name, [k("a", "1")])).toEqual([]);
    expect(await insertJobs(db(), other, name, [{ app: "a", jobId: "1", state: "waiting" }])).toEqual([
      k("a", "1"),
    ]);
  });

  it("refuses an edge to a job that is not stored", async () => {
    const { owner, name } = await pipeline();
    await insertJobs(db(), owner, name, [{ app: "a", jobId: "1", state: "waiting" }]);
    await expect(
      insertJobParents(db(), owner, name, [{ child: k("a", "1"), parent: k("z", "9") }]),
    ).rejects.toThrow();
  });
});
