/**
 * The BOINC GAHP commands over the REST API (docs/htcondor.md "How BOINC maps onto bundles"). A job is a bundle;
 * a batch is the set of the caller's bundles whose env holds GAHP_BATCH=<batch name> (GAHP_JOB holds the job's
 * name), so batch membership lives with the bundles and survives a restart of the GAHP without any server state
 * of its own. Input files go through the content-addressed store: each distinct file is hashed and uploaded once
 * (only when the store lacks it), each distinct set of a job's inputs becomes one uploaded tree, and jobs depend
 * on that tree, mounted at /in/inputs.
 */
import { createReadStream } from "node:fs";
import { mkdir } from "node:fs/promises";
import { basename, dirname, isAbsolute, join } from "node:path";
import { type Digest, digestStream, formatDigest } from "../../lib/cas/digest.ts";
import { comparePaths, type Manifest, manifestDigest } from "../../lib/cas/manifest.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import { CONTROL_CHARACTERS } from "../../lib/text-limits.ts";
import { parseSize } from "../../lib/units.ts";
import type { GahpApi, GahpBundle } from "./api.ts";
import type { AppTemplate } from "./config.ts";
import { type CommandSet, protocolError } from "./server.ts";
import { MAX_REPLY_BYTES } from "./wire.ts";

export const ENV_BATCH = "GAHP_BATCH";
export const ENV_JOB = "GAHP_JOB";
export const ENV_APP = "GAHP_APP";
/** Where a job's input files are, in its container. */
export const INPUTS_DIR = "/in/inputs";

export type BoincStatus = "NOT_STARTED" | "IN_PROGRESS" | "DONE" | "ERROR";

/**
 * A bundle's state as a BOINC job status. A bundle that failed with an exit code is DONE: the job ran to its end,
 * and BOINC_FETCH_OUTPUT hands HTCondor its exit code (HTCondor's own rules then decide). Failures without one
 * (a limit, the infrastructure) and kills are ERROR.
 */
export function boincStatus(b: Pick<GahpBundle, "state" | "exitCode">): BoincStatus {
  switch (b.state) {
    case "running":
      return "IN_PROGRESS";
    case "ready":
      return "DONE";
    case "failed":
      return b.exitCode === null ? "ERROR" : "DONE";
    case "killed":
      return "ERROR";
    default:
      return "NOT_STARTED";
  }
}

const FINAL = new Set(["ready", "failed", "killed"]);

interface BatchEntry {
  jobs: Map<string, string>; // job name -> bundle uuid
  lease: NodeJS.Timeout | null;
}

/** One job of a BOINC_SUBMIT, as parsed. */
export interface SubmitJob {
  name: string;
  args: string[];
  inputs: { src: string; dst: string }[];
}

export interface SubmitRequest {
  batch: string;
  app: string;
  jobs: SubmitJob[];
  /** rsc_fpops_est, rsc_fpops_bound, rsc_memory_bound, rsc_disk_bound, delay_bound, app_version_num (null: NULL). */
  bounds: {
    memory: number | null;
    disk: number | null;
    delay: number | null;
  };
}

const bad = (message: string) => protocolError("gahp.bad_arguments", message);

/** A count argument: a whole number no larger than `max`. */
function count(value: string | undefined, what: string, max: number): number {
  if (value === undefined) throw bad(`missing ${what}`);
  if (!/^[0-9]{1,9}$/.test(value) || Number(value) > max)
    throw bad(`${what} must be a whole number up to ${max} (got ${JSON.stringify(value.slice(0, 40))})`);
  return Number(value);
}

/** A bound argument: NULL, or a non-negative number. */
function optionalNumber(value: string, what: string): number | null {
  if (value === "NULL" || value === "") return null;
  const n = Number(value);
  if (!Number.isFinite(n) || n < 0)
    throw bad(`${what} must be NULL or a non-negative number (got ${JSON.stringify(value.slice(0, 40))})`);
  return n;
}

function nonEmpty(value: string | undefined, what: string): string {
  if (value === undefined) throw bad(`missing ${what}`);
  if (value === "") throw bad(`${what} is empty`);
  return value;
}

