/**
 * Instance type choice (ARVADOS-FACTS.md §5 "Eligible types"): which configured types can run a bundle, and
 * when none can, why not and which type came closest.
 */
import type { InstanceType } from "../../cloud-drivers/types.ts";
import type { Config } from "../../config/schema.ts";
import { formatSize } from "../../lib/units.ts";
import type { Bundle } from "../../store/types.ts";
import type { Demand } from "../types.ts";

/** A bundle's demand: RAM is (ram + reserveExtraRam) x 100/95, rounded up to a whole byte. */
export function demandOf(
  bundle: Bundle,
  opts: { reserveExtraRam: number; alwaysUsePreemptibleInstances?: boolean },
): Demand {
  const r = bundle.resources;
  return {
    vcpus: r.vcpus,
    ram: Math.ceil(((r.ram + opts.reserveExtraRam) * 100) / 95),
    scratch: r.scratch,
    gpu: r.gpu === null || r.gpu.deviceCount <= 0 ? null : r.gpu,
    preemptible: bundle.preemptible || opts.alwaysUsePreemptibleInstances === true,
    ...(r.tag === undefined ? {} : { tag: r.tag }),
    ...(r.workersOnly === true ? { workersOnly: true } : {}),
  };
}

/**
 * The share of an instance of `type` a bundle of `demand` takes from every other bundle, 0..1: the largest of its
 * vCPUs, RAM and scratch (as the scheduler counts them) and GPU devices over the type's, and of one bundle slot
 * when `cloud.maxRunningBundlesPerInstance` (`perInstance`) is set. A bundle that fills any of them, or its slots,
 * takes the whole instance. What its cost is charged on (chargePerHour).
 */
export function shareOfInstance(demand: Demand, type: InstanceType, perInstance: number): number {
  let share = perInstance > 0 ? 1 / perInstance : 0;
  const part = (want: number, has: number) => {
    if (want > 0) share = Math.max(share, has > 0 ? want / has : 1);
  };
  part(demand.vcpus, type.vcpus);
  part(demand.ram, type.ram);
  part(demand.scratch, type.scratch);
  part(demand.gpu?.deviceCount ?? 0, type.gpu?.deviceCount ?? 0);
  return Math.min(share, 1);
}

/**
 * What a bundle is charged per hour of running on an instance of `type` that costs `instancePrice` an hour (its
 * spot price now, or the type's price): that price x its share of the instance (shareOfInstance), so the bundles
 * packed onto one instance are charged its price once between them, not once each. The dispatcher fixes it when it
 * starts an attempt (StartItem.pricePerHour, store/transitions.ts).
 */
export function chargePerHour(
  config: Pick<Config, "dispatcher" | "cloud">,
): (bundle: Bundle, type: InstanceType, instancePrice: number) => number {
  const { demand: opts } = eligibilityOptions(config);
  const perInstance = config.cloud.maxRunningBundlesPerInstance;
  return (bundle, type, instancePrice) =>
    instancePrice * shareOfInstance(demandOf(bundle, opts), type, perInstance);
}

export type EligibleResult =
  | { ok: true; types: InstanceType[] }
  | { ok: false; reason: string; closest: string | null };

/**
 * Compares dotted versions numerically, part by part ("11.10" > "11.9", "12" == "12.0"). Parts that are not
 * both numbers compare as strings. Returns a negative number, 0 or a positive number.
 */
export function compareVersions(a: string, b: string): number {
  const pa = a.trim().split(".");
  const pb = b.trim().split(".");
  for (let i = 0; i < Math.max(pa.length, pb.length); i++) {
    const x = pa[i] ?? "0";
    const y = pb[i] ?? "0";
    const numeric = /^\d+$/.test(x) && /^\d+$/.test(y);
    const c = numeric ? Math.sign(Number(x) - Number(y)) : x < y ? -1 : x > y ? 1 : 0;
    if (c !== 0) return c;
  }
  return 0;
}

/** The needs a type can fail, in the order the reason names them (the three GPU ones share a clause). */
type Need =
  | "vcpus"
  | "ram"
  | "scratch"
  | "preemptible"
  | "gpuStack"
  | "gpuCount"
  | "gpuVram"
  | "driver"
  | "target";
const GPU_NEEDS: readonly Need[] = ["gpuStack", "gpuCount", "gpuVram"];

/** The needs of demand that type does not meet (empty when it fits). A type without the GPU stack fails all. */
function unmet(d: Demand, t: InstanceType): Need[] {
  const out: Need[] = [];
  if (t.vcpus < d.vcpus) out.push("vcpus");
  if (t.ram < d.ram) out.push("ram");
  if (t.scratch < d.scratch) out.push("scratch");
  if (t.preemptible !== d.preemptible) out.push("preemptible");
  const g = d.gpu;
  if (g === null) return out;
  const tg = t.gpu !== null && t.gpu.stack === g.stack ? t.gpu : null;
  if (tg === null) out.push("gpuStack");
  if (tg === null || tg.deviceCount < g.deviceCount) out.push("gpuCount");
  if (g.vram > 0 && (tg === null || tg.vram < g.vram)) out.push("gpuVram");
  if (g.driverVersion !== null && (tg === null || compareVersions(tg.driverVersion, g.driverVersion) < 0)) {
    out.push("driver");
  }
  if (g.hardwareTarget.length > 0 && (tg === null || !targetOk(g, tg.hardwareTarget))) out.push("target");
  return out;
}

