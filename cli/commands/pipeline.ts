/**
 * `pipeline check|apply|list|run|rerun|status` (docs/pipelines.md): check a definition file locally, store it on
 * the server, run a job (bubble up), rerun one, and show a job with its ancestors as a tree.
 */
import { readFile } from "node:fs/promises";
import { resolve } from "node:path";
import { DispatchCloudError } from "../../lib/errors.ts";
import { type PipelineDefinition, parseYamlText, validatePipeline } from "../../lib/pipeline/definition.ts";
import { CLIENT_OPTIONS, parse } from "../args.ts";
import type { ApiClient } from "../client.ts";
import { type CliIo, EXIT_OK, usageError } from "../io.ts";
import { connect, table } from "./client-common.ts";
import { pipelineCheck } from "./pipeline-check.ts";

const USAGE = `usage: dispatch-cloud pipeline check FILE
       dispatch-cloud pipeline apply FILE
       dispatch-cloud pipeline list [--json]
       dispatch-cloud pipeline run (-p NAME | -f FILE) APP JOB_ID [--json]
       dispatch-cloud pipeline rerun (-p NAME | -f FILE) APP JOB_ID [--descendants] [--json]
       dispatch-cloud pipeline status (-p NAME | -f FILE) APP JOB_ID [--json]
(run -f FILE applies the file first; rerun and status -f FILE only take the pipeline's name from it)`;

/** A job as the API shows it (rest-server/pipelines/routes.ts JobView). */
interface ApiJob {
  app: string;
  jobId: string;
  state: string;
  bundleUuid: string | null;
  attempts: number;
  reason: string | null;
  failedParent: { app: string; jobId: string } | null;
}

interface ApiJobNode extends ApiJob {
  bundleState: string | null;
  repeated?: true;
  parents: ApiJobNode[];
}

const JOB_OPTIONS = {
  ...CLIENT_OPTIONS,
  pipeline: { type: "string", short: "p" },
  file: { type: "string", short: "f" },
  descendants: { type: "boolean" },
} as const;

export async function pipelineCommand(io: CliIo): Promise<number> {
  const [sub, ...rest] = io.argv;
  switch (sub) {
    case "check": {
      if (rest.length !== 1 || rest[0]!.startsWith("-")) throw usageError(USAGE);
      return pipelineCheck(io, rest[0]!);
    }
    case "apply":
      return apply(io, rest);
    case "list":
      return list(io, rest);
    case "run":
      return run(io, rest);
    case "rerun":
      return rerun(io, rest);
    case "status":
      return status(io, rest);
    default:
      throw usageError(sub === undefined ? USAGE : `unknown pipeline command "${sub}"\n${USAGE}`);
  }
}

/** A definition file: its structure (what the server stores) and, checked here first, the definition. */
interface DefinitionFile {
  raw: unknown;
  def: PipelineDefinition;
}

async function readDefinition(io: CliIo, file: string): Promise<DefinitionFile> {
  let text: string;
  try {
    text = await readFile(resolve(io.cwd, file), "utf8");
  } catch (err) {
    throw new DispatchCloudError("cli.usage", `cannot read ${file}: ${(err as Error).message}`);
  }
  try {
    const raw = parseYamlText(text);
    return { raw, def: validatePipeline(raw) };
  } catch (err) {
    if (err instanceof DispatchCloudError && err.path !== undefined) {
      throw new DispatchCloudError(err.code, `${file}: ${err.path}: ${err.message}`, { cause: err });
    }
    throw err;
  }
}

async function put(api: ApiClient, f: DefinitionFile): Promise<{ name: string; digest: string }> {
  return api.request<{ name: string; digest: string }>(
    "PUT",
    `api/v1/pipelines/${encodeURIComponent(f.def.name)}`,
    { definition: f.raw },
  );
}

async function apply(io: CliIo, argv: string[]): Promise<number> {
  const { values, positionals } = parse(argv, CLIENT_OPTIONS);
  if (positionals.length !== 1) throw usageError(`pipeline apply takes one FILE\n${USAGE}`);
  const f = await readDefinition(io, positionals[0]!);
  const def = f.def;
  const api = await connect(io, values);
  const p = await put(api, f);
  if (values.json === true) io.out(JSON.stringify(p, null, 2));
  else
    io.out(
      `pipeline ${p.name} applied (${Object.keys(def.apps).length} apps, digest ${p.digest.slice(0, 12)})`,
    );
  return EXIT_OK;
}

