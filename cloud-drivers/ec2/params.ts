import { parameterTools } from "../params.ts";

export interface Ec2Credentials {
  accessKeyId: string;
  secretAccessKey: string;
}

export interface Ec2Parameters {
  region: string;
  /** The EC2 API URL (tests, EC2-compatible clouds); undefined = the region's AWS endpoint. */
  endpoint: string | undefined;
  /**
   * Static keys, or undefined for the SDK's default credential chain (environment, shared files, SSO,
   * web identity, container and instance roles). Not enumerable: logging the parameters never shows it.
   */
  readonly credentials: Ec2Credentials | undefined;
  /** Empty: the VPC's default security group. */
  securityGroupIds: string[];
  /** Tried round-robin; empty: EC2 picks the default subnet of the default VPC. */
  subnetIds: string[];
  adminUsername: string;
  iamInstanceProfile: { Name: string } | { Arn: string } | undefined;
  ebsVolumeType: EbsVolumeType;
  /** Dollars per GiB-month of the added-scratch EBS volume (spot price history only). */
  ebsPrice: number;
  spotPriceUpdateIntervalMs: number;
  /** providerType prefix (lowercase) -> quota group name. */
  instanceTypeQuotaGroups: Record<string, string>;
  requestTimeoutMs: number;
}

/** Volume types that need nothing but a size (io1/io2 need provisioned IOPS, which the driver does not set). */
export const EBS_VOLUME_TYPES = ["gp3", "gp2", "st1", "sc1", "standard"] as const;
export type EbsVolumeType = (typeof EBS_VOLUME_TYPES)[number];

/** Defaults, as written in a config file; region has none (it is required). */
export const EC2_DEFAULTS = {
  adminUsername: "admin",
  ebsVolumeType: "gp3",
  ebsPrice: 0.08,
  spotPriceUpdateInterval: "24h",
  requestTimeout: "30s",
} as const;

const KEYS = [
  "region",
  "endpoint",
  "accessKeyId",
  "secretAccessKey",
  "securityGroupIds",
  "subnetId",
  "adminUsername",
  "iamInstanceProfile",
  "ebsVolumeType",
  "ebsPrice",
  "spotPriceUpdateInterval",
  "instanceTypeQuotaGroups",
  "requestTimeout",
] as const;

const { invalid, show, knownMap, secretValue, duration } = parameterTools("ec2");

/**
 * Validates the ec2 driver's parameters. `env` is where `env:NAME` secrets are read (process.env by default).
 */