/**
 * The hardware target rule: one requested CUDA target is a minimum (compute capabilities compare as versions);
 * otherwise the type's target must be one of those listed (ROCm gfx targets compare as strings).
 */
function targetOk(g: NonNullable<Demand["gpu"]>, target: string): boolean {
  const want = g.hardwareTarget;
  if (want.length === 0) return true;
  if (g.stack === "cuda") {
    if (want.length === 1) return compareVersions(target, want[0]!) >= 0;
    return want.some((w) => compareVersions(target, w) === 0);
  }
  return want.includes(target);
}

/** The per-type test eligibleTypes uses: resources, preemptible and GPU rules (not the price cut). */
export function fits(demand: Demand, type: InstanceType): boolean {
  if (demand.workersOnly === true) return false;
  if (demand.tag !== undefined && type.tags?.includes(demand.tag) !== true) return false;
  return unmet(demand, type).length === 0;
}

/** Cheapest first; at equal price more RAM, then more vCPUs, then more scratch, then name. */
export function compareTypes(a: InstanceType, b: InstanceType): number {
  return (
    a.price - b.price ||
    b.ram - a.ram ||
    b.vcpus - a.vcpus ||
    b.scratch - a.scratch ||
    (a.name < b.name ? -1 : a.name > b.name ? 1 : 0)
  );
}

/**
 * The types that can run demand, cheapest first (see compareTypes), without those priced above the cheapest
 * one x max(maximumPriceFactor, 1). When none fits: the unmet need(s) of the closest type (the one failing
 * fewest needs, cheapest on a tie), each said against the largest type for that need when no type meets it.
 * `reserveExtraRam` is only used to explain a RAM shortfall.
 */
export function eligibleTypes(
  demand: Demand,
  types: readonly InstanceType[],
  opts: { maximumPriceFactor: number; reserveExtraRam?: number },
): EligibleResult {
  if (demand.workersOnly === true) {
    return { ok: false, reason: "it runs only on your own workers (resources.workersOnly)", closest: null };
  }
  const tag = demand.tag;
  if (tag !== undefined && !types.some((t) => t.tags?.includes(tag) === true)) {
    return { ok: false, reason: `no instance type has tag ${tag}`, closest: null };
  }
  const candidates = tag === undefined ? types : types.filter((t) => t.tags?.includes(tag) === true);
  const fitting = candidates.filter((t) => fits(demand, t)).sort(compareTypes);
  const cheapest = fitting[0];
  if (cheapest !== undefined) {
    const limit = cheapest.price * Math.max(opts.maximumPriceFactor, 1);
    return { ok: true, types: fitting.filter((t) => t.price <= limit) };
  }
  if (types.length === 0) return { ok: false, reason: "no instance types are configured", closest: null };

  const failing = candidates.map((type) => ({ type, needs: unmet(demand, type) }));
  const closest = failing.sort((a, b) => a.needs.length - b.needs.length || compareTypes(a.type, b.type))[0]!;
  const clauses = new Set(
    closest.needs.map((need) => explain(need, demand, failing, closest.type, opts.reserveExtraRam)),
  );
  return {
    ok: false,
    reason: `no instance type fits: ${[...clauses].join("; ")}`,
    closest: closest.type.name,
  };
}