/** The arguments of BOINC_SUBMIT after the request id, checked for shape (not for meaning). */
export function parseSubmit(args: string[]): SubmitRequest {
  let i = 0;
  const next = () => args[i++];
  const batch = nonEmpty(next(), "batch name");
  const app = nonEmpty(next(), "app name");
  const njobs = count(next(), "#jobs", 100_000);
  if (njobs === 0) throw bad("#jobs is 0: a batch has at least one job");
  const jobs: SubmitJob[] = [];
  const names = new Set<string>();
  for (let j = 0; j < njobs; j++) {
    const name = nonEmpty(next(), `name of job ${j + 1}`);
    if (names.has(name)) throw bad(`job name ${JSON.stringify(name)} appears twice`);
    names.add(name);
    const nargs = count(next(), `#args of job ${name}`, 10_000);
    if (i + nargs > args.length) throw bad(`job ${name} announces ${nargs} arguments; the line ends first`);
    const jobArgs = args.slice(i, i + nargs);
    i += nargs;
    const nfiles = count(next(), `#input files of job ${name}`, 10_000);
    if (i + 2 * nfiles > args.length)
      throw bad(`job ${name} announces ${nfiles} input files; the line ends first`);
    const inputs: { src: string; dst: string }[] = [];
    for (let f = 0; f < nfiles; f++) {
      const src = nonEmpty(next(), `source path of input ${f + 1} of job ${name}`);
      const dst = nonEmpty(next(), `file name of input ${f + 1} of job ${name}`);
      if (dst.includes("/") || dst === "." || dst === "..")
        throw bad(`input file name ${JSON.stringify(dst)} of job ${name} must be a plain file name`);
      inputs.push({ src, dst });
    }
    jobs.push({ name, args: jobArgs, inputs });
  }
  const rest = args.slice(i);
  // HTCondor 8.x sends no bounds; 9.x sends six values (NULL when the job does not set them).
  if (rest.length !== 0 && rest.length !== 6) {
    throw bad(
      `after the jobs come 6 values (rsc_fpops_est rsc_fpops_bound rsc_memory_bound rsc_disk_bound delay_bound app_version_num) or none; got ${rest.length}`,
    );
  }
  const [
    fpopsEst = "NULL",
    fpopsBound = "NULL",
    memory = "NULL",
    disk = "NULL",
    delay = "NULL",
    version = "NULL",
  ] = rest;
  optionalNumber(fpopsEst, "rsc_fpops_est");
  optionalNumber(fpopsBound, "rsc_fpops_bound");
  optionalNumber(version, "app_version_num");
  return {
    batch,
    app,
    jobs,
    bounds: {
      memory: optionalNumber(memory, "rsc_memory_bound"),
      disk: optionalNumber(disk, "rsc_disk_bound"),
      delay: optionalNumber(delay, "delay_bound"),
    },
  };
}

export interface FetchRequest {
  job: string;
  dir: string;
  stderr: string;
  all: boolean;
  specs: { src: string; dst: string }[];
}

export function parseFetch(args: string[]): FetchRequest {
  if (args.length < 5) throw bad(`BOINC_FETCH_OUTPUT needs at least 6 arguments (got ${args.length + 1})`);
  const [job, dir, stderr, mode, n, ...rest] = args as [string, string, string, string, string, ...string[]];
  nonEmpty(job, "job name");
  if (mode !== "ALL" && mode !== "SOME")
    throw bad(`mode must be ALL or SOME (got ${JSON.stringify(mode.slice(0, 40))})`);
  const nspecs = count(n, "#file specs", 100_000);
  if (rest.length !== 2 * nspecs)
    throw bad(`${nspecs} file specs need ${2 * nspecs} arguments after the count (got ${rest.length})`);
  const specs: { src: string; dst: string }[] = [];
  for (let k = 0; k < nspecs; k++) {
    specs.push({
      src: nonEmpty(rest[2 * k], `source of file spec ${k + 1}`),
      dst: nonEmpty(rest[2 * k + 1], `destination of file spec ${k + 1}`),
    });
  }
  if (!isAbsolute(dir)) throw bad(`the directory ${JSON.stringify(dir)} must be an absolute path`);
  return { job, dir, stderr, all: mode === "ALL", specs };
}

