import { readFile } from "node:fs/promises";
import { resolve } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { parse as parseYaml } from "yaml";
import { DispatchCloudError } from "../../lib/errors.ts";
import { CLIENT_OPTIONS, parse } from "../args.ts";
import type { ApiClient } from "../client.ts";
import { type CliIo, EXIT_FAILED, EXIT_OK, usageError } from "../io.ts";
import { fetchListing, printListing, printLog } from "./bundles.ts";
import { type ApiBundle, connect, FINAL } from "./client-common.ts";

const USAGE = `usage: dispatch-cloud submit [FILE.json|FILE.yml] [flags] [--] COMMAND [ARG...]
       dispatch-cloud submit --batch FILE.jsonl    (one bundle request per line; prints one uuid per line)
  --image IMAGE            container image (required unless in FILE)
  --name NAME              a name for the bundle
  --vcpus N --ram SIZE --scratch SIZE
  --gpus N [--gpu-stack cuda|rocm] [--gpu-vram SIZE] [--gpu-driver X.Y]
  --tag TAG                run only where an instance type or one of your workers has the tag
  --workers-only           run only on your own workers, never on a cloud instance (docs/workers.md)
  --env NAME=VALUE         (repeatable)
  --priority N             0..1000 (default 500)
  --preemptible            allow a preemptible (spot) instance
  --time-limit DURATION --disk-limit SIZE --network
  --depends-on UUID[:SUBPATH[:NAME]]   (repeatable) read UUID's output, mounted read-only as NAME
  --allow-failed-dependencies  --max-attempts N
  --wait                   show progress until the bundle is final, then its stdout log and output listing
                           (ready) or the tail of its stderr log (failed); exit 0 only if it is ready`;

const OPTIONS = {
  ...CLIENT_OPTIONS,
  image: { type: "string" },
  name: { type: "string" },
  vcpus: { type: "string" },
  ram: { type: "string" },
  scratch: { type: "string" },
  gpus: { type: "string" },
  "gpu-stack": { type: "string" },
  "gpu-vram": { type: "string" },
  "gpu-driver": { type: "string" },
  tag: { type: "string" },
  "workers-only": { type: "boolean" },
  env: { type: "string", multiple: true },
  priority: { type: "string" },
  preemptible: { type: "boolean" },
  "time-limit": { type: "string" },
  "disk-limit": { type: "string" },
  network: { type: "boolean" },
  "depends-on": { type: "string", multiple: true },
  "allow-failed-dependencies": { type: "boolean" },
  "max-attempts": { type: "string" },
  wait: { type: "boolean" },
  batch: { type: "string" },
} as const;

type Body = Record<string, unknown>;

/** A number flag stays a number if it looks like one; the server validates ranges and reports the field. */
const num = (s: string): number | string => (/^-?\d+(\.\d+)?$/.test(s) ? Number(s) : s);

