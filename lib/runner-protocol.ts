/**
 * The contract between the dispatcher and crunch-run on an instance, in one place both sides import: the start
 * document (its type, fields and bounds), the grammar of `crunch-run --list`, the spare supervisor's hand-off
 * framing, the `--version` line and the instance secret's path. docs/crunch-run.md describes the same contract
 * for people; a change here is a change of the protocol (a dispatcher and a runner of different versions meet
 * whenever a new runner is rolled out: only add optional fields, never change a line's meaning).
 */
import { VERSION } from "./version.ts";

// ---- the instance secret ----

/** Where the instance's boot script writes the secret the dispatcher checks first (below the instance root). */
export const INSTANCE_SECRET_FILE = "/var/run/dispatch-cloud-instance-secret";
/** The same, as a quoted shell word honouring the instance root convention. */
export const INSTANCE_SECRET_SHELL_PATH = `"\${DISPATCH_VM_ROOT:-}${INSTANCE_SECRET_FILE}"`;

// ---- --version ----

/** What `crunch-run --version` prints. */
export const versionLine = (version: string = VERSION): string => `crunch-run (dispatch-cloud) ${version}`;
/** A `--version` line, its version captured. */
export const VERSION_LINE = /^crunch-run \(dispatch-cloud\) (\S+)$/;

// ---- the start document ----

export type RuntimeEngine = "docker" | "process" | "auto";

/**
 * Credentials for one registry, for the pull of the bundle's image (Docker's X-Registry-Auth). The password is a
 * secret: crunch-run holds it in memory only, never logs it, never writes it to disk, never puts it in a message.
 */
export interface RegistryAuth {
  /** The registry host as the image reference names it (`127.0.0.1:5000`, `docker.io`). */
  server: string;
  username: string;
  password: string;
}
export const RUNTIME_ENGINES: readonly RuntimeEngine[] = ["docker", "process", "auto"];

/**
 * One JSON object the dispatcher writes to `crunch-run --detach <uuid>`'s stdin (or hands to a spare). It
 * carries the runner token, so it never travels in argv or the environment.
 */
export interface StartDocument {
  uuid: string;
  attempt: number;
  apiUrl: string;
  /** The bundle's runner token (`dcr_...`). Held in memory only; never logged. */
  token: string;
  instanceType: string;
  gpuDevices: number[];
  runtimeEngine: RuntimeEngine;
  heartbeatIntervalMs: number;
  /** The instance type is preemptible (spot): watch for interruption notices while the bundle runs. */
  preemptible: boolean;
  /** How often to ask the instance metadata service for a spot interruption notice; 0 = never. */
  spotCheckIntervalMs: number;
  /** The process runtime's uids (a supervisor running as root gives each bundle one of its own). */
  processUidFirst: number;
  processUidCount: number;
  /**
   * How many warm spare supervisors to keep ready on the instance (crunch-run/spare.ts): the number of bundles
   * that can start at once without a new process's start-up. 0 = none (every start goes through a new process).
   */
  warmSupervisors: number;
  /**
   * Credentials for the registry of the bundle's image (containers.registries), only that registry's entry;
   * empty when it has none configured (an anonymous pull).
   */
  registryAuth: RegistryAuth[];
  /** How long a pull whose registry is unavailable (network, 5xx, 429) is retried before the bundle is requeued. */
  imagePullRetryMs: number;
  /**
   * The docker runtime's cap on docker's own log of the bundle's container (json-file, in two files of this size):
   * what the daemon keeps on the instance's disk besides the log the supervisor sends, whatever the bundle writes.
   */
  containerLogMaxBytes: number;
  /**
   * A user's worker (docs/workers.md) sets these to its own pid and that process's start time (/proc/<pid>/stat
   * field 22): the supervisor stops the bundle (no finish) once that process is gone, so a killed worker's
   * bundles do not run on unwatched. 0 and "": none (cloud instances).
   */
  workerPid: number;
  workerPidStart: string;
  /**
   * The dispatcher handed this document over while its claim (the bundle `staged -> starting` with this token) was
   * still in flight: a warm pool whose `start` call finds the token unknown asks again for up to 2.5 s (the runner
   * API it calls may be another REST server than the dispatcher's own). false: the token is committed.
   */
  claimInFlight: boolean;
}