export function parseEc2Parameters(
  params: unknown,
  env: Readonly<Record<string, string | undefined>> = process.env,
): Ec2Parameters {
  const raw = knownMap(params, KEYS, { key: "region", hint: "is required (e.g. us-east-1)" });

  const region = raw["region"];
  if (region === undefined) throw invalid("region", "is required (e.g. us-east-1)");
  if (typeof region !== "string" || !/^[a-z0-9][a-z0-9-]*$/i.test(region)) {
    throw invalid("region", `must be a region name such as us-east-1; got ${show(region)}`);
  }

  let endpoint: string | undefined;
  if (raw["endpoint"] !== undefined) endpoint = parseEndpoint(raw["endpoint"]);

  const credentials = parseCredentials(raw, env);

  const securityGroupIds = idList("securityGroupIds", raw["securityGroupIds"] ?? [], false);
  const subnet = raw["subnetId"];
  const subnetIds =
    subnet === undefined
      ? []
      : typeof subnet === "string"
        ? [id("subnetId", subnet)]
        : idList("subnetId", subnet, true);

  const adminUsername = raw["adminUsername"] ?? EC2_DEFAULTS.adminUsername;
  if (typeof adminUsername !== "string" || !/^[a-z_][a-z0-9_.-]*$/i.test(adminUsername)) {
    throw invalid("adminUsername", `must be a user name such as "admin"; got ${show(adminUsername)}`);
  }

  let iamInstanceProfile: Ec2Parameters["iamInstanceProfile"];
  const profile = raw["iamInstanceProfile"];
  if (profile !== undefined) {
    if (typeof profile !== "string" || profile === "") {
      throw invalid("iamInstanceProfile", `must be an instance profile name or ARN; got ${show(profile)}`);
    }
    if (profile.startsWith("arn:")) {
      if (!/^arn:[^:]+:iam::[^:]*:instance-profile\/.+$/.test(profile)) {
        throw invalid(
          "iamInstanceProfile",
          `must be an instance profile ARN (arn:aws:iam::<account>:instance-profile/<name>); got ${show(profile)}`,
        );
      }
      iamInstanceProfile = { Arn: profile };
    } else {
      if (!/^[\w+=,.@-]{1,128}$/.test(profile)) {
        throw invalid(
          "iamInstanceProfile",
          `must be an instance profile name (letters, digits and +=,.@_-, at most 128) or ARN; got ${show(profile)}`,
        );
      }
      iamInstanceProfile = { Name: profile };
    }
  }

  const ebsVolumeType = raw["ebsVolumeType"] ?? EC2_DEFAULTS.ebsVolumeType;
  if (typeof ebsVolumeType !== "string" || !(EBS_VOLUME_TYPES as readonly string[]).includes(ebsVolumeType)) {
    throw invalid(
      "ebsVolumeType",
      `must be one of ${EBS_VOLUME_TYPES.join(", ")} (io1/io2 need provisioned IOPS, which the driver does not set); got ${show(ebsVolumeType)}`,
    );
  }

  const ebsPrice = raw["ebsPrice"] ?? EC2_DEFAULTS.ebsPrice;
  if (typeof ebsPrice !== "number" || !Number.isFinite(ebsPrice) || ebsPrice < 0) {
    throw invalid("ebsPrice", `must be a number >= 0 (dollars per GiB-month); got ${show(ebsPrice)}`);
  }

  const spotPriceUpdateIntervalMs = duration(
    "spotPriceUpdateInterval",
    raw,
    EC2_DEFAULTS.spotPriceUpdateInterval,
  );
  const requestTimeoutMs = duration("requestTimeout", raw, EC2_DEFAULTS.requestTimeout);

  const instanceTypeQuotaGroups: Record<string, string> = {};
  const groups = raw["instanceTypeQuotaGroups"] ?? {};
  if (typeof groups !== "object" || groups === null || Array.isArray(groups)) {
    throw invalid(
      "instanceTypeQuotaGroups",
      `must be a map of instance type prefix to quota group (e.g. { m: standard, p: gpu }); got ${show(groups)}`,
    );
  }
  for (const [prefix, group] of Object.entries(groups)) {
    const key = `instanceTypeQuotaGroups.${prefix}`;
    if (!/^[a-z0-9][a-z0-9.-]*$/i.test(prefix)) {
      throw invalid(key, "must be keyed by an instance type prefix such as m, p3 or c5.");
    }
    if (typeof group !== "string" || !/^[a-z0-9][a-z0-9_.-]*$/i.test(group)) {
      throw invalid(key, `must be a quota group name (letters, digits and _.-); got ${show(group)}`);
    }
    instanceTypeQuotaGroups[prefix.toLowerCase()] = group;
  }

  const result: Omit<Ec2Parameters, "credentials"> = {
    region,
    endpoint,
    securityGroupIds,
    subnetIds,
    adminUsername,
    iamInstanceProfile,
    ebsVolumeType: ebsVolumeType as EbsVolumeType,
    ebsPrice,
    spotPriceUpdateIntervalMs,
    instanceTypeQuotaGroups,
    requestTimeoutMs,
  };
  Object.defineProperty(result, "credentials", { value: credentials, enumerable: false });
  return result as Ec2Parameters;
}

function parseEndpoint(value: unknown): string {
  if (typeof value !== "string" || value === "") {
    throw invalid("endpoint", `must be an http:// or https:// URL; got ${show(value)}`);
  }
  let url: URL;
  try {
    url = new URL(value);
  } catch {
    throw invalid("endpoint", `must be an http:// or https:// URL; got ${show(value)}`);
  }
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    throw invalid("endpoint", `must be an http:// or https:// URL; got ${show(value)}`);
  }
  if (url.username !== "" || url.password !== "") {
    throw invalid("endpoint", "must not contain a user name or password (use accessKeyId/secretAccessKey)");
  }
  return value;
}

/** Both keys or neither; each a literal, `file:///path` or `env:NAME`. Messages never hold a value. */
function parseCredentials(
  raw: Record<string, unknown>,
  env: Readonly<Record<string, string | undefined>>,
): Ec2Credentials | undefined {
  const id = raw["accessKeyId"];
  const secret = raw["secretAccessKey"];
  if (id === undefined && secret === undefined) return undefined;
  if (id === undefined) {
    throw invalid(
      "accessKeyId",
      "is required with secretAccessKey (give both, or neither for the SDK's credential chain)",
    );
  }
  if (secret === undefined) {
    throw invalid(
      "secretAccessKey",
      "is required with accessKeyId (give both, or neither for the SDK's credential chain)",
    );
  }
  return {
    accessKeyId: secretValue("accessKeyId", id, env),
    secretAccessKey: secretValue("secretAccessKey", secret, env),
  };
}

function id(key: string, value: unknown): string {
  if (typeof value !== "string" || !/^[A-Za-z0-9][A-Za-z0-9-]*$/.test(value)) {
    throw invalid(key, `must be an id such as subnet-0123 or sg-0123; got ${show(value)}`);
  }
  return value;
}

function idList(key: string, value: unknown, nonEmpty: boolean): string[] {
  if (!Array.isArray(value)) throw invalid(key, `must be a list of ids; got ${show(value)}`);
  if (nonEmpty && value.length === 0) throw invalid(key, "must name at least one subnet (or be left out)");
  const ids = value.map((v, i) => id(`${key}.${i}`, v));
  const dup = ids.find((v, i) => ids.indexOf(v) !== i);
  if (dup !== undefined) throw invalid(key, `lists ${dup} twice`);
  return ids;
}