/** A size for people: exact when formatSize gives a round unit, else one decimal of the largest binary unit. */
function approxSize(bytes: number): string {
  const exact = formatSize(bytes);
  if (!/^\d+B$/.test(exact) || bytes < 1024) return exact;
  const units = ["KiB", "MiB", "GiB", "TiB", "PiB"];
  let v = bytes / 1024;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${Number(v.toFixed(1))}${units[i]}`;
}

const gpus = (n: number, stack: string) => `${n} ${stack} GPU${n === 1 ? "" : "s"}`;
const gpuText = (t: InstanceType) =>
  t.gpu === null ? "no GPU" : `${gpus(t.gpu.deviceCount, t.gpu.stack)} with ${formatSize(t.gpu.vram)} each`;

type Failing = { type: InstanceType; needs: Need[] };

/**
 * One clause of the reason: what is needed, and what the closest type has — or, when no type meets the need,
 * what the largest (newest) type for that need has. Among equally large types, the one failing fewest needs,
 * then the cheapest.
 */
function explain(
  need: Need,
  d: Demand,
  failing: readonly Failing[],
  closest: InstanceType,
  reserveExtraRam: number | undefined,
): string {
  const g = d.gpu;
  const group = GPU_NEEDS.includes(need) ? GPU_NEEDS : [need];
  const nobody = !failing.some((f) => !f.needs.some((n) => group.includes(n)));
  const largest = (candidates: readonly Failing[], cmp: (a: InstanceType, b: InstanceType) => number) =>
    [...candidates].sort(
      (a, b) => cmp(b.type, a.type) || a.needs.length - b.needs.length || compareTypes(a.type, b.type),
    )[0]?.type;
  const against = (metric: (t: InstanceType) => number, has: (t: InstanceType) => string) => {
    if (!nobody) return `the closest type, ${closest.name}, has ${has(closest)}`;
    const best = largest(failing, (a, b) => metric(a) - metric(b))!;
    return `the largest type, ${best.name}, has ${has(best)}`;
  };
  const sameStack = failing.filter((f) => f.type.gpu?.stack === g?.stack);
  const againstVersion = (value: (t: InstanceType) => string) => {
    if (!nobody) return `the closest type, ${closest.name}, has ${value(closest)}`;
    const best = largest(sameStack, (a, b) => compareVersions(value(a), value(b)));
    if (best === undefined) return `no type has ${g!.stack} GPUs`;
    return `the newest type, ${best.name}, has ${value(best)}`;
  };
  switch (need) {
    case "vcpus":
      return `needs ${d.vcpus} vCPUs; ${against(
        (t) => t.vcpus,
        (t) => String(t.vcpus),
      )}`;
    case "ram": {
      const how =
        reserveExtraRam === undefined
          ? "with reserveExtraRam, /0.95"
          : `with ${formatSize(reserveExtraRam)} reserved, /0.95`;
      return `needs ${approxSize(d.ram)} of RAM (${how}); ${against(
        (t) => t.ram,
        (t) => formatSize(t.ram),
      )}`;
    }
    case "scratch":
      return `needs ${approxSize(d.scratch)} of scratch; ${against(
        (t) => t.scratch,
        (t) => formatSize(t.scratch),
      )}`;
    case "preemptible": {
      const kind = d.preemptible ? "a preemptible" : "a non-preemptible";
      if (nobody) return `needs ${kind} instance type; none is configured`;
      return `needs ${kind} instance type; the closest type, ${closest.name}, is ${d.preemptible ? "not " : ""}preemptible`;
    }
    case "gpuStack":
    case "gpuCount":
    case "gpuVram": {
      const want = `${gpus(g!.deviceCount, g!.stack)}${g!.vram > 0 ? ` with ${formatSize(g!.vram)} each` : ""}`;
      if (!nobody) return `needs ${want}; the closest type, ${closest.name}, has ${gpuText(closest)}`;
      const gpuSize = (t: InstanceType) => (t.gpu === null ? 0 : t.gpu.deviceCount * t.gpu.vram);
      const best = largest(
        sameStack,
        (a, b) => gpuSize(a) - gpuSize(b) || a.gpu!.deviceCount - b.gpu!.deviceCount,
      );
      if (best === undefined) return `no instance type has ${want} (no type has ${g!.stack} GPUs)`;
      return `no instance type has ${want} (largest: ${best.name}, ${best.gpu!.deviceCount} x ${formatSize(best.gpu!.vram)})`;
    }
    case "driver":
      return `needs a ${g!.stack} driver version >= ${g!.driverVersion}; ${againstVersion(
        (t) => t.gpu?.driverVersion ?? "",
      )}`;
    case "target": {
      const list = g!.hardwareTarget;
      const want =
        g!.stack === "cuda" && list.length === 1
          ? `a CUDA hardware target >= ${list[0]}`
          : `a ${g!.stack} hardware target in [${list.join(", ")}]`;
      return `needs ${want}; ${againstVersion((t) => t.gpu?.hardwareTarget ?? "")}`;
    }
  }
}

/** The config's options for demandOf and eligibleTypes. */
export function eligibilityOptions(config: Pick<Config, "dispatcher">) {
  const d = config.dispatcher;
  return {
    demand: {
      reserveExtraRam: d.reserveExtraRam,
      alwaysUsePreemptibleInstances: d.alwaysUsePreemptibleInstances,
    },
    eligible: { maximumPriceFactor: d.maximumPriceFactor, reserveExtraRam: d.reserveExtraRam },
  };
}

/**
 * The names of a bundle's eligible types, cheapest first ([] when none fits), cached per demand (the config
 * does not change in a process): for the management API's queue view and the queue metrics.
 */
export function createEligibleNames(
  config: Pick<Config, "dispatcher">,
  types: readonly InstanceType[],
): (bundle: Bundle) => string[] {
  const cache = new Map<string, string[]>();
  const opts = eligibilityOptions(config);
  return (bundle) => {
    const demand = demandOf(bundle, opts.demand);
    const key = JSON.stringify(demand);
    let names = cache.get(key);
    if (names === undefined) {
      const r = eligibleTypes(demand, types, opts.eligible);
      names = r.ok ? r.types.map((t) => t.name) : [];
      cache.set(key, names);
    }
    return names;
  };
}