/** The fields crunch-run fills in with the defaults below when the document leaves them out. */
type Defaulted =
  | "heartbeatIntervalMs"
  | "preemptible"
  | "spotCheckIntervalMs"
  | "processUidFirst"
  | "processUidCount"
  | "warmSupervisors"
  | "registryAuth"
  | "imagePullRetryMs"
  | "containerLogMaxBytes"
  | "workerPid"
  | "workerPidStart"
  | "claimInFlight";
/** What the dispatcher sends: the required fields, and the defaulted ones only where they differ. */
export type StartDocumentSent = Omit<StartDocument, Defaulted> & Partial<Pick<StartDocument, Defaulted>>;

export const START_DOCUMENT_FIELDS: ReadonlySet<string> = new Set<keyof StartDocument>([
  "uuid",
  "attempt",
  "apiUrl",
  "token",
  "instanceType",
  "gpuDevices",
  "runtimeEngine",
  "heartbeatIntervalMs",
  "preemptible",
  "spotCheckIntervalMs",
  "processUidFirst",
  "processUidCount",
  "warmSupervisors",
  "registryAuth",
  "imagePullRetryMs",
  "containerLogMaxBytes",
  "workerPid",
  "workerPidStart",
  "claimInFlight",
]);

export const DEFAULT_HEARTBEAT_INTERVAL_MS = 5000;
export const DEFAULT_SPOT_CHECK_INTERVAL_MS = 5000;
/** Bounds of a non-zero spotCheckIntervalMs (the dispatcher clamps its config value into them). */
export const SPOT_CHECK_INTERVAL_RANGE_MS = { min: 10, max: 3_600_000 } as const;
/** The process runtime's uid range when the document names none (dispatcher.processRuntimeUids's default). */
export const DEFAULT_PROCESS_UIDS = { first: 1_900_000_000, count: 65_536 } as const;
/** Warm spare supervisors when the document names no number; at most MAX_WARM_SUPERVISORS. */
export const DEFAULT_WARM_SUPERVISORS = 2;
export const MAX_WARM_SUPERVISORS = 64;
/** containers.pullRetryTimeout's default, and the bounds of imagePullRetryMs. */
export const DEFAULT_IMAGE_PULL_RETRY_MS = 120_000;
export const IMAGE_PULL_RETRY_RANGE_MS = { min: 100, max: 24 * 3_600_000 } as const;
/** dispatcher.containerLogMaxSize's default, and the bounds of containerLogMaxBytes. */
export const DEFAULT_CONTAINER_LOG_MAX_BYTES = 256 * 2 ** 20;
export const CONTAINER_LOG_MAX_RANGE_BYTES = { min: 2 ** 20, max: 2 ** 40 } as const;
/** Most registryAuth entries a document may carry (the dispatcher sends at most one). */
export const MAX_REGISTRY_AUTH = 4;
/** The largest uid a range may reach (4294967295 is (uid_t)-1). */
export const MAX_UID = 4_294_967_294;

/** A configured value as a start document's bounded field allows it: rounded, then moved into the range. */
export function clampInto(range: { readonly min: number; readonly max: number }, value: number): number {
  return Math.min(range.max, Math.max(range.min, Math.round(value)));
}

/** A configured spot check interval (ms) as the start document allows it: 0 (never), else within the bounds. */
export function clampSpotCheckIntervalMs(ms: number): number {
  return ms <= 0 ? 0 : clampInto(SPOT_CHECK_INTERVAL_RANGE_MS, ms);
}

// ---- --list ----

const UUID = /^[a-z0-9]{5}-bndl-[a-z0-9]{15}$/;
const SPARE_SOCKET_PATH = /^\/[A-Za-z0-9._/+-]*\.sock$/;

