import path from "node:path";
import { DispatchCloudError } from "../../lib/errors.ts";
import { parseDuration } from "../../lib/units.ts";

/** `cloud.driverParameters` of the local driver, validated, with defaults filled in. */
export interface LocalParameters {
  /** Absolute; one directory per VM under it. */
  stateDir: string;
  sshServer: "embedded" | "openssh";
  bootDelayMs: number;
  /** 0 = unlimited. */
  maxInstances: number;
  /** The login user of openssh VMs. */
  user: string;
  /** openssh VMs listen on `<addressPrefix>2`, `<addressPrefix>3`, ... port 22. */
  addressPrefix: string;
}

export const LOCAL_DEFAULTS = {
  stateDir: "./data/local-vms",
  sshServer: "embedded",
  bootDelay: "0s",
  maxInstances: 0,
  user: "dcvm",
  addressPrefix: "127.0.0.",
} as const;

const KEYS = Object.keys(LOCAL_DEFAULTS);

function invalid(key: string, message: string): DispatchCloudError {
  return new DispatchCloudError("cloud.invalid_parameters", `local driver: ${key} ${message}`, {
    path: `cloud.driverParameters${key === "" ? "" : `.${key}`}`,
  });
}

/** Validates the local driver's parameters; relative stateDir resolves against `cwd`. */
export function parseLocalParameters(params: unknown, cwd = process.cwd()): LocalParameters {
  const p = params ?? {};
  if (typeof p !== "object" || Array.isArray(p)) throw invalid("", "must be a map of parameters");
  const raw = p as Record<string, unknown>;
  for (const key of Object.keys(raw)) {
    if (!KEYS.includes(key))
      throw invalid(key, `is not a parameter of the local driver (known: ${KEYS.join(", ")})`);
  }
  const str = (key: keyof typeof LOCAL_DEFAULTS): string => {
    const value = raw[key] ?? LOCAL_DEFAULTS[key];
    if (typeof value !== "string" || value === "") throw invalid(key, "must be a non-empty string");
    return value;
  };

  const sshServer = str("sshServer");
  if (sshServer !== "embedded" && sshServer !== "openssh") {
    throw invalid("sshServer", `must be "embedded" or "openssh"; got ${JSON.stringify(sshServer)}`);
  }
  let bootDelayMs: number;
  try {
    bootDelayMs = parseDuration(
      raw["bootDelay"] === undefined ? LOCAL_DEFAULTS.bootDelay : (raw["bootDelay"] as string),
    );
  } catch (err) {
    throw invalid("bootDelay", (err as Error).message);
  }
  const maxInstances = raw["maxInstances"] ?? LOCAL_DEFAULTS.maxInstances;
  if (typeof maxInstances !== "number" || !Number.isInteger(maxInstances) || maxInstances < 0) {
    throw invalid(
      "maxInstances",
      `must be a whole number >= 0 (0 = unlimited); got ${JSON.stringify(maxInstances)}`,
    );
  }
  const user = str("user");
  if (!/^[a-z_][a-z0-9_-]*$/i.test(user))
    throw invalid("user", `must be a user name; got ${JSON.stringify(user)}`);
  const addressPrefix = str("addressPrefix");
  const m = /^127\.(\d{1,3})\.(\d{1,3})\.$/.exec(addressPrefix);
  if (m === null || Number(m[1]) > 255 || Number(m[2]) > 255) {
    throw invalid(
      "addressPrefix",
      `must be a loopback /24 prefix such as "127.0.0."; got ${JSON.stringify(addressPrefix)}`,
    );
  }
  return {
    stateDir: path.resolve(cwd, str("stateDir")),
    sshServer,
    bootDelayMs,
    maxInstances,
    user,
    addressPrefix,
  };
}
