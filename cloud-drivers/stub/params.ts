import { DispatchCloudError } from "../../lib/errors.ts";
import { parseDuration } from "../../lib/units.ts";
import type { StubCloudOptions, VmSelector } from "./knobs.ts";

const PATH = "cloud.driverParameters";

type Parsed = Omit<StubCloudOptions, "clock">;

const RATES = ["errorRateCreate", "errorRateDestroy", "runnerCrashRate"] as const;
const DURATIONS = [
  "minTimeBetweenCreateCalls",
  "minTimeBetweenListCalls",
  "bootDelay",
  "runnerDetachDelay",
  "staleTagsFor",
  "destroyedVmsLinger",
] as const;
const SELECTORS = ["broken", "commandsFail", "neverBoot", "runnerMissing"] as const;
const KNOWN = [
  "seed",
  "quotaMaxInstances",
  "capacityErrors",
  "runnersIgnoreTerm",
  "bootProbeCommand",
  ...RATES,
  ...DURATIONS,
  ...SELECTORS,
];

function invalid(key: string, message: string): DispatchCloudError {
  return new DispatchCloudError("cloud.invalid_parameters", `${PATH}.${key} ${message}`, {
    path: `${PATH}.${key}`,
  });
}

function rate(key: string, v: unknown): number {
  if (typeof v !== "number" || !(v >= 0 && v <= 1)) throw invalid(key, "must be a number from 0 to 1");
  return v;
}

function count(key: string, v: unknown, min = 0): number {
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < min) {
    throw invalid(key, `must be a whole number >= ${min}`);
  }
  return v;
}

function selector(key: string, v: unknown): VmSelector {
  if (typeof v === "boolean") return v;
  if (typeof v === "object" && v !== null) {
    const keys = Object.keys(v);
    if (keys.length === 1 && "everyNth" in v) return { everyNth: count(`${key}.everyNth`, v.everyNth, 1) };
    if (keys.length === 1 && "rate" in v) return { rate: rate(`${key}.rate`, v.rate) };
  }
  throw invalid(key, "must be true, false, { everyNth: N } or { rate: 0..1 }");
}

function strings(key: string, v: unknown): Set<string> {
  if (!Array.isArray(v) || !v.every((s) => typeof s === "string"))
    throw invalid(key, "must be a list of strings");
  return new Set(v);
}

/**
 * Reads the stub driver's parameters from a config file: `seed`, the rates, `quotaMaxInstances`, durations
 * as strings ("10s"), `capacityErrors: { instanceTypes: [..], quotaGroups: [..], all }`, the VM selectors
 * (`broken`, `commandsFail`, `neverBoot`, `runnerMissing`), `runnersIgnoreTerm`, `bootProbeCommand`.
 */
export function parseStubParameters(params: unknown): Parsed {
  if (typeof params !== "object" || params === null || Array.isArray(params)) {
    throw new DispatchCloudError("cloud.invalid_parameters", `${PATH} must be a map`, { path: PATH });
  }
  const p = params as Record<string, unknown>;
  const out: Parsed = {};
  for (const [key, v] of Object.entries(p)) {
    if (!KNOWN.includes(key))
      throw invalid(key, `is not a stub driver parameter; known: ${KNOWN.join(", ")}`);
    if (key === "seed") out.seed = count(key, v);
    else if (key === "quotaMaxInstances") out.quotaMaxInstances = count(key, v);
    else if (key === "runnersIgnoreTerm") {
      if (typeof v !== "boolean") throw invalid(key, "must be true or false");
      out.runnersIgnoreTerm = v;
    } else if (key === "bootProbeCommand") {
      if (typeof v !== "string") throw invalid(key, "must be a string");
      out.bootProbeCommand = v;
    } else if (key === "capacityErrors") {
      if (typeof v !== "object" || v === null || Array.isArray(v)) throw invalid(key, "must be a map");
      const c = v as Record<string, unknown>;
      for (const k of Object.keys(c)) {
        if (!["instanceTypes", "quotaGroups", "all"].includes(k)) {
          throw invalid(`${key}.${k}`, "is not known; known: instanceTypes, quotaGroups, all");
        }
      }
      if (c.all !== undefined && typeof c.all !== "boolean")
        throw invalid(`${key}.all`, "must be true or false");
      out.capacityErrors = {
        instanceTypes:
          c.instanceTypes === undefined ? new Set() : strings(`${key}.instanceTypes`, c.instanceTypes),
        quotaGroups: c.quotaGroups === undefined ? new Set() : strings(`${key}.quotaGroups`, c.quotaGroups),
        all: c.all === true,
      };
    } else if ((RATES as readonly string[]).includes(key)) {
      out[key as (typeof RATES)[number]] = rate(key, v);
    } else if ((DURATIONS as readonly string[]).includes(key)) {
      try {
        out[key as (typeof DURATIONS)[number]] = parseDuration(v as string);
      } catch (err) {
        throw invalid(key, (err as Error).message);
      }
    } else {
      out[key as (typeof SELECTORS)[number]] = selector(key, v);
    }
  }
  return out;
}