/** Seconds with six decimals, as the BOINC GAHP prints times. */
const seconds = (s: number) => s.toFixed(6);

/** Expands an app's command pattern for one job. */
export function expandCommand(
  pattern: readonly string[],
  vars: { job: string; batch: string; app: string },
  args: readonly string[],
): string[] {
  const out: string[] = [];
  for (const item of pattern) {
    if (item === "{args}") {
      out.push(...args);
      continue;
    }
    out.push(
      item.replace(/\{(job|batch|app|inputs)\}/g, (_, k: string) =>
        k === "inputs" ? INPUTS_DIR : vars[k as "job" | "batch" | "app"],
      ),
    );
  }
  return out;
}

/** A bundle name from a job name: what the API accepts (no control characters, 200 characters). */
const bundleName = (job: string) => job.replace(CONTROL, "?").slice(0, 200);
const CONTROL = new RegExp(`[${CONTROL_CHARACTERS}]`, "g");

/** A job's line in a query's answer: its name, status and when its bundle last changed (seconds). */
export interface QueriedJob {
  job: string;
  status: BoincStatus;
  mod: number;
}

/** What a job adds to the answer line at most (its name escaped, its status, two spaces). */
const jobBytes = (j: QueriedJob) => 2 * j.job.length + j.status.length + 2;

/**
 * The jobs of a BOINC_QUERY_BATCHES answer that fit the 500 KB line, and the server time to answer with. When all
 * fit, all of them and `serverTime`. Otherwise the oldest changes first, and a server time just before the first
 * change left out, so the next query (which reports changes at or after it) continues there. Jobs that changed at
 * the same moment (a batch created by one request) may not all fit: among those, the ones not yet reported with
 * their current status (`reported`) go first, so repeated queries report every one of them.
 */
export function fitQueryReply(
  batches: QueriedJob[][],
  serverTime: number,
  reported: (job: string) => string | undefined,
  budget = MAX_REPLY_BYTES - 4096,
): { batches: QueriedJob[][]; serverTime: number } {
  let bytes = 64 + 12 * batches.length;
  for (const js of batches) for (const j of js) bytes += jobBytes(j);
  if (bytes <= budget) return { batches, serverTime };
  const fresh = (j: QueriedJob) => (reported(j.job) === j.status ? 1 : 0);
  const all = batches
    .flatMap((js, b) => js.map((j) => ({ j, b })))
    .sort((x, y) => x.j.mod - y.j.mod || fresh(x.j) - fresh(y.j));
  bytes = 64 + 12 * batches.length;
  const keep = new Set<QueriedJob>();
  let cutAt = serverTime;
  for (const { j } of all) {
    bytes += jobBytes(j);
    if (bytes > budget) {
      cutAt = j.mod;
      break;
    }
    keep.add(j);
  }
  return {
    batches: batches.map((js) => js.filter((j) => keep.has(j))),
    serverTime: Math.min(serverTime, cutAt - 0.000001),
  };
}

