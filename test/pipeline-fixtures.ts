/**
 * The pipeline the running tests share (test/pipeline-rest.test.ts, test/e2e-pipeline.test.ts): four apps over
 * fields `date` and `client`.
 *
 * - ingest `{date}_{client}`: the fan-out, one job per client per date of 20140601:20140602; max_attempts 2, and
 *   the job `failOnce` fails its first bundle (when `flag` is given: while that file does not exist it creates it
 *   and exits 3).
 * - audit `{date}_{client}`: valid_if_or client acme or globex (initech's are skipped); its parent is the ingest
 *   job of the same id.
 * - summary `{client}`: a fan-in over dates: every ingest job of the client (date: all).
 * - report `{date}`: OR groups. `checked` (matches every date) = the summary of every client AND the audit of
 *   every client of that date; `legacy` matches only date 20140601 (ingest 20140601_acme), so a 20140601 report
 *   has the parents of both groups (every matching group gives parents) and a 20140602 report those of `checked`.
 *
 * So `run report 20140602` needs 13 jobs: report, 3 summaries, 6 ingests, 3 audits of which initech's is skipped:
 * 12 bundles.
 */
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import type { Logger } from "../lib/logger.ts";
import { createPipelineManager, type PipelineManager } from "../rest-server/pipelines/manager.ts";
import type { SubmitLimits } from "../rest-server/quotas.ts";
import { createRestServer } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";
import { getBundle } from "../store/queries.ts";
import { finishBundle, markRunning, stageBundle, startBundle } from "../store/transitions.ts";
import { silentLogger } from "./fixtures.ts";

export const FAIL_ONCE = "20140601_globex";

export function etlPipelineYaml(opts: { name?: string; image?: string; flag?: string } = {}): string {
  const image = opts.image ?? "busybox";
  const failOnce =
    opts.flag === undefined
      ? ""
      : `if [ "{job_id}" = ${FAIL_ONCE} ] && [ ! -e "$FLAG" ]; then touch "$FLAG"; exit 3; fi; `;
  return `name: ${opts.name ?? "etl"}
fields:
  date: date
  client: str
apps:
  ingest:
    job_id: "{date}_{client}"
    max_attempts: 2
    autofill_values:
      date: "20140601:20140602"
      client: [acme, globex, initech]
    bundle:
      image: ${image}
      env:
        FLAG: "${opts.flag ?? "/nonexistent"}"
      resources: {vcpus: 1, ram: 128MiB}
      command: [sh, -c, '${failOnce}echo "{client} {date}" > "$DISPATCH_OUTPUT_DIR/rows"']
  audit:
    job_id: "{date}_{client}"
    autofill_values:
      date: "20140601:20140602"
      client: [acme, globex, initech]
    valid_if_or:
      client: [acme, globex]
    depends_on:
      app_name: ingest
    bundle:
      image: ${image}
      resources: {vcpus: 1, ram: 128MiB}
      command: [sh, -c, 'cp "$DISPATCH_INPUT_DIR/ingest.{job_id}/rows" "$DISPATCH_OUTPUT_DIR/audited"']
  summary:
    job_id: "{client}"
    autofill_values:
      client: [acme, globex, initech]
    depends_on:
      app_name: ingest
      date: all
    bundle:
      image: ${image}
      resources: {vcpus: 1, ram: 128MiB}
      command: [sh, -c, 'cat "$DISPATCH_INPUT_DIR"/*/rows | sort > "$DISPATCH_OUTPUT_DIR/rows"']
  report:
    job_id: "{date}"
    autofill_values:
      date: "20140601:20140602"
    depends_on:
      checked:
        - app_name: summary
          client: all
        - app_name: audit
          client: all
      legacy:
        app_name: ingest
        date: ["20140601"]
        client: [acme]
    bundle:
      image: ${image}
      resources: {vcpus: 1, ram: 128MiB}
      command: [sh, -c, 'ls "$DISPATCH_INPUT_DIR" > "$DISPATCH_OUTPUT_DIR/parents"; cat "$DISPATCH_INPUT_DIR"/summary.*/rows | sort > "$DISPATCH_OUTPUT_DIR/rows"']
`;
}

/** The jobs `run report 20140602` needs, as `app jobId`. */
export const REPORT_JOBS = [
  "audit 20140602_acme",
  "audit 20140602_globex",
  "audit 20140602_initech",
  "ingest 20140601_acme",
  "ingest 20140601_globex",
  "ingest 20140601_initech",
  "ingest 20140602_acme",
  "ingest 20140602_globex",
  "ingest 20140602_initech",
  "report 20140602",
  "summary acme",
  "summary globex",
  "summary initech",
];

/** A pipeline manager on `db` as the running tests use it (silent, cluster zzzzz, no image resolvers). */
export function testPipelineManager(
  db: Db,
  opts: { batchSize?: number; submitLimits?: SubmitLimits; logger?: Logger } = {},
): PipelineManager {
  return createPipelineManager({
    db,
    logger: silentLogger,
    clusterId: "zzzzz",
    defaultMaxAttempts: 3,
    bundleMinimums: { ram: 16 * 2 ** 20, vcpus: 0.01 },
    imageResolvers: [],
    ...opts,
  });
}

/**
 * Runs an open bundle to its end as a runner would (staging it first when it was created with dependencies):
 * started on a made-up instance, running, finished with `exitCode`. Returns whether the finish was accepted.
 */
export async function runBundleToEnd(db: Db, uuid: string, exitCode = 0): Promise<boolean> {
  if ((await getBundle(db, uuid))?.state === "created") await stageBundle(db, uuid, { actor: "test" });
  await startBundle(db, uuid, {
    instanceId: "i-1",
    instanceType: "small",
    runnerTokenHash: `h-${uuid}`,
    gpuDevices: [],
    actor: "test",
  });
  await markRunning(db, uuid, 1, { actor: "test" });
  return (await finishBundle(db, uuid, 1, { exitCode, actor: "test" })).ok;
}

/** A REST server on `db` for the pipeline tests (cluster zzzzz, not listening: inject requests), with `quotas`. */
export function pipelineTestServer(
  db: Db,
  dataDirName: string,
  quotas?: SubmitLimits & { maxTokensPerUser: number },
): Promise<FastifyInstance> {
  return createRestServer({
    db,
    logger: false,
    clusterId: "zzzzz",
    maxRequestBodySize: 1024 * 1024,
    defaultMaxAttempts: 3,
    dataDir: join(tmpdir(), dataDirName),
    ...(quotas === undefined ? {} : { quotas }),
  });
}
