import { CLIENT_OPTIONS, parse } from "../args.ts";
import { type ApiClient, type ByteIo, copyToStdout } from "../client.ts";
import { type CliIo, EXIT_FAILED, EXIT_OK, usageError } from "../io.ts";
import { type ApiBundle, connect, table } from "./client-common.ts";

const USAGE = `usage: dispatch-cloud bundles list [--state S[,S]] [--limit N] [--all] [--json]
       dispatch-cloud bundles show UUID [--json]
       dispatch-cloud bundles kill UUID... [--reason TEXT]
       dispatch-cloud bundles events UUID [--json]
       dispatch-cloud bundles logs UUID [--stream stdout|stderr] [--attempt N] [--follow]
       dispatch-cloud bundles outputs UUID [PATH] [--json] [--page-size N]   (lists; a file's bytes go to stdout)`;

export async function bundlesCommand(io: CliIo): Promise<number> {
  const [sub, ...rest] = io.argv;
  switch (sub) {
    case "list":
      return list(io, rest);
    case "show":
      return show(io, rest);
    case "kill":
      return kill(io, rest);
    case "events":
      return events(io, rest);
    case "logs":
      return logs(io, rest);
    case "outputs":
      return outputs(io, rest);
    default:
      throw usageError(sub === undefined ? USAGE : `unknown bundles command "${sub}"\n${USAGE}`);
  }
}

async function list(io: CliIo, argv: string[]): Promise<number> {
  const { values } = parse(
    argv,
    { ...CLIENT_OPTIONS, state: { type: "string" }, limit: { type: "string" }, all: { type: "boolean" } },
    false,
  );
  const limit = values.limit === undefined ? 50 : Number(values.limit);
  if (!Number.isInteger(limit) || limit < 1 || limit > 500)
    throw usageError("--limit takes an integer 1..500");
  const api = await connect(io, values);
  const items: ApiBundle[] = [];
  let cursor: string | null = null;
  do {
    const q = new URLSearchParams({ limit: String(limit) });
    if (values.state !== undefined) q.set("state", values.state);
    if (cursor !== null) q.set("cursor", cursor);
    const page: { items: ApiBundle[]; nextCursor: string | null } = await api.request(
      "GET",
      `api/v1/bundles?${q}`,
    );
    items.push(...page.items);
    cursor = values.all === true ? page.nextCursor : null;
  } while (cursor !== null);
  if (values.json === true) {
    io.out(JSON.stringify(items, null, 2));
    return EXIT_OK;
  }
  const rows = [["UUID", "STATE", "CREATED", "NAME", "IMAGE"]];
  for (const b of items) rows.push([b.uuid, b.state, b.createdAt, b.name, b.image]);
  for (const line of table(rows)) io.out(line);
  return EXIT_OK;
}

async function show(io: CliIo, argv: string[]): Promise<number> {
  const { values, positionals } = parse(argv, CLIENT_OPTIONS);
  if (positionals.length !== 1) throw usageError("bundles show takes one UUID");
  const api = await connect(io, values);
  const b = await api.request<ApiBundle>("GET", `api/v1/bundles/${encodeURIComponent(positionals[0]!)}`);
  if (values.json === true) {
    io.out(JSON.stringify(b, null, 2));
    return EXIT_OK;
  }
  const rows: string[][] = [
    ["uuid", b.uuid],
    ["name", b.name],
    ["state", b.state + (b.stateReason ? ` (${b.stateReason})` : "")],
    ["status", b.schedulingStatus ?? ""],
    ["image", b.image],
    ["command", JSON.stringify(b.command)],
    ["priority", String(b.priority)],
    ["attempt", `${b.attempt} of ${b.maxAttempts}`],
    ["instance type", b.instanceType ?? ""],
    ["exit code", b.exitCode === null ? "" : String(b.exitCode)],
    ["created", b.createdAt],
  ];
  for (const line of table(rows.map(([k, v]) => [`${k}:`, v ?? ""]))) io.out(line);
  return EXIT_OK;
}

async function kill(io: CliIo, argv: string[]): Promise<number> {
  const { values, positionals } = parse(argv, { ...CLIENT_OPTIONS, reason: { type: "string" } });
  if (positionals.length === 0) throw usageError("bundles kill takes one or more UUIDs");
  const api = await connect(io, values);
  let failed = 0;
  for (const uuid of positionals) {
    try {
      const body = values.reason === undefined ? {} : { reason: values.reason };
      const b = await api.request<ApiBundle>("POST", `api/v1/bundles/${encodeURIComponent(uuid)}/kill`, body);
      io.out(`${uuid}: ${b.state}`);
    } catch (err) {
      failed++;
      io.out(`${uuid}: error: ${err instanceof Error ? err.message : String(err)}`);
    }
  }
  return failed === 0 ? EXIT_OK : EXIT_FAILED;
}

interface ApiEvent {
  fromState: string | null;
  toState: string;
  attempt: number;
  reason: string | null;
  actor: string;
  createdAt: string;
}