/** The `POST /bundles` item for one job: the app's template, the job's arguments and the BOINC bounds. */
export function bundleRequest(
  req: SubmitRequest,
  t: AppTemplate,
  job: SubmitJob,
  tree: string | null,
): Record<string, unknown> {
  const r = t.resources ?? {};
  const l = t.limits ?? {};
  const { memory, disk, delay } = req.bounds;
  const ram = memory !== null && memory > 0 ? Math.ceil(memory) : r.ram;
  const diskBytes = disk !== null && disk > 0 ? Math.ceil(disk) : l.disk;
  const scratch =
    disk !== null && disk > 0
      ? Math.max(Math.ceil(disk), r.scratch === undefined ? 0 : parseSize(r.scratch))
      : r.scratch;
  const time = delay !== null && delay > 0 ? `${Math.ceil(delay)}s` : l.time;
  const limits = {
    ...(time === undefined ? {} : { time }),
    ...(diskBytes === undefined ? {} : { disk: diskBytes }),
    ...(l.network === undefined ? {} : { network: l.network }),
  };
  return {
    name: bundleName(job.name),
    image: t.image,
    command: expandCommand(t.command, { job: job.name, batch: req.batch, app: req.app }, job.args),
    env: { ...(t.env ?? {}), [ENV_BATCH]: req.batch, [ENV_JOB]: job.name, [ENV_APP]: req.app },
    resources: {
      ...(r.vcpus === undefined ? {} : { vcpus: r.vcpus }),
      ...(ram === undefined ? {} : { ram }),
      ...(scratch === undefined ? {} : { scratch }),
    },
    ...(Object.keys(limits).length === 0 ? {} : { limits }),
    ...(tree === null ? {} : { dependencies: [{ bundle: tree, name: "inputs" }] }),
    ...(t.maxAttempts === undefined ? {} : { maxAttempts: t.maxAttempts }),
    ...(t.preemptible === undefined ? {} : { preemptible: t.preemptible }),
    ...(t.priority === undefined ? {} : { priority: t.priority }),
  };
}

export interface BoincOptions {
  apps: Record<string, AppTemplate>;
  /** The API for the current project (BOINC_SELECT_PROJECT replaces it). */
  api: () => GahpApi;
  /** BOINC_SELECT_PROJECT: point at another REST server and token. */
  selectProject: (url: string, token: string) => void;
  log: (line: string) => void;
  now?: () => number;
}

/** The BOINC commands and the state they share: the batch index, leases, uploaded input trees. */
export class BoincService {
  private batches = new Map<string, BatchEntry>();
  private jobs = new Map<string, { batch: string; uuid: string }>();
  private readonly retired = new Set<string>();
  private uploads = new Map<string, Promise<string>>();
  private loaded: Promise<void> | null = null;
  private lastLoad = 0;
  private readonly batchLocks = new Map<string, Promise<unknown>>();
  private readonly now: () => number;
  /** The status each job was last reported with (to share out a reply too long for one line; see fitQueryReply). */
  private readonly reportedStatus = new Map<string, string>();
  /** Jobs whose bundles were seen final, by bundle uuid: they never change again. */
  private readonly finalViews = new Map<string, QueriedJob>();
  /** The project and authenticator last selected. */
  private project = "";

  constructor(private readonly opts: BoincOptions) {
    this.now = opts.now ?? Date.now;
  }