/** A warm pool's socket path as `--list` and `--detach` may name it: absolute, `.sock`, no `..` step. */
export function isSpareSocketPath(path: unknown): path is string {
  return typeof path === "string" && SPARE_SOCKET_PATH.test(path) && !path.includes("/../");
}

export interface ListedRunners {
  /** uuid -> listed state. */
  runners: Map<string, "running" | "stale">;
  broken: boolean;
  /** crunch-run got a spot interruption notice on this instance (`preempted`): the cloud is taking it away. */
  preempted: boolean;
  /** The socket of a warm spare supervisor (`spare <path>`), to hand start documents to directly. */
  spare: string | null;
  /**
   * The cache keys (cacheKey) of the manifests whose trees the instance's cache holds in full (`cache <key>
   * ...`), most recently used first, at most MAX_CACHED_MANIFESTS; empty when the line is absent (an older
   * runner, or nothing cached).
   */
  cachedManifests: string[];
  /**
   * Why (part of) the `cache` line was ignored (words that are not keys, more than MAX_CACHED_MANIFESTS, a
   * second line); null when it was not. Never makes the rest of the list invalid.
   */
  cacheProblem: string | null;
  /** Lines that were none of the above (logged, otherwise ignored). */
  unknown: string[];
}

/** How many manifests a `cache` line names at most (the most recently used ones). */
export const MAX_CACHED_MANIFESTS = 256;
/** Hex characters of a manifest's sha256 that name it in a `cache` line (64 bits: collisions only cost a preference). */
export const CACHE_KEY_HEX = 16;
const CACHE_KEY = /^[0-9a-f]{16}$/;
const DIGEST_HASH = /^[0-9a-f]{64}(?:\/|$)/;

/**
 * The key of a manifest in a `cache` line: the first CACHE_KEY_HEX hex characters of its hash, from its digest
 * (`<sha256 hex>/<size>`) or its bare sha256 hex. Null for anything else.
 */
export function cacheKey(digest: string): string | null {
  return DIGEST_HASH.test(digest) ? digest.slice(0, CACHE_KEY_HEX) : null;
}

/** What formatList takes: the cached manifests are optional (as digests or their sha256 hex). */
export type ListToFormat = Omit<ListedRunners, "unknown" | "cachedManifests" | "cacheProblem"> & {
  /**
   * Digests (`<sha256>/<size>`) or sha256 hex of the manifests the cache holds in full, most recently used
   * first. Written as their cacheKey, without repeats, at most MAX_CACHED_MANIFESTS; anything that is not a
   * digest is left out (so `--list` never fails for its cache).
   */
  cachedManifests?: readonly string[];
};

/**
 * `crunch-run --list`'s lines: `<uuid>` for a live supervisor, `<uuid> stale` for a bundle whose supervisor is
 * gone but whose container or process still runs, then `broken`, `preempted` and `spare <socket>` when they
 * hold, then `cache <key> <key> ...` when the cache holds any manifest's tree in full (keys: cacheKey).
 */
export function formatList(list: ListToFormat): string[] {
  const lines: string[] = [];
  for (const [uuid, state] of list.runners) lines.push(state === "stale" ? `${uuid} stale` : uuid);
  if (list.broken) lines.push("broken");
  if (list.preempted) lines.push("preempted");
  if (list.spare !== null) lines.push(`spare ${list.spare}`);
  const keys = new Set<string>();
  for (const d of list.cachedManifests ?? []) {
    if (keys.size >= MAX_CACHED_MANIFESTS) break;
    const key = cacheKey(d);
    if (key !== null) keys.add(key);
  }
  if (keys.size > 0) lines.push(`cache ${[...keys].join(" ")}`);
  return lines;
}