async function events(io: CliIo, argv: string[]): Promise<number> {
  const { values, positionals } = parse(argv, CLIENT_OPTIONS);
  if (positionals.length !== 1) throw usageError("bundles events takes one UUID");
  const api = await connect(io, values);
  const res = await api.request<{ items: ApiEvent[] }>(
    "GET",
    `api/v1/bundles/${encodeURIComponent(positionals[0]!)}/events`,
  );
  if (values.json === true) {
    io.out(JSON.stringify(res.items, null, 2));
    return EXIT_OK;
  }
  const rows = [["TIME", "FROM", "TO", "ATTEMPT", "ACTOR", "REASON"]];
  for (const e of res.items) {
    rows.push([e.createdAt, e.fromState ?? "-", e.toState, String(e.attempt), e.actor, e.reason ?? ""]);
  }
  for (const line of table(rows)) io.out(line);
  return EXIT_OK;
}

async function logs(io: CliIo, argv: string[]): Promise<number> {
  const { values, positionals } = parse(argv, {
    ...CLIENT_OPTIONS,
    stream: { type: "string" },
    attempt: { type: "string" },
    follow: { type: "boolean", short: "f" },
  });
  if (positionals.length !== 1) throw usageError("bundles logs takes one UUID");
  const api = await connect(io, values);
  await printLog(io, api, positionals[0]!, {
    stream: values.stream ?? "stdout",
    follow: values.follow === true,
    ...(values.attempt === undefined ? {} : { attempt: values.attempt }),
  });
  return EXIT_OK;
}

/** Copies a bundle's log stream to stdout (the server checks the stream name and attempt). */
export async function printLog(
  io: ByteIo,
  api: ApiClient,
  uuid: string,
  opts: { stream: string; follow?: boolean; attempt?: string },
): Promise<number> {
  const q = new URLSearchParams({ stream: opts.stream });
  if (opts.follow === true) q.set("follow", "1");
  if (opts.attempt !== undefined) q.set("attempt", opts.attempt);
  const res = await api.raw("GET", `api/v1/bundles/${encodeURIComponent(uuid)}/logs?${q}`);
  return copyToStdout(io, res);
}

export interface OutputListing {
  files: { path: string; size: number }[];
}

/** One page of an outputs listing as the API answers it. */
interface OutputListingPage extends OutputListing {
  nextCursor?: string | null;
}

/** The rest of a listing whose first page is `first`, page after page (pageSize: files per page; none = the server's). */
async function followListing(
  api: ApiClient,
  url: string,
  first: OutputListingPage,
  pageSize?: number,
): Promise<OutputListing> {
  const files = [...first.files];
  let cursor = first.nextCursor ?? null;
  while (cursor !== null) {
    const q = new URLSearchParams({ cursor });
    if (pageSize !== undefined) q.set("limit", String(pageSize));
    const page = await api.request<OutputListingPage>("GET", `${url}?${q}`);
    files.push(...page.files);
    cursor = page.nextCursor ?? null;
  }
  return { files };
}

/** The whole listing of a directory of a bundle's outputs ("" = all of them), following the pages. */
export async function fetchListing(api: ApiClient, uuid: string, path = ""): Promise<OutputListing> {
  const url = outputsUrl(uuid, path);
  return followListing(api, url, await api.request<OutputListingPage>("GET", url));
}

/** The output path as URL path segments (each encoded; the server checks the path itself). */
export const outputsUrl = (uuid: string, path = ""): string =>
  `api/v1/bundles/${encodeURIComponent(uuid)}/outputs${path === "" ? "" : `/${path.split("/").map(encodeURIComponent).join("/")}`}`;

export function printListing(io: CliIo, listing: OutputListing): void {
  const rows = [["SIZE", "PATH"]];
  for (const f of listing.files) rows.push([String(f.size), f.path]);
  for (const line of table(rows)) io.out(line);
}

async function outputs(io: CliIo, argv: string[]): Promise<number> {
  const { values, positionals } = parse(argv, { ...CLIENT_OPTIONS, "page-size": { type: "string" } });
  if (positionals.length < 1 || positionals.length > 2) throw usageError("bundles outputs takes UUID [PATH]");
  const pageSize = values["page-size"] === undefined ? undefined : Number(values["page-size"]);
  if (pageSize !== undefined && (!Number.isInteger(pageSize) || pageSize < 1 || pageSize > 10_000))
    throw usageError("--page-size takes an integer 1..10000");
  const api = await connect(io, values);
  const url = outputsUrl(positionals[0]!, positionals[1] ?? "");
  const res = await api.raw("GET", pageSize === undefined ? url : `${url}?limit=${pageSize}`);
  if (!(res.headers.get("content-type") ?? "").startsWith("application/json")) {
    await copyToStdout(io, res);
    return EXIT_OK;
  }
  const listing = await followListing(api, url, (await res.json()) as OutputListingPage, pageSize);
  if (values.json === true) io.out(JSON.stringify(listing.files, null, 2));
  else printListing(io, listing);
  return EXIT_OK;
}
