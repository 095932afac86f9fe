import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, expect, it } from "vitest";
import { parseYamlText } from "../lib/pipeline/definition.ts";
import type { SubmitLimits } from "../rest-server/quotas.ts";
import { createTestUserWithToken, describeEachDb } from "./db.ts";
import {
  etlPipelineYaml,
  pipelineTestServer,
  REPORT_JOBS,
  runBundleToEnd,
  testPipelineManager,
} from "./pipeline-fixtures.ts";
import { expectApiError, injectClient } from "./rest-client.ts";

const CAP = 4;
const LIMITS: SubmitLimits = { maxQueuedBundlesPerUser: CAP, submissionsPerSecond: 0, submissionBurst: 1 };

describeEachDb("pipelines under quotas.maxQueuedBundlesPerUser", (getDb) => {
  let app: FastifyInstance;
  let api: ReturnType<typeof injectClient>;
  const newManager = (batchSize = 1000) => testPipelineManager(getDb(), { batchSize, submitLimits: LIMITS });

  beforeAll(async () => {
    app = await pipelineTestServer(getDb(), "dispatch-cloud-pipeline-quota-test", {
      ...LIMITS,
      maxTokensPerUser: 100,
    });
    api = injectClient(app);
  });
  afterAll(async () => {
    await app?.close();
  });

  /** A user with the etl pipeline stored as `name`. */
  const userWithPipeline = async (name: string) => {
    const user = await createTestUserWithToken(getDb());
    const res = await api("PUT", `/api/v1/pipelines/${name}`, user.token, {
      definition: parseYamlText(etlPipelineYaml({ name })),
    });
    expect(res.status, JSON.stringify(res.body)).toBe(201);
    return user;
  };
  const run = async (user: { token: string }, name: string) => {
    const res = await api("POST", `/api/v1/pipelines/${name}/run`, user.token, {
      app: "report",
      jobId: "20140602",
    });
    expect(res.status, JSON.stringify(res.body)).toBe(200);
    return res.body as { started: number; created: unknown[] };
  };
  /** The user's bundles not yet final, and how many bundles the user has in all. */
  const bundlesOf = async (owner: string) => {
    const { rows } = await getDb().query<{ uuid: string; state: string }>(
      "SELECT uuid, state FROM bundles WHERE owner_uuid = $1",
      [owner],
    );
    return {
      open: rows.filter((r) => ["created", "staged", "starting", "running"].includes(r.state)),
      all: rows,
    };
  };
  const waitingJobs = async (owner: string) => {
    const { rows } = await getDb().query<{ n: number }>(
      "SELECT count(*)::int AS n FROM pipeline_jobs WHERE owner_uuid = $1 AND state = 'waiting'",
      [owner],
    );
    return rows[0]!.n;
  };
  const jobsOf = async (owner: string) =>
    (
      await getDb().query<{ app: string; job_id: string; state: string; reason: string | null }>(
        "SELECT app, job_id, state, reason FROM pipeline_jobs WHERE owner_uuid = $1",
        [owner],
      )
    ).rows;
  const finish = async (uuid: string) => expect(await runBundleToEnd(getDb(), uuid)).toBe(true);

  it("a run starts what fits under the cap; the manager starts the rest as the owner's bundles end", async () => {
    const alice = await userWithPipeline("p-cap");
    const manager = newManager();
    const first = await run(alice, "p-cap");
    // report 20140602 needs 12 bundles; the 6 ingests are ready at once, and 4 fit.
    expect(first.created.length).toBe(REPORT_JOBS.length);
    expect(first.started).toBe(CAP);
    expect((await bundlesOf(alice.uuid)).open.length).toBe(CAP);
    // At the cap, a bundle of her own is refused as before, and the manager starts nothing more.
    expectApiError(
      await api("POST", "/api/v1/bundles", alice.token, { image: "busybox", command: ["true"] }),
      429,
      "quota.queued_bundles",
    );
    expect(await manager.runOnce()).toBe(0);
    expect((await bundlesOf(alice.uuid)).open.length).toBe(CAP);
    // The two ingests left waiting say why.
    const held = (await jobsOf(alice.uuid)).filter((j) => j.state === "waiting" && j.reason !== null);
    expect(held.map((j) => j.app)).toEqual(["ingest", "ingest"]);
    const shown = await api("GET", `/api/v1/pipelines/p-cap/jobs/ingest/${held[0]!.job_id}`, alice.token);
    expect(shown.body.job.reason).toBe(
      "held: its owner has 4 unfinished bundles, the most quotas.maxQueuedBundlesPerUser allows; it starts as they end",
    );
    // One bundle at a time to its end, then a manager pass: never more than the cap open, until all are done.
    let most = 0;
    for (let i = 0; i < 40; i++) {
      const { open } = await bundlesOf(alice.uuid);
      most = Math.max(most, open.length);
      if (open.length === 0) break;
      await finish(open[0]!.uuid);
      await manager.runOnce();
    }
    expect(most).toBe(CAP);
    const { open, all } = await bundlesOf(alice.uuid);
    expect(open).toEqual([]);
    expect(all.length).toBe(12);
    expect(await waitingJobs(alice.uuid)).toBe(0);
    expect((await jobsOf(alice.uuid)).filter((j) => j.reason !== null)).toEqual([]);
    const report = await api("GET", "/api/v1/pipelines/p-cap/jobs/report/20140602", alice.token);
    expect(report.body.job.state).toBe("completed");
  });

  it("an owner at the cap does not keep the manager from other users' ready jobs", async () => {
    // Pages of one job: whichever owner's job comes first, the other's is reached in the same pass.
    const manager = newManager(1);
    const alice = await userWithPipeline("p-busy");
    const bob = await userWithPipeline("p-other");
    expect((await run(alice, "p-busy")).started).toBe(CAP);
    expect((await run(bob, "p-other")).started).toBe(CAP);
    // Bob's bundles end: his held ingests (and audits of the ingests done) are ready, as are alice's 2 held
    // ingests, and she is still at the cap.
    for (const b of (await bundlesOf(bob.uuid)).open) await finish(b.uuid);
    const moved = await manager.runOnce();
    expect(moved).toBeGreaterThanOrEqual(2);
    expect((await bundlesOf(bob.uuid)).open.length).toBe(Math.min(CAP, moved));
    expect((await bundlesOf(alice.uuid)).open.length).toBe(CAP);
    expect(await waitingJobs(alice.uuid)).toBeGreaterThan(0);
  });
});
