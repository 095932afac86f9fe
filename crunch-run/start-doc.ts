/**
 * Reading the start document (lib/runner-protocol.ts defines it): the JSON object the dispatcher writes to
 * `crunch-run --detach <uuid>`'s stdin, which `--detach` passes on to the supervisor through a pipe. Plain
 * validation code (no schema library) keeps crunch-run's start-up small.
 */
import { DispatchCloudError } from "../lib/errors.ts";
import {
  CONTAINER_LOG_MAX_RANGE_BYTES,
  DEFAULT_CONTAINER_LOG_MAX_BYTES,
  DEFAULT_HEARTBEAT_INTERVAL_MS,
  DEFAULT_IMAGE_PULL_RETRY_MS,
  DEFAULT_PROCESS_UIDS,
  DEFAULT_SPOT_CHECK_INTERVAL_MS,
  DEFAULT_WARM_SUPERVISORS,
  IMAGE_PULL_RETRY_RANGE_MS,
  MAX_REGISTRY_AUTH,
  MAX_UID,
  MAX_WARM_SUPERVISORS,
  type RegistryAuth,
  RUNTIME_ENGINES,
  type RuntimeEngine,
  SPOT_CHECK_INTERVAL_RANGE_MS,
  START_DOCUMENT_FIELDS,
  type StartDocument,
} from "../lib/runner-protocol.ts";

export type { RuntimeEngine, StartDocument };

const bad = (path: string, message: string) =>
  new DispatchCloudError("crunchrun.invalid_start_document", `start document: ${path} ${message}`, { path });

/** Parses and checks the start document for bundle `uuid`; throws crunchrun.invalid_start_document. */
export function parseStartDocument(text: string, uuid: string): StartDocument {
  let raw: unknown;
  try {
    raw = JSON.parse(text);
  } catch (err) {
    throw new DispatchCloudError(
      "crunchrun.invalid_start_document",
      `start document is not valid JSON: ${(err as Error).message}`,
      { path: "" },
    );
  }
  if (typeof raw !== "object" || raw === null || Array.isArray(raw)) {
    throw bad("(document)", "must be a JSON object");
  }
  const doc = raw as Record<string, unknown>;
  for (const key of Object.keys(doc)) {
    if (!START_DOCUMENT_FIELDS.has(key)) {
      throw bad(key, `is not a known field (known: ${[...START_DOCUMENT_FIELDS].join(", ")})`);
    }
  }
  const str = (key: string): string => {
    const v = doc[key];
    if (typeof v !== "string" || v === "") throw bad(key, "must be a non-empty string");
    return v;
  };
  const docUuid = str("uuid");
  if (docUuid !== uuid) throw bad("uuid", `must be the uuid on the command line (${uuid}); got ${docUuid}`);
  const attempt = doc["attempt"];
  if (typeof attempt !== "number" || !Number.isSafeInteger(attempt) || attempt < 1) {
    throw bad("attempt", "must be a whole number >= 1");
  }
  const apiUrl = str("apiUrl");
  let url: URL;
  try {
    url = new URL(apiUrl);
  } catch {
    throw bad("apiUrl", "must be an http:// or https:// URL");
  }
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    throw bad("apiUrl", "must be an http:// or https:// URL");
  }
  const token = doc["token"];
  // Never echo the token in the message: it is a secret even when malformed.
  if (typeof token !== "string" || !/^dcr_[A-Za-z0-9_-]{16,200}$/.test(token)) {
    throw bad("token", "must be a runner token (dcr_...)");
  }
  const instanceType = str("instanceType");
  const gpuDevices = doc["gpuDevices"] ?? [];
  if (!Array.isArray(gpuDevices)) throw bad("gpuDevices", "must be an array of device indices");
  gpuDevices.forEach((d, i) => {
    if (typeof d !== "number" || !Number.isSafeInteger(d) || d < 0 || d > 1023) {
      throw bad(`gpuDevices.${i}`, "must be a whole number from 0 to 1023");
    }
  });
  if (new Set(gpuDevices).size !== gpuDevices.length) throw bad("gpuDevices", "must not repeat a device");
  const engine = doc["runtimeEngine"] ?? "docker";
  if (typeof engine !== "string" || !RUNTIME_ENGINES.includes(engine as RuntimeEngine)) {
    throw bad("runtimeEngine", `must be one of ${RUNTIME_ENGINES.join(", ")}`);
  }
  const hb = doc["heartbeatIntervalMs"] ?? DEFAULT_HEARTBEAT_INTERVAL_MS;
  if (typeof hb !== "number" || !Number.isSafeInteger(hb) || hb < 10 || hb > 3_600_000) {
    throw bad("heartbeatIntervalMs", "must be a whole number of milliseconds from 10 to 3600000");
  }
  const preemptible = doc["preemptible"] ?? false;
  if (typeof preemptible !== "boolean") throw bad("preemptible", "must be true or false");
  const claimInFlight = doc["claimInFlight"] ?? false;
  if (typeof claimInFlight !== "boolean") throw bad("claimInFlight", "must be true or false");
  const spot = doc["spotCheckIntervalMs"] ?? DEFAULT_SPOT_CHECK_INTERVAL_MS;
  const { min, max } = SPOT_CHECK_INTERVAL_RANGE_MS;
  if (typeof spot !== "number" || !Number.isSafeInteger(spot) || (spot !== 0 && (spot < min || spot > max))) {
    throw bad(
      "spotCheckIntervalMs",
      `must be 0 (never) or a whole number of milliseconds from ${min} to ${max}`,
    );
  }
  const uidFirst = doc["processUidFirst"] ?? DEFAULT_PROCESS_UIDS.first;
  if (typeof uidFirst !== "number" || !Number.isSafeInteger(uidFirst) || uidFirst < 1 || uidFirst > MAX_UID) {
    throw bad("processUidFirst", `must be a uid from 1 to ${MAX_UID}`);
  }
  const uidCount = doc["processUidCount"] ?? DEFAULT_PROCESS_UIDS.count;
  if (
    typeof uidCount !== "number" ||
    !Number.isSafeInteger(uidCount) ||
    uidCount < 1 ||
    uidFirst + uidCount - 1 > MAX_UID
  ) {
    throw bad(
      "processUidCount",
      `must be a whole number >= 1 with processUidFirst + processUidCount - 1 <= ${MAX_UID}`,
    );
  }
  const warm = doc["warmSupervisors"] ?? DEFAULT_WARM_SUPERVISORS;
  if (typeof warm !== "number" || !Number.isSafeInteger(warm) || warm < 0 || warm > MAX_WARM_SUPERVISORS) {
    throw bad("warmSupervisors", `must be a whole number from 0 to ${MAX_WARM_SUPERVISORS}`);
  }
  const registryAuth = parseRegistryAuth(doc["registryAuth"] ?? []);
  const workerPid = doc["workerPid"] ?? 0;
  if (
    typeof workerPid !== "number" ||
    !Number.isSafeInteger(workerPid) ||
    workerPid < 0 ||
    workerPid > 4_194_304
  ) {
    throw bad("workerPid", "must be a process id (0: none)");
  }
  const workerPidStart = doc["workerPidStart"] ?? "";
  if (typeof workerPidStart !== "string" || !/^[0-9]{0,20}$/.test(workerPidStart)) {
    throw bad("workerPidStart", "must be a process start time (digits) or empty");
  }
  const pullRetry = doc["imagePullRetryMs"] ?? DEFAULT_IMAGE_PULL_RETRY_MS;
  const pr = IMAGE_PULL_RETRY_RANGE_MS;
  if (
    typeof pullRetry !== "number" ||
    !Number.isSafeInteger(pullRetry) ||
    pullRetry < pr.min ||
    pullRetry > pr.max
  ) {
    throw bad("imagePullRetryMs", `must be a whole number of milliseconds from ${pr.min} to ${pr.max}`);
  }
  const logMax = doc["containerLogMaxBytes"] ?? DEFAULT_CONTAINER_LOG_MAX_BYTES;
  const lr = CONTAINER_LOG_MAX_RANGE_BYTES;
  if (typeof logMax !== "number" || !Number.isSafeInteger(logMax) || logMax < lr.min || logMax > lr.max) {
    throw bad("containerLogMaxBytes", `must be a whole number of bytes from ${lr.min} to ${lr.max}`);
  }
  return {
    uuid,
    attempt,
    apiUrl: apiUrl.replace(/\/+$/, ""),
    token,
    instanceType,
    gpuDevices: gpuDevices as number[],
    runtimeEngine: engine as RuntimeEngine,
    heartbeatIntervalMs: hb,
    preemptible,
    spotCheckIntervalMs: spot,
    processUidFirst: uidFirst,
    processUidCount: uidCount,
    warmSupervisors: warm,
    registryAuth,
    imagePullRetryMs: pullRetry,
    containerLogMaxBytes: logMax,
    workerPid,
    workerPidStart,
    claimInFlight,
  };
}