  commands(): CommandSet {
    return {
      BOINC_SELECT_PROJECT: {
        kind: "sync",
        run: (args) => {
          if (args.length !== 2)
            throw bad(`BOINC_SELECT_PROJECT takes 2 arguments, url and authenticator (got ${args.length})`);
          const [url, auth] = args as [string, string];
          let parsed: URL;
          try {
            parsed = new URL(url);
          } catch {
            throw new DispatchCloudError(
              "gahp.bad_arguments",
              `not a URL: ${JSON.stringify(url.slice(0, 200))}`,
            );
          }
          if (parsed.protocol !== "http:" && parsed.protocol !== "https:")
            throw new DispatchCloudError(
              "gahp.bad_arguments",
              `the project URL must be http or https (got ${parsed.protocol})`,
            );
          // The gridmanager selects again whenever it switches resources: the same project keeps what is known.
          if (this.project !== `${url} ${auth}`) {
            this.opts.selectProject(url, auth);
            this.reset();
            this.project = `${url} ${auth}`;
          }
          return [];
        },
      },
      BOINC_PING: {
        kind: "async",
        parse: (args) => {
          if (args.length !== 0) throw bad(`BOINC_PING takes only a request id (got ${args.length} more)`);
          return async () => {
            await this.opts.api().whoami();
            return ["NULL"];
          };
        },
      },
      BOINC_SUBMIT: {
        kind: "async",
        parse: (args) => {
          const req = parseSubmit(args);
          return () => this.lockBatch(req.batch, () => this.submit(req));
        },
      },
      BOINC_QUERY_BATCHES: {
        kind: "async",
        parse: (args) => {
          if (args.length < 2)
            throw bad(`BOINC_QUERY_BATCHES needs min_mod_time and #batches (got ${args.length} arguments)`);
          const [minMod, n, ...names] = args as [string, string, ...string[]];
          const min = Number(minMod);
          if (minMod === "" || !Number.isFinite(min))
            throw bad(`min_mod_time must be a number (got ${JSON.stringify(minMod.slice(0, 40))})`);
          const nb = count(n, "#batches", 100_000);
          if (names.length !== nb) throw bad(`#batches is ${nb} but ${names.length} batch names follow`);
          for (const name of names) nonEmpty(name, "batch name");
          return () => this.query(min, names);
        },
      },
      BOINC_FETCH_OUTPUT: {
        kind: "async",
        parse: (args) => {
          const req = parseFetch(args);
          return () => this.fetch(req);
        },
      },
      BOINC_ABORT_JOBS: {
        kind: "async",
        parse: (args) => {
          if (args.length === 0) throw bad("BOINC_ABORT_JOBS needs at least one job name");
          for (const a of args) nonEmpty(a, "job name");
          return () => this.abort(args);
        },
      },
      BOINC_RETIRE_BATCH: {
        kind: "async",
        parse: (args) => {
          if (args.length !== 1)
            throw bad(`BOINC_RETIRE_BATCH takes 1 argument after the request id (got ${args.length})`);
          const batch = nonEmpty(args[0], "batch name");
          return () => this.lockBatch(batch, () => this.retire(batch, "retired by HTCondor"));
        },
      },
      BOINC_SET_LEASE: {
        kind: "async",
        parse: (args) => {
          if (args.length !== 2)
            throw bad(`BOINC_SET_LEASE takes 2 arguments after the request id (got ${args.length})`);
          const batch = nonEmpty(args[0], "batch name");
          const t = args[1] as string;
          if (!/^-?[0-9]{1,12}$/.test(t))
            throw bad(`the lease end must be a time in seconds (got ${JSON.stringify(t.slice(0, 40))})`);
          return () => this.setLease(batch, Number(t));
        },
      },
    };
  }

  /** Forgets everything (another project or user). */
  private reset(): void {
    for (const b of this.batches.values()) if (b.lease !== null) clearTimeout(b.lease);
    this.batches = new Map();
    this.jobs = new Map();
    this.uploads = new Map();
    this.reportedStatus.clear();
    this.finalViews.clear();
    this.loaded = null;
    this.lastLoad = 0;
  }

  /** Runs `fn` after any earlier work on the same batch (submit, retire) has ended. */
  private async lockBatch<T>(batch: string, fn: () => Promise<T>): Promise<T> {
    const before = this.batchLocks.get(batch) ?? Promise.resolve();
    const run = before.then(fn, fn);
    const tail = run.catch(() => undefined);
    this.batchLocks.set(batch, tail);
    try {
      return await run;
    } finally {
      if (this.batchLocks.get(batch) === tail) this.batchLocks.delete(batch);
    }
  }

  /** Reads the caller's bundles into the index (once; again at most every 5 s when a name is not found). */
  private async load(force: boolean): Promise<void> {
    if (this.loaded !== null && (!force || this.now() - this.lastLoad < 5000)) return this.loaded;
    const p = (async () => {
      const bundles = await this.opts.api().allBundles();
      for (const b of bundles) {
        const batch = b.env?.[ENV_BATCH];
        const job = b.env?.[ENV_JOB];
        if (batch === undefined || job === undefined || this.retired.has(batch)) continue;
        this.index(batch, job, b.uuid);
      }
    })();
    this.loaded = p;
    this.lastLoad = this.now();
    try {
      await p;
    } catch (err) {
      this.loaded = null;
      throw err;
    }
  }

  private index(batch: string, job: string, uuid: string): void {
    if (this.jobs.has(job)) return;
    let entry = this.batches.get(batch);
    if (entry === undefined) {
      entry = { jobs: new Map(), lease: null };
      this.batches.set(batch, entry);
    }
    entry.jobs.set(job, uuid);
    this.jobs.set(job, { batch, uuid });
  }

