/**
 * The `schedulingStatus` sentences a queued bundle carries (dispatcher/README.md "A bundle's way"). One builder
 * per situation, so the scheduler, its tests and the docs say the same words. Times are HH:MM UTC.
 */
import type { CreateRefusal } from "../types.ts";

/** HH:MM in UTC of a time in milliseconds since the epoch. */
export function hhmm(ms: number): string {
  const d = new Date(ms);
  return `${String(d.getUTCHours()).padStart(2, "0")}:${String(d.getUTCMinutes()).padStart(2, "0")}`;
}

/** Every sentence of a bundle that is still waiting starts with its place in the queue (1 = next). */
export const inQueue = (position: number, sentence: string): string =>
  `waiting in queue at position ${position}: ${sentence}`;

/** A second clause that says what else could run the bundle (see waitingForIdle, onlyHeld). */
export const withHint = (sentence: string, hint: string | null): string =>
  hint === null ? sentence : `${sentence}; ${hint}`;

/** Planned on an instance that is booting (or not yet probed); `problem`: what went wrong there so far. */
export const waitingForBoot = (instanceId: string, typeName: string, problem: string | null = null): string =>
  `waiting for instance ${instanceId} (${typeName}) to boot${problem === null ? "" : ` (${problem})`}`;

/** Planned on an instance whose create call is still in flight. */
export const waitingForNewInstance = (typeName: string): string =>
  `waiting for a new ${typeName} instance to boot`;

/** The pool may not create instances: `max` is null when the cloud said so without a configured limit. */
export const atQuota = (instances: number, max: number | null): string =>
  max === null
    ? `at quota: the cloud refuses more instances (${instances} now)`
    : `at quota: ${instances} of ${max} instances`;

/** Every eligible type is blocked by a capacity error. */
export function noTypeAvailable(blocked: readonly { typeName: string; until: number }[]): string {
  const shown = blocked.slice(0, 3).map((b) => `${b.typeName} at capacity until ${hhmm(b.until)}`);
  const more = blocked.length > 3 ? `, and ${blocked.length - 3} more` : "";
  return `no instance type is available: ${shown.join(", ")}${more}`;
}

/** The pool refuses creates for a while (rate limit, too many creates in flight). */
export function waitingToCreate(refusal: CreateRefusal): string {
  switch (refusal.kind) {
    case "rate_limit":
      return `waiting to create an instance: the cloud API is rate-limited until ${hhmm(refusal.until)}`;
    case "max_concurrent":
      return `waiting to create an instance: ${refusal.inFlight} instance ${
        refusal.inFlight === 1 ? "create is" : "creates are"
      } in flight`;
    case "capacity":
      return `waiting to create an instance: ${refusal.message}`;
    case "runner_failed":
      return `waiting to create an instance: ${refusal.message}; next try at ${hhmm(refusal.until)}`;
    case "quota":
      return atQuota(refusal.instances, refusal.max);
  }
}

/** Hint: an instance of an eligible type exists but has no room now. */
export const waitingForIdle = (typeName: string): string =>
  `waiting for an idle instance of type ${typeName}`;

/** Hint: the only instances of an eligible type are held (they get no new bundles). */
export const onlyHeld = (typeName: string): string => `only held instances of type ${typeName} could run it`;

/** The bundle was just handed to an instance (kept in memory: the transition clears the stored status). */
export const startingOn = (instanceId: string): string => `starting on ${instanceId}`;

/** Bytes for people: `512 B`, `1.2 GiB` (binary units, one decimal). */
export function approxSize(bytes: number): string {
  const units = ["KiB", "MiB", "GiB", "TiB", "PiB"];
  if (bytes < 1024) return `${bytes} B`;
  let v = bytes / 1024;
  let u = 0;
  while (v >= 1024 && u < units.length - 1) {
    v /= 1024;
    u++;
  }
  return `${v.toFixed(1)} ${units[u]}`;
}

/** Why the instance was chosen: its cache holds `held` of the bundle's `total` input bytes (placement). */
export const forCache = (held: number, total: number): string =>
  `placed for its cache: ${approxSize(held)} of ${approxSize(total)} of inputs held there`;

/** Started on an instance chosen for its cache. */
export const startingOnForCache = (instanceId: string, held: number, total: number): string =>
  `starting on ${instanceId} (${forCache(held, total)})`;

/** Given to one of its owner's own workers (docs/workers.md), chosen for its cache when `cache` says so. */
export const startingOnWorker = (
  name: string,
  cache: { held: number; total: number } | null = null,
): string =>
  cache === null
    ? `starting on your worker ${name}`
    : `starting on your worker ${name} (${forCache(cache.held, cache.total)})`;

/**
 * It can run only on its owner's workers (a tag no instance type has, resources.workersOnly, or bigger than
 * every type) and none of them can take it now. `have`: how many of those workers (with the tag) are checked in.
 */
export function waitingForWorkers(opts: { tag: string | null; workersOnly: boolean; have: number }): string {
  const which = opts.tag === null ? "one of your workers" : `one of your workers with tag ${opts.tag}`;
  const why = opts.workersOnly ? " (it runs only on your own machines)" : "";
  const state =
    opts.have === 0
      ? "none is checked in"
      : opts.have === 1
        ? "the one checked in is busy or too small"
        : `all ${opts.have} checked in are busy or too small`;
  return `waiting for ${which}${why}: ${state}`;
}