async function list(io: CliIo, argv: string[]): Promise<number> {
  const { values, positionals } = parse(argv, CLIENT_OPTIONS);
  if (positionals.length !== 0) throw usageError(USAGE);
  const api = await connect(io, values);
  const { items } = await api.request<{
    items: { name: string; apps: string[]; jobs: Record<string, number>; updatedAt: string }[];
  }>("GET", "api/v1/pipelines");
  if (values.json === true) {
    io.out(JSON.stringify(items, null, 2));
    return EXIT_OK;
  }
  const rows = [["NAME", "APPS", "JOBS", "UPDATED"]];
  for (const p of items) {
    const jobs = Object.entries(p.jobs)
      .map(([s, n]) => `${n} ${s}`)
      .join(", ");
    rows.push([p.name, p.apps.join(","), jobs === "" ? "none" : jobs, p.updatedAt]);
  }
  for (const line of table(rows)) io.out(line);
  return EXIT_OK;
}

/** The pipeline's name and the job from `(-p NAME | -f FILE) APP JOB_ID`; for run, -f stores the file first. */
async function jobArgs(io: CliIo, argv: string[], verb: "run" | "rerun" | "status") {
  const { values, positionals } = parse(argv, JOB_OPTIONS);
  if (positionals.length !== 2) throw usageError(`give APP and JOB_ID\n${USAGE}`);
  if (values.descendants === true && verb !== "rerun")
    throw usageError(`--descendants is for rerun\n${USAGE}`);
  const name = values.pipeline;
  const file = values.file;
  if ((name === undefined) === (file === undefined))
    throw usageError(`give -p NAME or -f FILE (one of them)\n${USAGE}`);
  const api = await connect(io, values);
  let pipeline = name ?? "";
  if (file !== undefined) {
    const f = await readDefinition(io, file);
    pipeline = f.def.name;
    if (verb === "run") await put(api, f);
  }
  return { api, values, pipeline, app: positionals[0]!, jobId: positionals[1]! };
}

const path = (pipeline: string, verb: string) => `api/v1/pipelines/${encodeURIComponent(pipeline)}/${verb}`;

async function run(io: CliIo, argv: string[]): Promise<number> {
  const { api, values, pipeline, app, jobId } = await jobArgs(io, argv, "run");
  const r = await api.request<{ job: ApiJob; created: { app: string; jobId: string }[]; started: number }>(
    "POST",
    path(pipeline, "run"),
    { app, jobId },
  );
  if (values.json === true) {
    io.out(JSON.stringify(r, null, 2));
    return EXIT_OK;
  }
  io.out(
    r.created.length === 0
      ? `${app} ${jobId}: ${r.job.state}; nothing new (every job it needs exists)`
      : `${app} ${jobId}: ${r.job.state}; ${r.created.length} job(s) created, ${r.started} started now`,
  );
  return EXIT_OK;
}

async function rerun(io: CliIo, argv: string[]): Promise<number> {
  const { api, values, pipeline, app, jobId } = await jobArgs(io, argv, "rerun");
  const r = await api.request<{ job: ApiJob; reset: { app: string; jobId: string }[]; started: number }>(
    "POST",
    path(pipeline, "rerun"),
    { app, jobId, descendants: values.descendants === true },
  );
  if (values.json === true) io.out(JSON.stringify(r, null, 2));
  else
    io.out(
      `${app} ${jobId}: ${r.job.state}; ${r.reset.length} job(s) pending again, ${r.started} started now`,
    );
  return EXIT_OK;
}

/** One line per job: `app job_id  state  bundle  (reason)`, parents indented below their child. */
export function formatJobTree(root: ApiJobNode): string[] {
  const lines: string[] = [];
  const walk = (n: ApiJobNode, depth: number) => {
    const bundle =
      n.bundleUuid === null ? "-" : `${n.bundleUuid}${n.bundleState === null ? "" : ` (${n.bundleState})`}`;
    const notes = [
      n.attempts > 1 ? `attempt ${n.attempts}` : "",
      n.reason ?? "",
      n.repeated === true ? "(its parents are shown above)" : "",
    ].filter((s) => s !== "");
    lines.push(
      `${"  ".repeat(depth)}${n.app} ${n.jobId}  ${n.state}  ${bundle}${notes.length === 0 ? "" : `  ${notes.join("; ")}`}`,
    );
    for (const p of n.parents) walk(p, depth + 1);
  };
  walk(root, 0);
  return lines;
}

async function status(io: CliIo, argv: string[]): Promise<number> {
  const { api, values, pipeline, app, jobId } = await jobArgs(io, argv, "status");
  const r = await api.request<{ job: ApiJobNode }>(
    "GET",
    `${path(pipeline, "jobs")}/${encodeURIComponent(app)}/${encodeURIComponent(jobId)}`,
  );
  if (values.json === true) io.out(JSON.stringify(r, null, 2));
  else for (const line of formatJobTree(r.job)) io.out(line);
  return EXIT_OK;
}