  private async batch(name: string): Promise<BatchEntry | undefined> {
    await this.load(false);
    if (!this.batches.has(name) && !this.retired.has(name)) await this.load(true);
    return this.batches.get(name);
  }

  private async job(name: string): Promise<{ batch: string; uuid: string } | undefined> {
    await this.load(false);
    if (!this.jobs.has(name)) await this.load(true);
    return this.jobs.get(name);
  }

  private noBatch(name: string): DispatchCloudError {
    // HTCondor's gridmanager looks for "no batch named " and takes the rest of the message as the name.
    return new DispatchCloudError("gahp.unknown_batch", `no batch named ${name}`);
  }

  private async submit(req: SubmitRequest): Promise<string[]> {
    const template = this.opts.apps[req.app] ?? this.opts.apps[basename(req.app)];
    if (template === undefined) {
      throw new DispatchCloudError(
        "gahp.unknown_app",
        `no app named ${req.app} in the GAHP's config (known: ${Object.keys(this.opts.apps).sort().join(", ") || "none"})`,
      );
    }
    await this.load(false);
    this.retired.delete(req.batch);
    const todo = req.jobs.filter((j) => !this.jobs.has(j.name));
    if (todo.length === 0) return ["NULL"];
    const api = this.opts.api();

    // Each distinct input file hashed once, uploaded only if the store lacks it.
    const paths = [...new Set(todo.flatMap((j) => j.inputs.map((f) => f.src)))];
    const digests = new Map<string, Digest>();
    await Promise.all(
      paths.map((p) =>
        api.limited(async () => {
          try {
            digests.set(p, await digestStream(createReadStream(p)));
          } catch (err) {
            throw new DispatchCloudError(
              "gahp.input_unreadable",
              `cannot read input file ${p}: ${err instanceof Error ? err.message : String(err)}`,
            );
          }
        }),
      ),
    );
    const byHash = new Map<string, { digest: Digest; path: string }>();
    for (const p of paths) {
      const d = digests.get(p) as Digest;
      byHash.set(d.hash, { digest: d, path: p });
    }
    const missing = await api.limited(() => api.cas.findMissing([...byHash.values()].map((v) => v.digest)));
    await Promise.all(
      missing.map((d) => {
        const f = byHash.get(d.hash);
        if (f === undefined) return Promise.resolve();
        return api.limited(() => api.cas.uploadFile(d, f.path));
      }),
    );
    this.opts.log(
      `submit ${req.batch}: ${todo.length} jobs, ${paths.length} input files, ${missing.length} uploaded`,
    );

    // Each distinct set of inputs one tree, kept as an upload bundle the jobs depend on.
    const treeOf = async (job: SubmitJob): Promise<string | null> => {
      if (job.inputs.length === 0) return null;
      const files = new Map<string, Digest>();
      for (const f of job.inputs) {
        const d = digests.get(f.src) as Digest;
        const had = files.get(f.dst);
        if (had !== undefined && had.hash !== d.hash)
          throw new DispatchCloudError(
            "gahp.bad_arguments",
            `job ${job.name} has two different input files named ${f.dst}`,
          );
        files.set(f.dst, d);
      }
      const manifest: Manifest = {
        version: 1,
        entries: [...files.entries()]
          .sort(([a], [b]) => comparePaths(a, b))
          .map(([path, digest]) => ({ path, type: "file", digest, executable: false })),
      };
      const key = formatDigest(manifestDigest(manifest));
      let upload = this.uploads.get(key);
      if (upload === undefined) {
        upload = (async () => {
          await api.limited(() => api.cas.putManifest(manifest));
          const b = await api.createUpload(key, bundleName(`inputs of ${req.batch}`));
          return b.uuid;
        })();
        this.uploads.set(key, upload);
        upload.catch(() => this.uploads.delete(key));
      }
      return upload;
    };
    const trees = await Promise.all(todo.map(treeOf));

    const items = todo.map((job, k) => bundleRequest(req, template, job, trees[k] ?? null));
    for (let start = 0; start < items.length; start += 1000) {
      const created = await api.createBundles(items.slice(start, start + 1000));
      for (const [k, b] of created.entries()) {
        const job = todo[start + k];
        if (job !== undefined) this.index(req.batch, job.name, b.uuid);
      }
    }
    return ["NULL"];
  }

