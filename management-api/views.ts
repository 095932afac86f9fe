import { type IdleBehavior, queueOrder, type UserWorkerView, type WorkerView } from "../dispatcher/types.ts";
import type { Bundle } from "../store/types.ts";
import type { BundleItem, InstanceItem, UserWorkerItem } from "./schemas.ts";

/** What the management API needs of the dispatcher's parts (a subset of dispatcher/main.ts Parts). */
export interface ManagementParts {
  pool: {
    workers(): readonly WorkerView[];
    worker(id: string): WorkerView | undefined;
    setIdleBehavior(workerId: string, behavior: IdleBehavior): Promise<void>;
    shutdown(workerId: string, reason: string): void;
  };
  queue: { all(): Iterable<Bundle>; get(uuid: string): Bundle | undefined; apply(bundle: Bundle): void };
  scheduler: {
    statusOf(uuid: string): string | undefined;
    /** Why the bundle was started where it is, when it was placed for its cache. */
    placementOf?(uuid: string): string | undefined;
    /** The instance types that could run the bundle, cheapest first. */
    eligibleTypes(bundle: Bundle): readonly string[];
  };
  /** Users' own workers (docs/workers.md); absent: none. */
  userWorkers?: { views(): UserWorkerView[] };
}

/** The dispatcher as the management API sees it: its parts while active, null as a standby. */
export interface ManagementSource {
  readonly active: boolean;
  readonly parts: ManagementParts | null;
}

const iso = (ms: number): string => new Date(ms).toISOString();

export function instanceItem(w: WorkerView, nowMs: number): InstanceItem {
  return {
    instanceId: w.id,
    address: w.address,
    instanceType: w.instanceType.name,
    providerType: w.instanceType.providerType,
    price: w.instanceType.price,
    state: w.state,
    idleBehavior: w.idleBehavior,
    preempted: w.preempted === true,
    problem: w.problem ?? null,
    runningBundles: [...w.runners.keys()].sort(),
    lastBusyAt: w.placeholder ? null : iso(w.lastBusy),
    stateSince: iso(w.stateSince),
    secondsInState: Math.max(0, Math.floor((nowMs - w.stateSince) / 1000)),
  };
}

/** Every instance, creates in flight included (as booting, under their placeholder ids), by id. */
export function instanceItems(parts: ManagementParts, nowMs: number): InstanceItem[] {
  return [...parts.pool.workers()]
    .sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0))
    .map((w) => instanceItem(w, nowMs));
}

export function bundleItem(b: Bundle, parts: ManagementParts): BundleItem {
  const status = b.state === "staged" ? parts.scheduler.statusOf(b.uuid) : undefined;
  const placement = parts.scheduler.placementOf?.(b.uuid);
  return {
    uuid: b.uuid,
    state: b.state,
    priority: b.priority,
    resources: b.resources,
    eligibleTypes: [...parts.scheduler.eligibleTypes(b)],
    firstSeenAt: (b.stagedAt ?? b.createdAt).toISOString(),
    schedulingStatus: status ?? b.schedulingStatus,
    instanceId: b.state === "staged" ? null : b.instanceId,
    ...(b.state !== "staged" && b.workerId !== undefined ? { workerId: b.workerId } : {}),
    ...(placement === undefined ? {} : { placement }),
  };
}

/**
 * The queue: staged bundles in the scheduler's order (priority, then age), then the starting and running
 * ones in the same order.
 */
export function bundleItems(parts: ManagementParts): BundleItem[] {
  const staged: Bundle[] = [];
  const active: Bundle[] = [];
  for (const b of parts.queue.all()) (b.state === "staged" ? staged : active).push(b);
  staged.sort(queueOrder);
  active.sort(queueOrder);
  return [...staged, ...active].map((b) => bundleItem(b, parts));
}

/** Users' own workers the dispatcher reads (active and draining), by id. */
export function userWorkerItems(parts: ManagementParts): UserWorkerItem[] {
  return (parts.userWorkers?.views() ?? [])
    .map((v) => ({ ...v, tags: [...v.tags], bundles: [...v.bundles] }))
    .sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
}
