/**
 * The contract between `dispatch-cloud worker` (a user's own machine) and the REST server (docs/workers.md):
 * the check-in body, the messages a check-in answers with, and their bounds. Both sides import it; the REST
 * server checks bodies against its schema (rest-server/workers/), the worker builds them.
 *
 *   POST /api/v1/workers/checkin    Authorization: Bearer dcw_...   body CheckinRequest -> CheckinResponse
 *     Answers at once when there is a message, else after at most `workers.longPoll` (about 2 s).
 *   POST /api/v1/workers/checkout   same token, body {workerId}: the worker stops (its bundles stay as they are;
 *                                   it hands them back first when it was asked to).
 *   GET  /api/v1/workers/artifact   same token: the runner artifact's bytes (header x-artifact-sha256).
 */
import type { StartDocumentSent } from "./runner-protocol.ts";

/** A tag of a worker, an instance type or a bundle (`resources.tag`). */
export const TAG_PATTERN = "^[a-z0-9][a-z0-9._-]{0,62}$";
export const MAX_TAGS = 32;
export const MAX_SLOTS = 256;
export const MAX_VCPUS = 4096;
/** 64 TiB: more RAM or disk than this is refused as implausible. */
export const MAX_BYTES = 64 * 1024 ** 4;
export const MAX_GPUS = 64;
export const MAX_CACHE_KEYS = 10_000;
export const MAX_NAME = 100;
export const WORKER_NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$";

/** What a worker says of its machine. Sizes in bytes. */
export interface WorkerResourcesReport {
  vcpus: number;
  ram: number;
  freeDisk: number;
  gpu: {
    stack: "cuda" | "rocm";
    deviceCount: number;
    vram: number;
    driverVersion?: string | null;
    hardwareTarget?: string | null;
  } | null;
}

export interface CheckinRequest {
  /** The worker's id (`dispatch-cloud workers token create` prints it); must be the token's worker. */
  workerId: string;
  /** lib/version.ts VERSION of the worker's program. */
  version: string;
  /** sha256 of the worker's own artifact file, or "" when it runs from sources (never upgraded). */
  artifactSha256: string;
  resources: WorkerResourcesReport;
  /** How many bundles it runs at once at most. */
  slots: number;
  tags: string[];
  /** Manifest keys of the trees its cache holds (crunch-run --list's cache line). */
  cache: string[];
  /** The bundles it runs or is starting: uuid and attempt. */
  running: { uuid: string; attempt: number }[];
  /** True while it takes no new bundles (it was told to drain, or it is stopping). */
  draining: boolean;
}

export type WorkerMessage =
  /** Start this bundle: the document crunch-run --detach takes (apiUrl: the worker uses its own --api-url). */
  | { type: "run"; uuid: string; attempt: number; startDocument: StartDocumentSent }
  /** Stop this bundle's runner (it was killed, or is no longer this worker's). */
  | { type: "kill"; uuid: string; attempt: number; reason: string }
  /** Take no new bundles; upgrade when none runs (the server's artifact differs from the worker's). */
  | { type: "drain"; reason: string }
  /** Nothing runs: fetch the artifact (GET /api/v1/workers/artifact), check its sha256, replace yourself. */
  | { type: "upgrade"; sha256: string; bytes: number; version: string };

export interface CheckinResponse {
  workerId: string;
  /** The server's VERSION and its runner artifact's sha256 ("" when it has none to offer). */
  serverVersion: string;
  artifactSha256: string;
  messages: WorkerMessage[];
}
