/**
 * End to end, a pipeline (docs/pipelines.md) on the local driver: `serve` on PGlite with a local VM behind the
 * embedded SSH server, the process runtime, and the CLI. The pipeline of test/pipeline-fixtures.ts has four apps:
 * a fan-out by client over a date range (ingest), a fan-in (summary, and report over everything), an OR group
 * (report's `checked` and `legacy`) and a valid_if_or skip (audit for initech). `pipeline run` on the last app
 * creates exactly the bundles needed; they run in an order that respects every dependency (from their events);
 * the fan-in reads all its parents' outputs; the ingest job that fails once is retried; a second run creates
 * nothing.
 */
import { execFile } from "node:child_process";
import { randomBytes } from "node:crypto";
import { rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { E2eSystem, until } from "./e2e-harness.ts";
import { etlPipelineYaml, FAIL_ONCE, REPORT_JOBS } from "./pipeline-fixtures.ts";
import { BIN } from "./serve-process.ts";

const run = promisify(execFile);

interface JobNode {
  app: string;
  jobId: string;
  state: string;
  bundleUuid: string | null;
  attempts: number;
  parents: JobNode[];
}

interface Event {
  fromState: string | null;
  toState: string;
  createdAt: string;
}

describe("end to end: a pipeline of four apps on the local driver", () => {
  let sys: E2eSystem;
  let file: string;
  const flag = join(tmpdir(), `dc-e2e-pipeline-${randomBytes(6).toString("hex")}`);

  beforeAll(async () => {
    sys = await E2eSystem.start({
      database: "pglite",
      sshServer: "embedded",
      runtimeEngine: "process",
      maxInstances: 1,
    });
    file = join(sys.dir, "etl.yml");
    await writeFile(file, etlPipelineYaml({ flag }));
  }, 180_000);

  afterAll(async () => {
    await sys?.stop();
    await rm(flag, { force: true });
  }, 120_000);

  const cli = (...args: string[]) =>
    run(BIN, [...args, "--api-url", sys.apiUrl], {
      cwd: sys.dir,
      env: { ...process.env, DISPATCH_CLOUD_DATA_DIR: join(sys.dir, "data") },
      timeout: 120_000,
    });
  const allBundles = async () =>
    (
      await sys.json<{
        items: {
          uuid: string;
          name: string;
          state: string;
          dependencies: { bundle: string; name: string }[];
        }[];
      }>("GET", "/bundles?limit=500")
    ).items;
  const flatten = (n: JobNode, out = new Map<string, JobNode>()) => {
    out.set(`${n.app} ${n.jobId}`, n);
    for (const p of n.parents) flatten(p, out);
    return out;
  };

  it("runs exactly the needed bundles in dependency order, retries the flaky job, and a second run creates nothing", async () => {
    const check = await run(BIN, ["pipeline", "check", file], { cwd: sys.dir, timeout: 60_000 });
    expect(check.stdout).toContain("pipeline etl is valid: 4 apps");
    const first = await cli("pipeline", "run", "-f", file, "report", "20140602");
    expect(first.stdout).toContain("report 20140602: waiting; 13 job(s) created, 6 started now");

    const status = () =>
      sys.json<{ job: JobNode }>("GET", "/pipelines/etl/jobs/report/20140602").then((r) => r.job);
    const done = await until(
      "report 20140602 completes",
      async () => {
        const j = await status();
        if (j.state === "failed")
          throw new Error(`report failed: ${JSON.stringify(j)}\n${sys.output().slice(-4000)}`);
        return j.state === "completed" ? j : undefined;
      },
      300_000,
    );
    const jobs = flatten(done);
    expect([...jobs.keys()].sort()).toEqual(REPORT_JOBS);
    expect(jobs.get("audit 20140602_initech")).toMatchObject({ state: "skipped", bundleUuid: null });
    expect(jobs.get(`ingest ${FAIL_ONCE}`)).toMatchObject({ state: "completed", attempts: 2 });

    // Exactly the bundles needed: one per job that runs (12), and the flaky job's retry.
    const bundles = await allBundles();
    expect(bundles.length).toBe(13);
    expect(bundles.map((b) => b.name).sort()).toEqual(
      [...REPORT_JOBS.filter((k) => k !== "audit 20140602_initech"), `ingest ${FAIL_ONCE}`]
        .map((k) => k.replace(" ", "."))
        .sort(),
    );
    const flaky = bundles
      .filter((b) => b.name === `ingest.${FAIL_ONCE}`)
      .map((b) => b.state)
      .sort();
    expect(flaky).toEqual(["failed", "ready"]);

    // Dependency order, from the events: a bundle started running only after each dependency became ready.
    const eventsOf = async (uuid: string) =>
      (await sys.json<{ items: Event[] }>("GET", `/bundles/${uuid}/events`)).items;
    const readyAt = new Map<string, number>();
    for (const b of bundles) {
      const ready = (await eventsOf(b.uuid)).find((e) => e.toState === "ready");
      if (ready !== undefined) readyAt.set(b.uuid, Date.parse(ready.createdAt));
    }
    let checked = 0;
    for (const b of bundles) {
      const running = (await eventsOf(b.uuid)).find((e) => e.toState === "running");
      expect(running, b.name).toBeDefined();
      for (const d of b.dependencies) {
        expect(readyAt.get(d.bundle), `${b.name} <- ${d.name}`).toBeLessThanOrEqual(
          Date.parse(running!.createdAt),
        );
        checked++;
      }
    }
    expect(checked).toBe(5 + 3 * 2 + 2); // report's 5 parents, 3 summaries' 2 each, 2 audits' 1 each

    // The fan-ins read all their parents' outputs.
    const report = bundles.find((b) => b.name === "report.20140602")!;
    expect((await sys.text(`/bundles/${report.uuid}/outputs/parents`)).body.trim().split("\n")).toEqual([
      "audit.20140602_acme",
      "audit.20140602_globex",
      "summary.acme",
      "summary.globex",
      "summary.initech",
    ]);
    expect((await sys.text(`/bundles/${report.uuid}/outputs/rows`)).body).toBe(
      [
        "acme 20140601",
        "acme 20140602",
        "globex 20140601",
        "globex 20140602",
        "initech 20140601",
        "initech 20140602",
        "",
      ].join("\n"),
    );

    // The terminal's tree.
    const tree = (await cli("pipeline", "status", "-p", "etl", "report", "20140602")).stdout.split("\n");
    expect(tree[0]).toMatch(/^report 20140602 {2}completed {2}e2e01-bndl-\S+ \(ready\)$/);
    expect(tree).toContain("  audit 20140602_initech  skipped  -");

    // Again: nothing new.
    const again = await cli("pipeline", "run", "-p", "etl", "report", "20140602");
    expect(again.stdout).toContain("nothing new");
    expect((await allBundles()).length).toBe(13);
  }, 420_000);
});