/** The words of a `cache` line (after `cache`): its keys, and why any of it was ignored. */
function parseCacheLine(words: readonly string[]): { keys: string[]; problem: string | null } {
  const keys: string[] = [];
  const seen = new Set<string>();
  let bad = 0;
  let firstBad = "";
  let over = 0;
  for (const w of words) {
    if (!CACHE_KEY.test(w)) {
      if (bad++ === 0) firstBad = w.slice(0, 40);
      continue;
    }
    if (seen.has(w)) continue;
    if (keys.length >= MAX_CACHED_MANIFESTS) {
      over++;
      continue;
    }
    seen.add(w);
    keys.push(w);
  }
  const problems: string[] = [];
  if (bad > 0)
    problems.push(
      `${bad} word(s) that are not ${CACHE_KEY_HEX} hex characters ignored (first: ${JSON.stringify(firstBad)})`,
    );
  if (over > 0) problems.push(`${over} key(s) past the first ${MAX_CACHED_MANIFESTS} ignored`);
  return { keys, problem: problems.length === 0 ? null : `cache line: ${problems.join("; ")}` };
}

/** Parses `crunch-run --list` (formatList's grammar); lines it does not know are kept in `unknown`. */
export function parseList(stdout: string): ListedRunners {
  const out: ListedRunners = {
    runners: new Map(),
    broken: false,
    preempted: false,
    spare: null,
    cachedManifests: [],
    cacheProblem: null,
    unknown: [],
  };
  let cacheLines = 0;
  for (const raw of stdout.split("\n")) {
    const line = raw.trim();
    if (line === "") continue;
    if (line === "cache" || line.startsWith("cache ") || line.startsWith("cache\t")) {
      // Only the first cache line counts; nothing in it makes the rest of the list invalid.
      if (cacheLines++ === 0) {
        const { keys, problem } = parseCacheLine(
          line
            .slice(5)
            .trim()
            .split(/\s+/)
            .filter((w) => w !== ""),
        );
        out.cachedManifests = keys;
        out.cacheProblem = problem;
      } else if (cacheLines === 2) {
        out.cacheProblem = `${out.cacheProblem === null ? "cache line: " : `${out.cacheProblem}; `}a second cache line ignored`;
      }
      continue;
    }
    if (line === "broken") {
      out.broken = true;
      continue;
    }
    if (line === "preempted") {
      out.preempted = true;
      continue;
    }
    const spare = line.startsWith("spare ") ? line.slice("spare ".length) : null;
    if (isSpareSocketPath(spare)) {
      out.spare = spare;
      continue;
    }
    const [uuid, flag, ...rest] = line.split(/\s+/);
    if (
      uuid !== undefined &&
      UUID.test(uuid) &&
      rest.length === 0 &&
      (flag === undefined || flag === "stale")
    ) {
      out.runners.set(uuid, flag === "stale" ? "stale" : "running");
    } else {
      out.unknown.push(line.slice(0, 200));
    }
  }
  return out;
}

// ---- --detach's answer ----

/**
 * What `crunch-run --detach <uuid>` prints on success: one JSON line, `{"uuid", "pid"}`, and `spare` when the
 * instance has a warm pool at that socket (one took the document, or --detach has just started one), so the
 * dispatcher can hand its next bundles to the pool without waiting for the next probe's `--list`.
 */
export function formatDetachAnswer(answer: { uuid: string; pid: number; spare: string | null }): string {
  const { uuid, pid, spare } = answer;
  return JSON.stringify(spare === null ? { uuid, pid } : { uuid, pid, spare });
}

/** The warm pool's socket a `--detach` answer names (formatDetachAnswer); null when none, or not a socket path. */
export function detachAnswerSpare(stdout: string): string | null {
  try {
    const spare = (JSON.parse(stdout.trim()) as { spare?: unknown } | null)?.spare;
    return isSpareSocketPath(spare) ? spare : null;
  } catch {
    return null;
  }
}

// ---- the spare supervisor's hand-off ----

export interface SpareHandOff {
  /**
   * `detach`: from `crunch-run --detach`, which holds the bundle's lock; `start`: straight from the
   * dispatcher over SSH, so the spare takes the lock itself.
   */
  mode: "detach" | "start";
  uuid: string;
  /** The start document's JSON text. */
  doc: string;
}

