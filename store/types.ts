/** Types shared by the store, the REST server, the dispatcher and the CLI. */

import type { WorkerResourcesReport } from "../lib/worker-protocol.ts";

export const BUNDLE_STATES = [
  "created",
  "staged",
  "starting",
  "running",
  "ready",
  "failed",
  "killed",
] as const;
export type BundleState = (typeof BUNDLE_STATES)[number];
export const FINAL_STATES: readonly BundleState[] = ["ready", "failed", "killed"];
export const isFinalState = (s: BundleState): boolean => FINAL_STATES.includes(s);

export const GPU_STACKS = ["cuda", "rocm"] as const;
export type GpuStack = (typeof GPU_STACKS)[number];

/** A bundle's GPU request. vram is per device, in bytes (0 = any). */
export interface GpuRequest {
  stack: GpuStack;
  deviceCount: number;
  vram: number;
  /** Minimum driver version "X.Y" (compared as a version, not a float), or null for any. */
  driverVersion: string | null;
  /** Acceptable hardware targets (CUDA compute capability or ROCm gfx target); empty = any. */
  hardwareTarget: string[];
}

/** Normalised resources: sizes in bytes. */
export interface BundleResources {
  vcpus: number;
  ram: number;
  scratch: number;
  gpu: GpuRequest | null;
  /** Run only on instance types and users' workers with this tag (docs/workers.md). Absent: anywhere. */
  tag?: string;
  /** Run only on the owner's own workers, never on a cloud instance (docs/workers.md). Absent: false. */
  workersOnly?: boolean;
}

/** Limits enforced by crunch-run. time in milliseconds, disk in bytes; null = none. */
export interface BundleLimits {
  time: number | null;
  disk: number | null;
  network: boolean;
}

export interface BundleDependency {
  /** uuid of the bundle whose output this one reads. */
  bundle: string;
  /** Path inside that bundle's output ("" = all of it). */
  subpath: string;
  /** Mount name under the bundle's inputs directory (defaults to the dependency's uuid). */
  name: string;
}

/** What a user submits, already validated and normalised by the REST server. */
export interface NewBundle {
  ownerUuid: string;
  name: string;
  command: string[];
  image: string;
  env: Record<string, string>;
  resources: BundleResources;
  preemptible: boolean;
  priority: number;
  limits: BundleLimits;
  dependencies: BundleDependency[];
  allowFailedDependencies: boolean;
  maxAttempts: number;
  /**
   * The image reference pinned at submit time (rest-server/image-resolve.ts; docs/images.md "Pinning"):
   * `sha256:<image id hex>` for an image in the store, `repo@sha256:<hex>` for a registry image. Absent or null:
   * the image is run as `image` names it. Every attempt gets the same.
   */
  imagePinned?: string | null;
  /** The image is in the content-addressed store (docs/images.md "Images in our store"); absent or null: not. */
  imageStore?: ImageStoreRef | null;
}

/** An image in the content-addressed store, as a bundle's spec names it. */
export interface ImageStoreRef {
  /** The manifest digest (`<sha256 hex>/<size>`) of the unpacked `docker save` tree. */
  manifest: string;
  /** The image's config digest, `sha256:<hex>` (the id `docker load` gives it). */
  imageId: string;
  /** The tree's file bytes. */
  bytes: number;
}

/** A stored bundle: what was submitted, plus its state and what the dispatcher and runner recorded. */
export interface Bundle extends NewBundle {
  uuid: string;
  attempt: number;
  state: BundleState;
  stateReason: string | null;
  schedulingStatus: string | null;
  instanceId: string | null;
  instanceType: string | null;
  gpuDevices: number[];
  exitCode: number | null;
  resourceUsage: Record<string, number> | null;
  /**
   * What its attempts have cost: each one that ran, its pricePerHour x the time it ran, added when it left
   * `running` (finished, killed, lost, given back). Null while none has been charged.
   */
  costDollars: number | null;
  /**
   * What the current (or last) attempt is charged per hour, fixed when the dispatcher started it (its share of its
   * instance's price then); null when no price is known. Optional only so that bundles built outside the store
   * need not set it.
   */
  pricePerHour?: number | null;
  /** Bumped (from one database sequence) by every write to the row. */
  changeSeq: number;
  createdAt: Date;
  updatedAt: Date;
  stagedAt: Date | null;
  startingAt: Date | null;
  runningAt: Date | null;
  finishedAt: Date | null;
  /**
   * When the current attempt's runner last sent a heartbeat (null: none yet). Optional only so that bundles
   * built outside the store (scheduler tests, the bench) need not set it; the store always does.
   */
  lastHeartbeatAt?: Date | null;
  /**
   * Its inputs' manifests and their trees' bytes (bundles.input_manifests, checked by readInputManifests), for
   * the scheduler's locality preference. Absent (or empty) when it has none, or the column held bad contents.
   */
  inputManifests?: readonly InputManifest[];
  /** Why the column's contents were ignored (bad contents), when they were: the dispatcher's queue warns. */
  inputManifestsProblem?: string;
  /**
   * The manifest (`<sha256 hex>/<size>`) of its outputs in the content-addressed store, recorded by the runner's
   * finish, and the bytes of their files. Absent when the outputs are an archive on the REST server's disk (an
   * older runner) or there are none yet.
   */
  outputManifest?: string;
  outputBytes?: number;
  /**
   * The user's own worker (docs/workers.md) its current attempt was given to; absent when it runs on an
   * instance or waits. instanceId is null while this is set.
   */
  workerId?: string;
}