  private async query(minMod: number, names: string[]): Promise<string[]> {
    const batches: { name: string; jobs: [string, string][] }[] = [];
    for (const name of names) {
      const entry = await this.batch(name);
      if (entry === undefined) throw this.noBatch(name);
      batches.push({ name, jobs: [...entry.jobs.entries()] });
    }
    const api = this.opts.api();
    // One listing of the caller's unfinished bundles, and a request for each job that has left it since the last
    // query; a job seen final is final for good and never asked about again.
    const live = await api.liveBundles();
    let serverSeconds = live.serverSeconds;
    const liveByUuid = new Map(live.bundles.map((b) => [b.uuid, b]));
    const view = (job: string, b: Pick<GahpBundle, "state" | "exitCode" | "updatedAt">): QueriedJob => ({
      job,
      status: boincStatus(b),
      mod: Date.parse(b.updatedAt) / 1000,
    });
    const views = await Promise.all(
      batches.map((b) =>
        Promise.all(
          b.jobs.map(async ([job, uuid]): Promise<QueriedJob> => {
            const done = this.finalViews.get(uuid);
            if (done !== undefined) return { ...done, job };
            const seen = liveByUuid.get(uuid);
            if (seen !== undefined) return view(job, seen);
            const { bundle, serverSeconds: s } = await api.bundle(uuid);
            serverSeconds = Math.min(serverSeconds, s);
            const v = view(job, bundle);
            if (FINAL.has(bundle.state)) this.finalViews.set(uuid, v);
            return v;
          }),
        ),
      ),
    );
    const now = Number.isFinite(serverSeconds) ? serverSeconds : this.now() / 1000;
    const changed = views.map((jobs) => jobs.filter((j) => minMod <= 0 || j.mod >= minMod));
    const fit = fitQueryReply(changed, Math.floor(now) - 2, (job) => this.reportedStatus.get(job));
    const reported = fit.batches;
    const serverTime = fit.serverTime;
    for (const js of reported) for (const j of js) this.reportedStatus.set(j.job, j.status);
    const out = ["NULL", seconds(serverTime)];
    for (const js of reported) {
      out.push(String(js.length));
      for (const j of js) out.push(j.job, j.status);
    }
    return out;
  }

  private async fetch(req: FetchRequest): Promise<string[]> {
    const found = await this.job(req.job);
    if (found === undefined) throw new DispatchCloudError("gahp.unknown_job", `no job named ${req.job}`);
    const api = this.opts.api();
    const { bundle } = await api.bundle(found.uuid);
    if (boincStatus(bundle) !== "DONE") {
      throw new DispatchCloudError(
        "gahp.job_not_done",
        `job ${req.job} is ${bundle.state}${bundle.stateReason === null ? "" : ` (${bundle.stateReason})`}: no result to fetch`,
      );
    }
    const place = (p: string) => (isAbsolute(p) ? p : join(req.dir, p));
    const write = async (what: string, fn: () => Promise<void>) => {
      try {
        await fn();
      } catch (err) {
        if (err instanceof DispatchCloudError && !err.code.startsWith("gahp.")) throw err;
        throw new DispatchCloudError(
          "gahp.output_failed",
          `cannot write ${what}: ${err instanceof Error ? err.message : String(err)}`,
        );
      }
    };
    if (req.stderr !== "") {
      const file = place(req.stderr);
      await write(`the stderr file ${file}`, () => api.downloadStderr(found.uuid, file));
    }
    const outputs = await api.outputFiles(found.uuid);
    const have = new Set(outputs.map((o) => o.path));
    const renamed = new Map(req.specs.map((s) => [s.src, s.dst]));
    const copies: { src: string; file: string }[] = [];
    if (req.all) {
      for (const o of outputs) {
        if (o.path.split("/").some((p) => p === ".." || p === "" || p === ".")) continue;
        copies.push({ src: o.path, file: place(renamed.get(o.path) ?? o.path) });
      }
    } else {
      const stderrFile = req.stderr === "" ? null : place(req.stderr);
      for (const s of req.specs) {
        // The gridmanager asks for the job's error file as an output too; it is written from the stderr log.
        if (!have.has(s.src) && place(s.dst) === stderrFile) continue;
        if (!have.has(s.src)) {
          throw new DispatchCloudError(
            "gahp.output_failed",
            `job ${req.job} has no output file ${s.src} (it has ${outputs.length} files)`,
          );
        }
        copies.push({ src: s.src, file: place(s.dst) });
      }
    }
    await Promise.all(
      copies.map((c) =>
        write(c.file, async () => {
          if (req.all) await mkdir(dirname(c.file), { recursive: true });
          await api.downloadOutput(found.uuid, c.src, c.file);
        }),
      ),
    );
    const ran =
      bundle.timings.finishedAt === null || bundle.timings.runningAt === null
        ? 0
        : Math.max(0, (Date.parse(bundle.timings.finishedAt) - Date.parse(bundle.timings.runningAt)) / 1000);
    const cpu = bundle.resourceUsage?.["cpuSeconds"] ?? 0;
    return ["NULL", String(bundle.exitCode ?? 0), seconds(ran), seconds(cpu)];
  }

