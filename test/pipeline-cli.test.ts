/**
 * `dispatch-cloud pipeline apply|list|run|rerun|status` in-process against a real REST server on a port (PGlite),
 * with the pipeline manager moving jobs as the test finishes their bundles.
 */
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../cli/cli.ts";
import type { CliIo } from "../cli/io.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import type { PipelineManager } from "../rest-server/pipelines/manager.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createUser, getBundle } from "../store/queries.ts";
import { openTestDb, type TestDb } from "./db.ts";
import { etlPipelineYaml, runBundleToEnd, testPipelineManager } from "./pipeline-fixtures.ts";

describe("CLI: pipeline", () => {
  let db: TestDb;
  let app: FastifyInstance;
  let manager: PipelineManager;
  let apiUrl: string;
  let dir: string;
  const token = newUserToken();
  let owner: string;

  const cli = async (...argv: string[]) => {
    const out: string[] = [];
    const err: string[] = [];
    const io: CliIo = {
      argv,
      env: { DISPATCH_CLOUD_API_URL: apiUrl, DISPATCH_CLOUD_TOKEN: token },
      cwd: dir,
      out: (l) => out.push(l),
      err: (l) => err.push(l),
      progress: (l) => err.push(l),
    };
    const code = await runCli(io);
    return { code, out, err };
  };
  /**
   * Finishes every waiting bundle of the user (staged, or created: those with parents wait for the manager) with
   * exit code 0, then runs the manager; until none is left.
   */
  const drive = async () => {
    for (;;) {
      const { rows } = await db.query<{ uuid: string; state: string }>(
        "SELECT uuid, state FROM bundles WHERE owner_uuid = $1 AND state IN ('created', 'staged')",
        [owner],
      );
      if (rows.length === 0) return;
      for (const { uuid } of rows) await runBundleToEnd(db, uuid);
      await manager.runOnce();
    }
  };

  beforeAll(async () => {
    db = await openTestDb("pglite");
    dir = await mkdtemp(join(tmpdir(), "dc-pipeline-cli-"));
    owner = newUserUuid("zzzzz");
    await createUser(db, { uuid: owner, name: "cli", isAdmin: false, tokenHash: hashToken(token) });
    app = await createRestServer({
      db,
      logger: false,
      clusterId: "zzzzz",
      maxRequestBodySize: 2 ** 20,
      defaultMaxAttempts: 3,
      dataDir: join(dir, "data"),
    });
    apiUrl = await app.listen({ host: "127.0.0.1", port: 0 });
    manager = testPipelineManager(db);
    await writeFile(join(dir, "etl.yml"), etlPipelineYaml());
    await writeFile(
      join(dir, "bad.yml"),
      etlPipelineYaml().replace("app_name: ingest\n", "app_name: ingst\n"),
    );
  });
  afterAll(async () => {
    await app?.close();
    await db?.close();
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  it("apply refuses a bad file naming the key path, and stores a good one", async () => {
    const bad = await cli("pipeline", "apply", "bad.yml");
    expect(bad.code).toBe(1);
    expect(bad.err.join("\n")).toMatch(
      /bad\.yml: apps\.audit\.depends_on\.app_name: .*ingst.*\[pipeline\.invalid\]/,
    );
    const good = await cli("pipeline", "apply", "etl.yml");
    expect(good).toMatchObject({
      code: 0,
      out: [expect.stringMatching(/^pipeline etl applied \(4 apps, digest/)],
    });
    const list = await cli("pipeline", "list");
    expect(list.out[1]).toMatch(/^etl\s+audit,ingest,report,summary\s+none\s/);
  });

  it("refuses ambiguous or incomplete command lines with a usage error", async () => {
    for (const argv of [
      ["pipeline", "run", "report", "20140602"],
      ["pipeline", "run", "-p", "etl", "-f", "etl.yml", "report", "20140602"],
      ["pipeline", "run", "-p", "etl", "report"],
      ["pipeline", "status", "-p", "etl", "--descendants", "report", "20140602"],
      ["pipeline", "frobnicate"],
    ]) {
      const r = await cli(...argv);
      expect(r.code, argv.join(" ")).toBe(2);
      expect(r.err.join("\n")).toContain("[cli.usage]");
    }
  });

  it("runs a job, shows its tree, and reruns it with its descendants", async () => {
    const first = await cli("pipeline", "run", "-f", "etl.yml", "summary", "acme");
    expect(first.out).toEqual(["summary acme: waiting; 3 job(s) created, 2 started now"]);
    const bad = await cli("pipeline", "run", "-p", "etl", "summary", "acme_x");
    expect(bad.code).toBe(1);
    expect(bad.err.join("\n")).toContain("[pipeline.invalid_job_id]");
    await drive();
    const status = await cli("pipeline", "status", "-p", "etl", "summary", "acme");
    expect(status.out.map((l) => l.replace(/zzzzz-bndl-\w+/, "B"))).toEqual([
      "summary acme  completed  B (ready)",
      "  ingest 20140601_acme  completed  B (ready)",
      "  ingest 20140602_acme  completed  B (ready)",
    ]);
    const json = JSON.parse(
      (await cli("pipeline", "status", "-p", "etl", "summary", "acme", "--json")).out.join("\n"),
    );
    expect(json.job.parents).toHaveLength(2);

    const rerun = await cli("pipeline", "rerun", "-p", "etl", "ingest", "20140601_acme", "--descendants");
    expect(rerun.out).toEqual(["ingest 20140601_acme: queued; 2 job(s) pending again, 1 started now"]);
    const mid = await cli("pipeline", "status", "-p", "etl", "summary", "acme");
    expect(mid.out[0]).toBe("summary acme  waiting  -");
    await drive();
    const after = await cli("pipeline", "status", "-p", "etl", "summary", "acme", "--json");
    const job = JSON.parse(after.out.join("\n")).job;
    expect(job.state).toBe("completed");
    const b = await getBundle(db, job.bundleUuid);
    expect(b?.dependencies.map((d) => d.name)).toEqual(["ingest.20140601_acme", "ingest.20140602_acme"]);
  });
});