/**
 * What a probe sends on the spare's socket instead of running `crunch-run --list`: the warm pool answers with
 * what `--list` would print (no process is started on the instance). A pool that does not know it refuses it.
 */
export const LIST_REQUEST = "list\n";

/** What a hand-off sends on the spare's socket: `<mode> <uuid>\n<start document>`. */
export const formatHandOff = (h: SpareHandOff): string => `${h.mode} ${h.uuid}\n${h.doc}`;

/** The largest start document a hand-off carries, and the largest request the warm pool reads (a `many` one). */
export const MAX_HAND_OFF_DOC = 128 * 1024;
export const MAX_HAND_OFF_REQUEST = 1024 * 1024;

export function parseHandOff(text: string): SpareHandOff | null {
  const nl = text.indexOf("\n");
  const m = /^(detach|start) (\S+)$/.exec(nl > 0 ? text.slice(0, nl) : "");
  if (m === null || text.length - nl - 1 > MAX_HAND_OFF_DOC) return null;
  return { mode: m[1] as SpareHandOff["mode"], uuid: m[2] as string, doc: text.slice(nl + 1) };
}

/**
 * Several hand-offs of one instance in one exchange (the dispatcher's starts of one scheduling pass):
 * `many <n>\n`, then n hand-offs, each `<mode> <uuid>\n<start document JSON>\n` (the JSON is one line). The pool
 * answers one line per hand-off, `<uuid> ` and then the line a single hand-off gets (pidAnswer or
 * refusedAnswer), in the order the spares answer, and closes once all are answered.
 */
export const MAX_HAND_OFFS = 64;

export function formatHandOffs(hs: readonly SpareHandOff[]): string {
  return `many ${hs.length}\n${hs.map((h) => formatHandOff({ ...h, doc: `${h.doc.replace(/\n+$/, "")}\n` })).join("")}`;
}

/** The hand-offs of a `many` request; null when the text is not one (or not well formed). */
export function parseHandOffs(text: string): SpareHandOff[] | null {
  const lines = text.split("\n");
  const m = /^many (\d{1,3})$/.exec(lines[0] ?? "");
  const n = m === null ? 0 : Number(m[1]);
  if (n < 1 || n > MAX_HAND_OFFS || lines.length !== 2 * n + 2 || lines[2 * n + 1] !== "") return null;
  const out: SpareHandOff[] = [];
  for (let i = 0; i < n; i++) {
    const h = parseHandOff(`${lines[1 + 2 * i]}\n${lines[2 + 2 * i]}\n`);
    if (h === null || out.some((o) => o.uuid === h.uuid)) return null;
    out.push(h);
  }
  return out;
}

/** One answer line of a `many` exchange: `<uuid> <answer>` (the answer's own newline ends it). */
export const manyAnswer = (uuid: string, answer: string): string => `${uuid} ${answer}`;

/** The answers of a `many` exchange by uuid (each the single hand-off's answer, `pid <pid>\n` or `refused ...`). */
export function parseManyAnswers(text: string): Map<string, string> {
  const out = new Map<string, string>();
  for (const line of text.split("\n")) {
    const sp = line.indexOf(" ");
    if (sp > 0) out.set(line.slice(0, sp), `${line.slice(sp + 1)}\n`);
  }
  return out;
}

/** The spare's answer: `pid <pid>\n` when it took the bundle, `refused <why>\n` when not. */
export const pidAnswer = (pid: number): string => `pid ${pid}\n`;
export const refusedAnswer = (why: string): string => `refused ${why.replace(/\n/g, " ")}\n`;
/** The pid of a `pid <pid>\n` answer, or null for any other answer. */
export function parsePidAnswer(answer: string): number | null {
  const m = /^pid (\d+)\n$/.exec(answer);
  return m === null ? null : Number(m[1]);
}