export async function submitCommand(io: CliIo): Promise<number> {
  const { values: v, positionals } = parse(io.argv, OPTIONS);
  if (v.help === true) {
    io.out(USAGE);
    return EXIT_OK;
  }
  if (v.batch !== undefined) {
    if (positionals.length > 0 || v.wait === true) {
      throw usageError("--batch FILE.jsonl takes no command, spec file or --wait; each line is a bundle");
    }
    return submitBatch(io, v, resolve(io.cwd, v.batch));
  }
  let body: Body = {};
  let command = positionals;
  const first = positionals[0];
  if (first !== undefined && /\.(json|ya?ml)$/i.test(first) && !io.argv.includes("--")) {
    body = await readSpecFile(resolve(io.cwd, first));
    command = positionals.slice(1);
  }
  if (command.length > 0) body["command"] = command;
  if (v.image !== undefined) body["image"] = v.image;
  if (v.name !== undefined) body["name"] = v.name;
  const resources = { ...((body["resources"] as Body | undefined) ?? {}) };
  if (v.vcpus !== undefined) resources["vcpus"] = num(v.vcpus);
  if (v.ram !== undefined) resources["ram"] = num(v.ram);
  if (v.scratch !== undefined) resources["scratch"] = num(v.scratch);
  if (v.gpus !== undefined) {
    resources["gpu"] = {
      stack: v["gpu-stack"] ?? "cuda",
      deviceCount: num(v.gpus),
      ...(v["gpu-vram"] === undefined ? {} : { vram: num(v["gpu-vram"]) }),
      ...(v["gpu-driver"] === undefined ? {} : { driverVersion: v["gpu-driver"] }),
    };
  }
  if (v.tag !== undefined) resources["tag"] = v.tag;
  if (v["workers-only"] === true) resources["workersOnly"] = true;
  if (Object.keys(resources).length > 0) body["resources"] = resources;
  if (v.env !== undefined) {
    const env = { ...((body["env"] as Body | undefined) ?? {}) };
    for (const pair of v.env) {
      const eq = pair.indexOf("=");
      if (eq < 1) throw usageError(`--env takes NAME=VALUE, got "${pair}"`);
      env[pair.slice(0, eq)] = pair.slice(eq + 1);
    }
    body["env"] = env;
  }
  if (v.priority !== undefined) body["priority"] = num(v.priority);
  if (v.preemptible === true) body["preemptible"] = true;
  const limits = { ...((body["limits"] as Body | undefined) ?? {}) };
  if (v["time-limit"] !== undefined) limits["time"] = v["time-limit"];
  if (v["disk-limit"] !== undefined) limits["disk"] = num(v["disk-limit"]);
  if (v.network === true) limits["network"] = true;
  if (Object.keys(limits).length > 0) body["limits"] = limits;
  if (v["depends-on"] !== undefined) {
    const deps = [...((body["dependencies"] as unknown[] | undefined) ?? [])];
    for (const spec of v["depends-on"]) {
      const [bundle, subpath, name] = spec.split(":");
      deps.push({
        bundle,
        ...(subpath ? { subpath } : {}),
        ...(name ? { name } : {}),
      });
    }
    body["dependencies"] = deps;
  }
  if (v["allow-failed-dependencies"] === true) body["allowFailedDependencies"] = true;
  if (v["max-attempts"] !== undefined) body["maxAttempts"] = num(v["max-attempts"]);
  if (body["command"] === undefined) throw usageError(`no command given\n${USAGE}`);
  if (body["image"] === undefined) throw usageError("--image is required (or an image in the spec file)");

  const api = await connect(io, v);
  const created = await api.request<ApiBundle>("POST", "api/v1/bundles", body);
  io.out(created.uuid);
  if (v.wait !== true) return EXIT_OK;
  const final = await waitForFinal(io, api, created);
  await showResult(io, api, final);
  return final.state === "ready" ? EXIT_OK : EXIT_FAILED;
}

/** Most bundles per request (the server's limit); a longer file goes in several requests. */
const BATCH_ITEMS = 10_000;

/**
 * `submit --batch FILE.jsonl`: each non-empty line is one bundle request. The lines go in requests of up to
 * BATCH_ITEMS bundles, each all or nothing; uuids are printed in line order as each request is accepted, and
 * a refused request names the file's line (`FILE:43: resources.ram: ...`), so what went in is on stdout.
 */
async function submitBatch(io: CliIo, flags: Parameters<typeof connect>[1], path: string): Promise<number> {
  let text: string;
  try {
    text = await readFile(path, "utf8");
  } catch (err) {
    throw usageError(`cannot read ${path}: ${err instanceof Error ? err.message : String(err)}`);
  }
  const items: { line: number; body: unknown }[] = [];
  text.split("\n").forEach((raw, i) => {
    if (raw.trim() === "") return;
    try {
      items.push({ line: i + 1, body: JSON.parse(raw) });
    } catch (err) {
      throw usageError(
        `${path}:${i + 1}: not valid JSON (${err instanceof Error ? err.message : String(err)})`,
      );
    }
  });
  if (items.length === 0) throw usageError(`${path} holds no bundle requests (one JSON object per line)`);
  const api = await connect(io, flags);
  for (let start = 0; start < items.length; start += BATCH_ITEMS) {
    const chunk = items.slice(start, start + BATCH_ITEMS);
    let created: { items: { uuid: string }[] };
    try {
      // Only the uuids are printed: the answer need not echo every bundle whole (docs/api.md).
      created = await api.request(
        "POST",
        "api/v1/bundles/batch",
        { items: chunk.map((it) => it.body) },
        { prefer: "return=minimal" },
      );
    } catch (err) {
      throw err instanceof DispatchCloudError ? atLine(err, path, chunk) : err;
    }
    for (const b of created.items) io.out(b.uuid);
    if (items.length > BATCH_ITEMS) {
      io.progress(`submitted ${start + chunk.length} of ${items.length} bundles`);
    }
  }
  return EXIT_OK;
}

