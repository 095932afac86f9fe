/**
 * `workers token create|list|disable|enable`: the caller's own machines as workers (docs/workers.md). A new
 * worker's token is printed once, on stdout (its id and how to start it on stderr); nothing else shows it.
 */
import { CLIENT_OPTIONS, parse } from "../args.ts";
import { type CliIo, EXIT_FAILED, EXIT_OK, usageError } from "../io.ts";
import { connect, table } from "./client-common.ts";

const USAGE = `usage: dispatch-cloud workers token create [--name NAME] [--json]
       dispatch-cloud workers list [--all] [--json]      (--all: every user's workers; admins only)
       dispatch-cloud workers disable ID...
       dispatch-cloud workers enable ID...`;

/** A worker as the API shows it (rest-server/workers/). */
export interface WorkerView {
  id: string;
  ownerUuid: string;
  name: string;
  state: string;
  disabled: boolean;
  tags: string[];
  resources: { vcpus: number; ram: number; freeDisk: number; gpu: unknown } | null;
  slots: number;
  version: string | null;
  artifactSha256: string | null;
  cachedTrees: number;
  running: { uuid: string; attempt: number }[];
  createdAt: string;
  checkedInAt: string | null;
  checkinAgeMs: number | null;
}

export async function workersCommand(io: CliIo): Promise<number> {
  const [sub, ...rest] = io.argv;
  switch (sub) {
    case "token":
      if (rest[0] !== "create") throw usageError(USAGE);
      return create(io, rest.slice(1));
    case "list":
      return list(io, rest);
    case "disable":
    case "enable":
      return setDisabled(io, rest, sub);
    default:
      throw usageError(sub === undefined ? USAGE : `unknown workers command "${sub}"\n${USAGE}`);
  }
}

async function create(io: CliIo, argv: string[]): Promise<number> {
  const { values } = parse(argv, { ...CLIENT_OPTIONS, name: { type: "string" } }, false);
  const api = await connect(io, values);
  const body = values.name === undefined ? {} : { name: values.name };
  const made = await api.request<{ worker: WorkerView; token: string }>("POST", "api/v1/workers", body);
  if (values.json === true) {
    io.out(JSON.stringify(made, null, 2));
    return EXIT_OK;
  }
  io.err(`created worker ${made.worker.id} (${made.worker.name}); its token, shown only this once, follows.`);
  io.err("Save it to a file (mode 0600) and start the worker on your machine with:");
  io.err(`  dispatch-cloud worker --api-url URL --worker-id ${made.worker.id} --token-file FILE`);
  io.out(made.token);
  return EXIT_OK;
}

/** "12s", "3m4s", "never". */
export function checkinAge(ms: number | null): string {
  if (ms === null) return "never";
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${s % 60}s`;
  if (s < 86_400) return `${Math.floor(s / 3600)}h${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86_400)}d`;
}

async function list(io: CliIo, argv: string[]): Promise<number> {
  const { values } = parse(argv, { ...CLIENT_OPTIONS, all: { type: "boolean" } }, false);
  const api = await connect(io, values);
  const q = values.all === true ? "?all=true" : "";
  const { items } = await api.request<{ items: WorkerView[] }>("GET", `api/v1/workers${q}`);
  if (values.json === true) {
    io.out(JSON.stringify(items, null, 2));
    return EXIT_OK;
  }
  const rows = [["ID", "NAME", "OWNER", "STATE", "SLOTS", "RUNNING", "CHECK-IN", "VERSION", "TAGS"]];
  for (const w of items) {
    rows.push([
      w.id,
      w.name,
      w.ownerUuid,
      w.disabled ? `${w.state},disabled` : w.state,
      String(w.slots),
      String(w.running.length),
      checkinAge(w.checkinAgeMs),
      w.version ?? "-",
      w.tags.join(",") || "-",
    ]);
  }
  for (const line of table(rows)) io.out(line);
  return EXIT_OK;
}

async function setDisabled(io: CliIo, argv: string[], what: "disable" | "enable"): Promise<number> {
  const { values, positionals } = parse(argv, CLIENT_OPTIONS);
  if (positionals.length === 0) throw usageError(`workers ${what} takes one or more worker IDs`);
  const api = await connect(io, values);
  let failed = 0;
  for (const id of positionals) {
    try {
      await api.request<unknown>("POST", `api/v1/workers/${encodeURIComponent(id)}/${what}`);
      io.out(`${id}: ${what}d`);
    } catch (err) {
      failed++;
      const code = (err as { code?: unknown }).code;
      io.out(`${id}: error: ${err instanceof Error ? err.message : String(err)}${code ? ` [${code}]` : ""}`);
    }
  }
  return failed === 0 ? EXIT_OK : EXIT_FAILED;
}
