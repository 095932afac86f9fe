/** What the APIs return: bundles and events as JSON with ISO timestamps, and the list cursor. */
import { DispatchCloudError } from "../lib/errors.ts";
import { BUNDLE_UUID_PATTERN } from "../lib/tokens.ts";
import { type Bundle, type BundleEvent, isFinalState } from "../store/types.ts";

const iso = (d: Date | null): string | null => (d === null ? null : d.toISOString());

/**
 * What a bundle has cost by `nowMs`: what its ended attempts were charged, plus, while an attempt runs, its price
 * per hour x the time it has run so far (charged for good when it leaves `running`: store/transitions.ts).
 */
export function costSoFar(b: Bundle, nowMs: number): number | null {
  const price = b.pricePerHour ?? null;
  if (b.state !== "running" || price === null || b.runningAt === null) return b.costDollars;
  return (b.costDollars ?? 0) + (price * Math.max(0, nowMs - b.runningAt.getTime())) / 3_600_000;
}

/** A bundle as the users' API shows it. The runner token hash never leaves the store. */
export function bundleView(b: Bundle, nowMs: number) {
  const queuedUntil = b.startingAt ?? (isFinalState(b.state) ? b.finishedAt : null);
  const queuedMs = (queuedUntil === null ? nowMs : queuedUntil.getTime()) - b.createdAt.getTime();
  return {
    uuid: b.uuid,
    ownerUuid: b.ownerUuid,
    name: b.name,
    state: b.state,
    stateReason: b.stateReason,
    schedulingStatus: b.schedulingStatus,
    command: b.command,
    image: b.image,
    imagePinned: b.imagePinned ?? null,
    env: b.env,
    resources: b.resources,
    preemptible: b.preemptible,
    priority: b.priority,
    limits: b.limits,
    dependencies: b.dependencies,
    allowFailedDependencies: b.allowFailedDependencies,
    attempt: b.attempt,
    maxAttempts: b.maxAttempts,
    instanceId: b.instanceId,
    instanceType: b.instanceType,
    workerId: b.workerId ?? null,
    gpuDevices: b.gpuDevices,
    exitCode: b.exitCode,
    resourceUsage: b.resourceUsage,
    costDollars: costSoFar(b, nowMs),
    outputManifest: b.outputManifest ?? null,
    outputBytes: b.outputBytes ?? null,
    timings: {
      createdAt: b.createdAt.toISOString(),
      stagedAt: iso(b.stagedAt),
      startingAt: iso(b.startingAt),
      runningAt: iso(b.runningAt),
      finishedAt: iso(b.finishedAt),
      lastHeartbeatAt: iso(b.lastHeartbeatAt ?? null),
      queuedSeconds: Math.max(0, queuedMs) / 1000,
    },
    createdAt: b.createdAt.toISOString(),
    updatedAt: b.updatedAt.toISOString(),
  };
}
export type BundleView = ReturnType<typeof bundleView>;

export function eventView(e: BundleEvent) {
  return {
    id: e.id,
    bundleUuid: e.bundleUuid,
    fromState: e.fromState,
    toState: e.toState,
    attempt: e.attempt,
    reason: e.reason,
    actor: e.actor,
    createdAt: e.createdAt.toISOString(),
  };
}

export interface ListCursor {
  createdAt: Date;
  uuid: string;
}

/** The cursor is opaque to clients: base64url of `{"createdAt": ISO, "uuid": ...}`. */
export function encodeCursor(c: ListCursor): string {
  return Buffer.from(JSON.stringify({ createdAt: c.createdAt.toISOString(), uuid: c.uuid }), "utf8").toString(
    "base64url",
  );
}

const CURSOR_TIME = /^[1-9][0-9]{3}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z$/;

export function decodeCursor(text: string): ListCursor {
  const bad = () =>
    new DispatchCloudError("request.invalid_query", "cursor: not a cursor returned by this API", {
      path: "cursor",
    });
  if (text.length > 500 || !/^[A-Za-z0-9_-]+$/.test(text)) throw bad();
  let parsed: unknown;
  try {
    parsed = JSON.parse(Buffer.from(text, "base64url").toString("utf8"));
  } catch {
    throw bad();
  }
  if (typeof parsed !== "object" || parsed === null) throw bad();
  const { createdAt, uuid } = parsed as Record<string, unknown>;
  if (
    typeof createdAt !== "string" ||
    typeof uuid !== "string" ||
    !new RegExp(BUNDLE_UUID_PATTERN).test(uuid)
  ) {
    throw bad();
  }
  // What encodeCursor writes, for years 1000-9999: well inside PostgreSQL's timestamptz range (4713 BC to
  // 294276 AD), where JavaScript's own range (+-275760) is not.
  if (!CURSOR_TIME.test(createdAt)) throw bad();
  const date = new Date(createdAt);
  if (Number.isNaN(date.getTime()) || date.toISOString() !== createdAt) throw bad();
  return { createdAt: date, uuid };
}