/** An error about `items[i].x` as one about line N of the file: `FILE:N: x: ...`. */
function atLine(
  err: DispatchCloudError,
  path: string,
  chunk: readonly { line: number }[],
): DispatchCloudError {
  const m = /^items\[(\d+)\]\.?(.*)$/.exec(err.path ?? "");
  const item = m === null ? undefined : chunk[Number(m[1])];
  if (m === null || item === undefined) return err;
  const message = err.message.replace(`items[${m[1]}]${m[2] === "" ? ": " : "."}`, "");
  return new DispatchCloudError(err.code, `${path}:${item.line}: ${message}`, { cause: err });
}

/** Lines of the stderr log shown when a bundle failed. */
const STDERR_TAIL_LINES = 20;

/**
 * After --wait: a ready bundle's stdout log (on stdout) and its output listing (on stderr, so stdout is the
 * command's own output); a failed bundle's last stderr lines (on stderr).
 */
export async function showResult(io: CliIo, api: ApiClient, b: ApiBundle): Promise<void> {
  if (b.attempt === 0) return; // never ran: no logs, no outputs
  if (b.state === "ready") {
    await printLog(io, api, b.uuid, { stream: "stdout" });
    const listing = await fetchListing(api, b.uuid);
    if (listing.files.length > 0) {
      io.progress(`outputs of ${b.uuid}:`);
      printListing({ ...io, out: io.progress }, listing);
    }
    return;
  }
  const res = await api.raw("GET", `api/v1/bundles/${encodeURIComponent(b.uuid)}/logs?stream=stderr`);
  const lines = (await res.text()).split("\n");
  if (lines[lines.length - 1] === "") lines.pop();
  if (lines.length === 0) return;
  const tail = lines.slice(-STDERR_TAIL_LINES);
  io.progress(
    `stderr of ${b.uuid}${tail.length < lines.length ? ` (last ${tail.length} of ${lines.length} lines)` : ""}:`,
  );
  for (const line of tail) io.progress(line);
}

async function readSpecFile(path: string): Promise<Body> {
  let text: string;
  try {
    text = await readFile(path, "utf8");
  } catch (err) {
    throw usageError(`cannot read ${path}: ${err instanceof Error ? err.message : String(err)}`);
  }
  let spec: unknown;
  try {
    spec = parseYaml(text);
  } catch (err) {
    throw usageError(
      `${path} is not valid JSON or YAML: ${err instanceof Error ? err.message : String(err)}`,
    );
  }
  if (spec === null || typeof spec !== "object" || Array.isArray(spec)) {
    throw usageError(`${path} must hold one object (the bundle's fields)`);
  }
  return spec as Body;
}

/** Polls the bundle, printing each change of state or scheduling status with the time since submit. */
export async function waitForFinal(
  io: CliIo,
  api: ApiClient,
  bundle: ApiBundle,
  intervalMs = 500,
): Promise<ApiBundle> {
  const started = Date.now();
  let last = "";
  let b = bundle;
  for (;;) {
    const line = `${b.state}${b.stateReason ? ` (${b.stateReason})` : ""}${b.schedulingStatus && !FINAL.has(b.state) ? `: ${b.schedulingStatus}` : ""}`;
    if (line !== last) {
      io.progress(`[${((Date.now() - started) / 1000).toFixed(1)}s] ${b.uuid} ${line}`);
      last = line;
    }
    if (FINAL.has(b.state)) return b;
    await sleep(intervalMs, undefined, io.signal === undefined ? {} : { signal: io.signal });
    b = await api.request<ApiBundle>("GET", `api/v1/bundles/${encodeURIComponent(b.uuid)}`);
  }
}