  private async killAll(uuids: string[], reason: string): Promise<void> {
    const api = this.opts.api();
    await Promise.all(
      uuids.map(async (uuid) => {
        try {
          await api.kill(uuid, reason);
        } catch (err) {
          // Already final: nothing to abort.
          if (err instanceof DispatchCloudError && err.code === "bundle.conflict") return;
          throw err;
        }
      }),
    );
  }

  private async abort(names: string[]): Promise<string[]> {
    const uuids: string[] = [];
    const unknown: string[] = [];
    for (const name of names) {
      const j = await this.job(name);
      if (j === undefined) unknown.push(name);
      else uuids.push(j.uuid);
    }
    await this.killAll(uuids, "aborted by HTCondor (BOINC_ABORT_JOBS)");
    if (unknown.length > 0)
      throw new DispatchCloudError("gahp.unknown_job", `no job named ${unknown.join(", ")}`);
    return ["NULL"];
  }

  /** Kills what is still running of a batch and forgets it. */
  private async retire(batch: string, why: string): Promise<string[]> {
    const entry = await this.batch(batch);
    if (entry === undefined) throw this.noBatch(batch);
    if (entry.lease !== null) clearTimeout(entry.lease);
    entry.lease = null;
    const api = this.opts.api();
    const live: string[] = [];
    await Promise.all(
      [...entry.jobs.values()].map(async (uuid) => {
        const { bundle } = await api.bundle(uuid);
        if (!FINAL.has(bundle.state)) live.push(uuid);
      }),
    );
    await this.killAll(live, `${why} (batch ${batch})`);
    this.retired.add(batch);
    this.batches.delete(batch);
    for (const [job, uuid] of entry.jobs) {
      this.jobs.delete(job);
      this.reportedStatus.delete(job);
      this.finalViews.delete(uuid);
    }
    this.opts.log(`batch ${batch} ${why}: ${live.length} jobs aborted`);
    return ["NULL"];
  }

  private async setLease(batch: string, endSeconds: number): Promise<string[]> {
    const entry = await this.batch(batch);
    if (entry === undefined) throw this.noBatch(batch);
    if (entry.lease !== null) clearTimeout(entry.lease);
    const arm = () => {
      const left = endSeconds * 1000 - this.now();
      if (left <= 0) {
        entry.lease = null;
        void this.lockBatch(batch, () => this.retire(batch, "lease expired")).catch((err) =>
          this.opts.log(
            `batch ${batch}: lease expired, clean-up failed: ${err instanceof Error ? err.message : String(err)}`,
          ),
        );
        return;
      }
      entry.lease = setTimeout(arm, Math.min(left, 2 ** 31 - 1));
      entry.lease.unref();
    };
    arm();
    return ["NULL"];
  }

  /** Stops lease timers. */
  close(): void {
    for (const b of this.batches.values()) if (b.lease !== null) clearTimeout(b.lease);
  }
}