/** One input tree of a bundle: its manifest's digest (`<sha256 hex>/<size>`) and the bytes of its files. */
export interface InputManifest {
  digest: string;
  bytes: number;
}

export interface BundleEvent {
  id: number;
  bundleUuid: string;
  fromState: BundleState | null;
  toState: BundleState;
  attempt: number;
  reason: string | null;
  /** Who caused it: "user:<uuid>", "dispatcher", "runner", "bundle-manager", "operator". */
  actor: string;
  createdAt: Date;
}

export interface User {
  uuid: string;
  name: string;
  isAdmin: boolean;
  createdAt: Date;
}

/** A user's API token as stored: everything but the secret (only its sha256 is kept, and never leaves the store). */
export interface ApiToken {
  /** `<cluster id>-tokn-<15 characters>`; not a secret. */
  id: string;
  userUuid: string;
  label: string;
  createdAt: Date;
  /** null: never expires. */
  expiresAt: Date | null;
  /** Last time it authenticated a request, to the minute (null: never used). */
  lastUsedAt: Date | null;
  /** null: not revoked. */
  revokedAt: Date | null;
}

/**
 * The result of a guarded transition. A lost race is a value, never an exception: `ok: false` says why and
 * carries the row as it is now (null if the bundle does not exist).
 */
export type TransitionResult =
  | { ok: true; bundle: Bundle }
  | { ok: false; reason: "not_found" | "wrong_state" | "wrong_attempt"; current: Bundle | null };

/**
 * NOTIFY channel written by every bundle transition; payload `<uuid> <state> <changeSeq>`, or for a batch of
 * new bundles one `* created <count>` (listeners re-read; none may take `*` for a bundle).
 */
export const BUNDLE_CHANNEL = "dispatch_cloud_bundles";

/** NOTIFY channel written by every stored log chunk; payload `<uuid> <attempt> <stream> <stored bytes>`. */
export const LOG_CHANNEL = "dispatch_cloud_logs";

export const LOG_STREAMS = ["stdout", "stderr"] as const;
export type LogStream = (typeof LOG_STREAMS)[number];

/** One numbered SQL migration (store/migrations/NNN_name.sql). */
export interface Migration {
  name: string;
  sql: string;
}

/**
 * NOTIFY channel of users' workers (docs/workers.md): the payload is a worker id. The dispatcher notifies it when
 * it gives that worker a bundle (its check-in, waiting in a long poll, answers at once); the REST server when a
 * check-in changed what the dispatcher should know (resources, tags, slots, state, cache).
 */
export const WORKER_CHANNEL = "dispatch_cloud_workers";

export type WorkerState = "new" | "active" | "draining" | "stopped" | "lost";

/** What a worker reported of its machine at its last check-in (lib/worker-protocol.ts; the server checked it). */
export type WorkerResources = WorkerResourcesReport;

/** One user's worker (store/migrations/010_workers.sql). */
export interface Worker {
  id: string;
  ownerUuid: string;
  name: string;
  state: WorkerState;
  disabledAt: Date | null;
  tags: string[];
  /** Null until its first check-in. */
  resources: WorkerResources | null;
  slots: number;
  version: string | null;
  artifactSha256: string | null;
  /** Manifest keys of the trees its cache holds. */
  cache: string[];
  running: { uuid: string; attempt: number }[];
  createdAt: Date;
  checkedInAt: Date | null;
  /** Milliseconds since its last check-in by the database's clock (null: never); filled by the queries that say so. */
  checkinAgeMs?: number | null;
}