const REGISTRY_HOST = /^[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]{1,5})?$/;

/**
 * registryAuth: at most MAX_REGISTRY_AUTH {server, username, password} entries. Messages name the entry and the
 * field, never a value (the password is a secret, and a misplaced one may sit in any field).
 */
function parseRegistryAuth(raw: unknown): RegistryAuth[] {
  if (!Array.isArray(raw) || raw.length > MAX_REGISTRY_AUTH) {
    throw bad(
      "registryAuth",
      `must be an array of at most ${MAX_REGISTRY_AUTH} {server, username, password}`,
    );
  }
  return raw.map((entry: unknown, i) => {
    const at = `registryAuth.${i}`;
    if (typeof entry !== "object" || entry === null || Array.isArray(entry)) {
      throw bad(at, "must be an object {server, username, password}");
    }
    const e = entry as Record<string, unknown>;
    for (const key of Object.keys(e)) {
      if (key !== "server" && key !== "username" && key !== "password") {
        throw bad(at, "has a field other than server, username and password");
      }
    }
    const { server, username, password } = e;
    if (typeof server !== "string" || !REGISTRY_HOST.test(server) || server.length > 255) {
      throw bad(`${at}.server`, "must be a registry host (host or host:port)");
    }
    if (typeof username !== "string" || username.length > 1024) {
      throw bad(`${at}.username`, "must be a string of at most 1024 characters");
    }
    if (typeof password !== "string" || password.length > 16384) {
      throw bad(`${at}.password`, "must be a string of at most 16384 characters");
    }
    return { server, username, password };
  });
}
