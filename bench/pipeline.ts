/**
 * `npm run bench:pipeline`: the bubble up of `pipeline run` for a job with 10,000 ancestors, through the REST
 * route (`POST /api/v1/pipelines/:name/run`, app.inject), on PGlite and PostgreSQL (DISPATCH_CLOUD_TEST_PG_URL).
 * No dispatcher: bundles are only inserted. Figures only, nothing asserted.
 *
 * The pipeline: `raw {date}_{client}` (100 days x 100 clients = 10,000 jobs, no parents), `daily {date}` (each
 * the fan-in of its day's 100 raw jobs), `total {run}` (the fan-in of the 100 daily jobs). `run total 1` stores
 * 10,101 jobs and 20,100 parent edges and starts the 10,000 raw jobs (10,000 bundles, one notification); a second
 * run finds every job stored and creates nothing. Timed: each request, end to end; then the same run on a second
 * pipeline by calling bubbleUp (rest-server/pipelines/jobs.ts) directly, which reports its three phases: the walk
 * up the graph (parentsOf, and which jobs exist), storing the jobs and edges, and starting the ready jobs.
 *
 *   npm run bench:pipeline -- [--days 100] [--clients 100] [--db pg|pglite]
 */
import { loadavg, tmpdir } from "node:os";
import { join } from "node:path";
import { parseYamlText, validatePipeline } from "../lib/pipeline/definition.ts";
import { bubbleUp } from "../rest-server/pipelines/jobs.ts";
import { createRestServer } from "../rest-server/server.ts";
import { upsertPipeline } from "../store/pipeline-queries.ts";
import { createTestUserWithToken, type DbKind, openTestDb } from "../test/db.ts";
import { silentLogger } from "../test/fixtures.ts";
import { injectClient } from "../test/rest-client.ts";

const arg = (name: string, def: string): string => {
  const i = process.argv.indexOf(`--${name}`);
  return i < 0 ? def : (process.argv[i + 1] ?? def);
};
const DAYS = Number(arg("days", "100"));
const CLIENTS = Number(arg("clients", "100"));
const KINDS = arg("db", "pglite,pg").split(",") as DbKind[];

function day(i: number): string {
  const d = new Date(Date.UTC(2014, 0, 1) + i * 86_400_000);
  return d.toISOString().slice(0, 10).replaceAll("-", "");
}

const clients = Array.from({ length: CLIENTS }, (_, i) => `c${String(i).padStart(3, "0")}`);
const YAML = `name: bench
fields:
  date: date
  client: str
  run: int
apps:
  raw:
    job_id: "{date}_{client}"
    autofill_values:
      date: "${day(0)}:${day(DAYS - 1)}"
      client: [${clients.join(", ")}]
    bundle:
      image: busybox
      command: [echo, "{job_id}"]
  daily:
    job_id: "{date}"
    autofill_values:
      date: "${day(0)}:${day(DAYS - 1)}"
    depends_on:
      app_name: raw
      client: all
    bundle:
      image: busybox
      command: [echo, "{job_id}"]
  total:
    job_id: "{run}"
    autofill_values:
      run: [1]
    depends_on:
      app_name: daily
      date: all
    bundle:
      image: busybox
      command: [echo, "{job_id}"]
`;

async function bench(kind: DbKind): Promise<void> {
  const db = await openTestDb(kind);
  const app = await createRestServer({
    db,
    logger: false,
    clusterId: "bench",
    maxRequestBodySize: 4 * 2 ** 20,
    defaultMaxAttempts: 3,
    dataDir: join(tmpdir(), "dispatch-cloud-bench-pipeline"),
  });
  try {
    const api = injectClient(app);
    const { token } = await createTestUserWithToken(db);
    const put = await api("PUT", "/api/v1/pipelines/bench", token, { definition: parseYamlText(YAML) });
    if (put.status !== 201) throw new Error(`PUT: ${put.status} ${JSON.stringify(put.body)}`);
    for (const round of ["first", "second"]) {
      const load = loadavg()[0]!.toFixed(2);
      const t0 = performance.now();
      const res = await api("POST", "/api/v1/pipelines/bench/run", token, { app: "total", jobId: "1" });
      const ms = performance.now() - t0;
      if (res.status !== 200) throw new Error(`run: ${res.status} ${JSON.stringify(res.body)}`);
      console.log(
        `${kind}: ${round} run of total 1 (${DAYS * CLIENTS + DAYS} ancestors): ${res.body.created.length} jobs created, ` +
          `${res.body.started} started, ${(ms / 1000).toFixed(2)} s (load average ${load})`,
      );
    }
    const { uuid } = await createTestUserWithToken(db);
    const raw = { ...(parseYamlText(YAML) as object), name: "phases" };
    await upsertPipeline(db, { ownerUuid: uuid, name: "phases", definition: raw, digest: "bench" });
    const env = {
      db,
      clusterId: "bench",
      defaultMaxAttempts: 3,
      bundleMinimums: { ram: 16 * 2 ** 20, vcpus: 0.01 },
      imageResolvers: [],
      logger: silentLogger,
    };
    const t0 = performance.now();
    const r = await bubbleUp(env, uuid, "phases", validatePipeline(raw), { app: "total", jobId: "1" });
    const s = (ms: number) => `${(ms / 1000).toFixed(2)} s`;
    console.log(
      `${kind}: bubbleUp alone: ${r.created.length} jobs, ${r.started} started, ${s(performance.now() - t0)}: ` +
        `walk ${s(r.timings.walkMs)}, store ${s(r.timings.storeMs)}, start ${s(r.timings.startMs)} ` +
        `(load average ${loadavg()[0]!.toFixed(2)})`,
    );
  } finally {
    await app.close();
    await db.close();
  }
}

for (const kind of KINDS) await bench(kind);
