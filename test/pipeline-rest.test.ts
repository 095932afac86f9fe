import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, beforeEach, expect, it } from "vitest";
import { parseYamlText } from "../lib/pipeline/definition.ts";
import type { PipelineManager } from "../rest-server/pipelines/manager.ts";
import { getBundle } from "../store/queries.ts";
import type { Bundle } from "../store/types.ts";
import { createTestUserWithToken, describeEachDb } from "./db.ts";
import { capturingLogger } from "./fixtures.ts";
import {
  etlPipelineYaml,
  FAIL_ONCE,
  pipelineTestServer,
  REPORT_JOBS,
  runBundleToEnd,
  testPipelineManager,
} from "./pipeline-fixtures.ts";
import { expectApiError, injectClient, type Json } from "./rest-client.ts";

describeEachDb("pipelines over REST", (getDb) => {
  let app: FastifyInstance;
  let api: ReturnType<typeof injectClient>;
  let manager: PipelineManager;
  let alice: { uuid: string; token: string };
  const newManager = () => testPipelineManager(getDb());

  beforeAll(async () => {
    app = await pipelineTestServer(getDb(), "dispatch-cloud-pipeline-rest-test");
    api = injectClient(app);
    manager = newManager();
  });
  // A user per test: every bundle of the user is one of the test's pipeline's.
  beforeEach(async () => {
    alice = await createTestUserWithToken(getDb());
  });
  afterAll(async () => {
    await app?.close();
  });

  const apply = async (name: string, token = alice.token) => {
    const res = await api("PUT", `/api/v1/pipelines/${name}`, token, {
      definition: parseYamlText(etlPipelineYaml({ name })),
    });
    expect(res.status, JSON.stringify(res.body)).toBeLessThan(300);
    return res;
  };
  const run = async (name: string, app_: string, jobId: string): Promise<Json> => {
    const res = await api("POST", `/api/v1/pipelines/${name}/run`, alice.token, { app: app_, jobId });
    expect(res.status, JSON.stringify(res.body)).toBe(200);
    return res.body;
  };
  const status = async (name: string, app_: string, jobId: string): Promise<Json> => {
    const res = await api("GET", `/api/v1/pipelines/${name}/jobs/${app_}/${jobId}`, alice.token);
    expect(res.status, JSON.stringify(res.body)).toBe(200);
    return res.body.job;
  };
  /** Every job of the pipeline (from the database), by `app jobId`. */
  const jobs = async (name: string): Promise<Map<string, Json>> => {
    const { rows } = await getDb().query<Json>(
      "SELECT * FROM pipeline_jobs WHERE owner_uuid = $1 AND pipeline = $2",
      [alice.uuid, name],
    );
    return new Map(rows.map((r) => [`${r.app} ${r.job_id}`, r]));
  };
  /** Every bundle of the test's user (so of its pipeline), oldest first. */
  const bundlesOf = async (_name: string): Promise<Bundle[]> => {
    const { rows } = await getDb().query<{ uuid: string }>(
      "SELECT uuid FROM bundles WHERE owner_uuid = $1 ORDER BY change_seq",
      [alice.uuid],
    );
    return Promise.all(rows.map(async (r) => (await getBundle(getDb(), r.uuid))!));
  };
  /** Not yet started: staged (the pipeline's bundles have no dependencies, so they are staged at insert). */
  const waiting = (b: Bundle) => b.state === "created" || b.state === "staged";
  /** Runs a waiting bundle to its end as a runner would: exit code 0 unless `fail` says otherwise. */
  const finish = async (b: Bundle, exitCode: number) => {
    expect(await runBundleToEnd(getDb(), b.uuid, exitCode)).toBe(true);
  };
  /**
   * Finishes every waiting bundle of the pipeline (`exitCode(name)` says how), then runs the manager, until no
   * bundle is left to finish. Returns the bundles in the order they were finished.
   */
  const drive = async (name: string, exitCode: (b: Bundle) => number = () => 0): Promise<Bundle[]> => {
    const order: Bundle[] = [];
    for (;;) {
      const open = (await bundlesOf(name)).filter(waiting);
      if (open.length === 0) return order;
      for (const b of open) {
        await finish(b, exitCode(b));
        order.push(b);
      }
      await manager.runOnce();
    }
  };

  it("stores a definition (201, then 200) and refuses a bad one at its key path", async () => {
    expect((await apply("p-store")).status).toBe(201);
    expect((await apply("p-store")).status).toBe(200);
    const bad = parseYamlText(etlPipelineYaml({ name: "p-bad" })) as Json;
    bad.apps.summary.depends_on.app_name = "nosuch";
    expectApiError(
      await api("PUT", "/api/v1/pipelines/p-bad", alice.token, { definition: bad }),
      400,
      "pipeline.invalid",
      "definition.apps.summary.depends_on.app_name",
    );
    expectApiError(
      await api("PUT", "/api/v1/pipelines/other-name", alice.token, {
        definition: parseYamlText(etlPipelineYaml({ name: "p-store" })),
      }),
      400,
      "request.invalid_body",
      "definition.name",
    );
    const listed = await api("GET", "/api/v1/pipelines", alice.token);
    expect(listed.body.items.map((p: Json) => p.name)).toContain("p-store");
    // Another user sees none of it.
    const bob = await createTestUserWithToken(getDb());
    expectApiError(await api("GET", "/api/v1/pipelines/p-store", bob.token), 404, "pipeline.not_found");
    expectApiError(
      await api("POST", "/api/v1/pipelines/p-store/run", bob.token, { app: "report", jobId: "20140602" }),
      404,
      "pipeline.not_found",
    );
  });

  it("refuses a job id that does not fit the app's template, and unknown apps and jobs", async () => {
    await apply("p-ids");
    const bad = await api("POST", "/api/v1/pipelines/p-ids/run", alice.token, {
      app: "report",
      jobId: "acme",
    });
    expect(bad.status).toBe(400);
    expect(bad.body.error.code).toBe("pipeline.invalid_job_id");
    expectApiError(
      await api("POST", "/api/v1/pipelines/p-ids/run", alice.token, { app: "nosuch", jobId: "1" }),
      400,
      "request.invalid_body",
      "app",
    );
    expectApiError(
      await api("GET", "/api/v1/pipelines/p-ids/jobs/report/20140602", alice.token),
      404,
      "pipeline.job_not_found",
    );
    expectApiError(
      await api("POST", "/api/v1/pipelines/p-ids/rerun", alice.token, { app: "report", jobId: "20140602" }),
      404,
      "pipeline.job_not_found",
    );
    expect((await jobs("p-ids")).size).toBe(0);
  });

  it("run creates exactly the jobs needed, starts those without parents, and a second run creates nothing", async () => {
    await apply("p-run");
    const first = await run("p-run", "report", "20140602");
    expect(first.created.map((k: Json) => `${k.app} ${k.jobId}`).sort()).toEqual(REPORT_JOBS);
    expect(first.started).toBe(6);
    expect(first.job).toMatchObject({ app: "report", jobId: "20140602", state: "waiting", bundleUuid: null });
    const stored = await jobs("p-run");
    expect(stored.get("audit 20140602_initech")?.state).toBe("skipped");
    expect([...stored.values()].filter((j) => j.state === "queued").map((j) => j.app)).toEqual(
      Array(6).fill("ingest"),
    );
    // The OR groups: `checked` matched (summaries and audits), `legacy` (date 20140530 only) did not.
    const tree = await status("p-run", "report", "20140602");
    expect(tree.parents.map((p: Json) => `${p.app} ${p.jobId}`)).toEqual([
      "audit 20140602_acme",
      "audit 20140602_globex",
      "audit 20140602_initech",
      "summary acme",
      "summary globex",
      "summary initech",
    ]);
    const bundles = (await bundlesOf("p-run")).length;
    expect(bundles).toBe(6);

    const again = await run("p-run", "report", "20140602");
    expect(again.created).toEqual([]);
    expect(again.started).toBe(0);
    expect((await bundlesOf("p-run")).length).toBe(bundles);
  });

  it("bubbles down as bundles finish, retries a failed bundle, and mounts every parent's outputs", async () => {
    await apply("p-down");
    await run("p-down", "report", "20140602");
    let failed = 0;
    const order = await drive("p-down", (b) => (b.name === `ingest.${FAIL_ONCE}` && failed++ === 0 ? 3 : 0));
    const all = await jobs("p-down");
    expect([...all.values()].filter((j) => j.state !== "completed" && j.state !== "skipped")).toEqual([]);
    expect(all.get(`ingest ${FAIL_ONCE}`)).toMatchObject({ attempts: 2 });
    expect(all.get("ingest 20140601_acme")).toMatchObject({ attempts: 1 });
    // 12 bundles for 12 jobs that run, one more for the retry.
    expect(order.length).toBe(13);
    // Every bundle was made after its parents' bundles were ready: its dependencies are ready bundles.
    for (const b of order) {
      for (const d of b.dependencies) {
        const dep = await getBundle(getDb(), d.bundle);
        expect(dep?.state).toBe("ready");
        expect(order.findIndex((o) => o.uuid === dep?.uuid)).toBeLessThan(
          order.findIndex((o) => o.uuid === b.uuid),
        );
      }
    }
    const report = await getBundle(getDb(), all.get("report 20140602").bundle_uuid);
    expect(report?.dependencies.map((d) => d.name).sort()).toEqual([
      "audit.20140602_acme",
      "audit.20140602_globex",
      "summary.acme",
      "summary.globex",
      "summary.initech",
    ]);
    const summary = await getBundle(getDb(), all.get("summary globex").bundle_uuid);
    expect(summary?.dependencies.map((d) => d.name).sort()).toEqual([
      "ingest.20140601_globex",
      "ingest.20140602_globex",
    ]);
    // The retried job's dependency on it is its second bundle, the ready one.
    const retried = all.get(`ingest ${FAIL_ONCE}`).bundle_uuid;
    expect(summary?.dependencies.find((d) => d.name === `ingest.${FAIL_ONCE}`)?.bundle).toBe(retried);
    const tree = await status("p-down", "report", "20140602");
    expect(tree).toMatchObject({ state: "completed", bundleState: "ready", attempts: 1 });
  });

  it("fails a job after max_attempts, fails its descendants naming it, and rerun brings them back", async () => {
    await apply("p-fail");
    await run("p-fail", "report", "20140602");
    const bad = "ingest.20140602_acme";
    await drive("p-fail", (b) => (b.name === bad ? 7 : 0));
    let all = await jobs("p-fail");
    expect(all.get("ingest 20140602_acme")).toMatchObject({ state: "failed", attempts: 2 });
    expect(all.get("ingest 20140602_acme").reason).toMatch(/failed: exited with code 7 \(attempt 2 of 2\)$/);
    for (const k of ["audit 20140602_acme", "summary acme", "report 20140602"]) {
      expect(all.get(k), k).toMatchObject({
        state: "failed",
        failed_parent_app: "ingest",
        failed_parent_job_id: "20140602_acme",
        bundle_uuid: null,
      });
    }
    expect(all.get("summary globex").state).toBe("completed");
    const tree = await status("p-fail", "report", "20140602");
    expect(tree).toMatchObject({ state: "failed", failedParent: { app: "ingest", jobId: "20140602_acme" } });

    const rerun = await api("POST", "/api/v1/pipelines/p-fail/rerun", alice.token, {
      app: "ingest",
      jobId: "20140602_acme",
    });
    expect(rerun.status, JSON.stringify(rerun.body)).toBe(200);
    expect(rerun.body.reset.map((k: Json) => `${k.app} ${k.jobId}`).sort()).toEqual([
      "audit 20140602_acme",
      "ingest 20140602_acme",
      "report 20140602",
      "summary acme",
    ]);
    expect(rerun.body.job).toMatchObject({ state: "queued", attempts: 1 });
    // Its bundle is queued: a second rerun is refused until it is final.
    expectApiError(
      await api("POST", "/api/v1/pipelines/p-fail/rerun", alice.token, {
        app: "ingest",
        jobId: "20140602_acme",
      }),
      409,
      "pipeline.job_active",
    );
    await drive("p-fail");
    all = await jobs("p-fail");
    expect([...all.values()].filter((j) => j.state !== "completed" && j.state !== "skipped")).toEqual([]);
  });

  it("rerun --descendants runs a completed job and everything below it again, and nothing else", async () => {
    await apply("p-again");
    await run("p-again", "report", "20140602");
    await drive("p-again");
    const before = await jobs("p-again");
    const res = await api("POST", "/api/v1/pipelines/p-again/rerun", alice.token, {
      app: "summary",
      jobId: "acme",
      descendants: true,
    });
    expect(res.status, JSON.stringify(res.body)).toBe(200);
    expect(res.body.reset.map((k: Json) => `${k.app} ${k.jobId}`).sort()).toEqual([
      "report 20140602",
      "summary acme",
    ]);
    const mid = await jobs("p-again");
    expect(mid.get("summary acme")).toMatchObject({ state: "queued" });
    expect(mid.get("summary acme").bundle_uuid).not.toBe(before.get("summary acme").bundle_uuid);
    expect(mid.get("report 20140602")).toMatchObject({ state: "waiting", bundle_uuid: null });
    expect(mid.get("summary globex").bundle_uuid).toBe(before.get("summary globex").bundle_uuid);
    const ran = await drive("p-again");
    expect(ran.map((b) => b.name)).toEqual(["summary.acme", "report.20140602"]);
  });

  it("two managers racing make one bundle per job, and a manager started later catches up", async () => {
    await apply("p-race");
    await run("p-race", "report", "20140602");
    // Finish the six ingests with no manager running.
    for (const b of (await bundlesOf("p-race")).filter(waiting)) await finish(b, 0);
    const a = newManager();
    const b = newManager();
    await Promise.all([a.runOnce(), b.runOnce(), a.runOnce(), b.runOnce()]);
    const all = await jobs("p-race");
    const queued = [...all.values()].filter((j) => j.state === "queued");
    // Two audits and three summaries started, each with one bundle.
    expect(queued.map((j) => `${j.app} ${j.job_id}`).sort()).toEqual([
      "audit 20140602_acme",
      "audit 20140602_globex",
      "summary acme",
      "summary globex",
      "summary initech",
    ]);
    expect((await bundlesOf("p-race")).length).toBe(6 + 5);
  });

  it("a pipeline whose stored definition no longer validates says so, and does not keep the manager from others", async () => {
    // Pages of one job, and the broken pipeline's five ready jobs come first (names in order): the manager must
    // get past them to the other pipeline's job in the same pass.
    const { logger, lines } = capturingLogger("error");
    const paged = testPipelineManager(getDb(), { batchSize: 1, logger });
    await apply("p-a-broken");
    await apply("p-b-fine");
    await run("p-a-broken", "report", "20140602");
    await run("p-b-fine", "audit", "20140602_acme");
    for (const b of (await bundlesOf("")).filter(waiting)) await finish(b, 0);
    // A definition stored by an older server that this one no longer accepts.
    await getDb().query(
      "UPDATE pipelines SET definition = $3::jsonb, digest = 'stale' WHERE owner_uuid = $1 AND name = $2",
      [alice.uuid, "p-a-broken", JSON.stringify({ name: "p-a-broken", apps: {}, colour: "blue" })],
    );
    await paged.runOnce();
    expect((await jobs("p-b-fine")).get("audit 20140602_acme").state).toBe("queued");
    const broken = await status("p-a-broken", "summary", "acme");
    expect(broken.state).toBe("waiting");
    expect(broken.reason).toMatch(
      /^waiting: the stored definition of this pipeline is no longer valid: .*colour/,
    );
    expect((await status("p-a-broken", "report", "20140602")).reason).toMatch(/no longer valid/);
    // Said once in the log for this stored version, not at every pass.
    await paged.runOnce();
    expect(lines.map((l) => l["msg"])).toEqual(["a stored pipeline definition is no longer valid"]);
    // Storing it again lets its jobs go on, and the reason goes, also from jobs still waiting for parents.
    await apply("p-a-broken");
    expect((await status("p-a-broken", "report", "20140602")).reason).toBeNull();
    await paged.runOnce();
    const mended = await status("p-a-broken", "summary", "acme");
    expect(mended.state).toBe("queued");
    expect(mended.reason).toBeNull();
  });

  it("finished jobs the manager cannot move do not keep it from the others", async () => {
    await apply("p-jam");
    await run("p-jam", "report", "20140602");
    for (const b of (await bundlesOf("p-jam")).filter(waiting)) await finish(b, 0);
    // Every ingest but one fails to move, by a real error of the database (a trigger of this test's own).
    const ok = "20140602_initech";
    await getDb().query(`CREATE FUNCTION p_jam_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
      BEGIN RAISE EXCEPTION 'refused by the test'; END $$`);
    await getDb().query(`CREATE TRIGGER p_jam_refuse BEFORE UPDATE ON pipeline_jobs FOR EACH ROW
      WHEN (OLD.pipeline = 'p-jam' AND OLD.state = 'queued' AND OLD.job_id <> '${ok}')
      EXECUTE FUNCTION p_jam_refuse()`);
    try {
      // Pages of one job: the ingest that can move is reached whatever the order.
      await testPipelineManager(getDb(), { batchSize: 1 }).runOnce();
      const all = await jobs("p-jam");
      expect(all.get(`ingest ${ok}`).state).toBe("completed");
      expect([...all.values()].filter((j) => j.app === "ingest" && j.state === "queued").length).toBe(5);
    } finally {
      await getDb().query("DROP TRIGGER p_jam_refuse ON pipeline_jobs");
      await getDb().query("DROP FUNCTION p_jam_refuse()");
    }
    // Once the database takes them, the next pass moves them.
    await manager.runOnce();
    const after = await jobs("p-jam");
    expect([...after.values()].filter((j) => j.app === "ingest" && j.state !== "completed")).toEqual([]);
  });

  it("the manager's loop wakes on a finished bundle", async () => {
    await apply("p-wake");
    await run("p-wake", "ingest", "20140601_acme");
    const m = newManager();
    await m.start();
    try {
      const [b] = await bundlesOf("p-wake");
      await finish(b!, 0);
      for (let i = 0; i < 200; i++) {
        if ((await jobs("p-wake")).get("ingest 20140601_acme").state === "completed") break;
        await new Promise((r) => setTimeout(r, 50));
      }
      expect((await jobs("p-wake")).get("ingest 20140601_acme").state).toBe("completed");
    } finally {
      await m.stop();
    }
  });
});
