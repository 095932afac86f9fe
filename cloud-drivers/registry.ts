import type { Config } from "../config/schema.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { localDriver } from "./local/driver.ts";
import { stubDriver } from "./stub/driver.ts";
import { type CloudDriver, type DriverDeps, type InstanceSet, TAG, type Tags } from "./types.ts";
import { wrapInstanceSet } from "./wrappers.ts";

/** Maps `cloud.driver` names to drivers. The composition root builds one; tests may register their own. */
export class DriverRegistry {
  private readonly drivers = new Map<string, CloudDriver>();

  register(name: string, driver: CloudDriver): this {
    this.drivers.set(name, driver);
    return this;
  }

  get(name: string): CloudDriver {
    const driver = this.drivers.get(name);
    if (driver === undefined) {
      const known = this.names();
      throw new DispatchCloudError(
        "cloud.unknown_driver",
        `no cloud driver named ${JSON.stringify(name)}; registered drivers: ${known.length > 0 ? known.join(", ") : "(none)"}`,
        { path: "cloud.driver" },
      );
    }
    return driver;
  }

  names(): string[] {
    return [...this.drivers.keys()].sort();
  }
}

/**
 * `ec2`, loaded on first use: the AWS SDK is imported only when an instance set of this driver opens, so
 * crunch-run and the other drivers never load it.
 */
const lazyEc2Driver: CloudDriver = {
  async instanceSet(params, instanceSetId, sharedTags, deps) {
    // The pinned SDK (the last line for Node 20) prints an unstructured NodeVersionSupportWarning on stderr;
    // say it once in the structured log instead.
    const quietWarning = "AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED";
    if (Number(process.versions.node.split(".")[0]) < 22 && process.env[quietWarning] === undefined) {
      process.env[quietWarning] = "true";
      deps.logger.info(
        { node: process.versions.node },
        "AWS SDK releases after January 2027 need Node 22; dispatch-cloud pins one that runs on this Node",
      );
    }
    const { ec2Driver } = await import("./ec2/driver.ts");
    return ec2Driver.instanceSet(params, instanceSetId, sharedTags, deps);
  },
};

/**
 * `azure`, loaded on first use: @azure/arm-compute, @azure/arm-network and @azure/identity are imported only
 * when an instance set of this driver opens.
 */
const lazyAzureDriver: CloudDriver = {
  async instanceSet(params, instanceSetId, sharedTags, deps) {
    const { azureDriver } = await import("./azure/driver.ts");
    return azureDriver.instanceSet(params, instanceSetId, sharedTags, deps);
  },
};

/** The drivers every dispatch-cloud process knows. */
export function createDefaultRegistry(): DriverRegistry {
  return new DriverRegistry()
    .register("azure", lazyAzureDriver)
    .register("ec2", lazyEc2Driver)
    .register("local", localDriver)
    .register("stub", stubDriver);
}

/** A tag's full key: the configured prefix and one of TAG's names, e.g. `DispatchCloudInstanceSetID`. */
export function tagKey(prefix: string, name: (typeof TAG)[keyof typeof TAG]): string {
  return prefix + name;
}

/** The parts of the config openInstanceSet reads (a whole Config fits). */
export interface InstanceSetConfig {
  readonly clusterId: string;
  readonly cloud: Pick<
    Config["cloud"],
    "driverParameters" | "tagKeyPrefix" | "resourceTags" | "instanceSetId" | "maxCloudOpsPerSecond"
  > & { readonly driver: string };
}

/** cloud.instanceSetId, or the cluster id when it is empty. */
export function instanceSetId(config: InstanceSetConfig): string {
  return config.cloud.instanceSetId !== "" ? config.cloud.instanceSetId : config.clusterId;
}

/** The tag that marks this dispatcher's instances: `{ <prefix>InstanceSetID: <instance set id> }`. */
export function instanceSetTags(config: InstanceSetConfig): Tags {
  return { [tagKey(config.cloud.tagKeyPrefix, TAG.instanceSetId)]: instanceSetId(config) };
}

/** The tags every instance gets: cloud.resourceTags plus the instance set ID tag. */
export function sharedTags(config: InstanceSetConfig): Tags {
  return { ...config.cloud.resourceTags, ...instanceSetTags(config) };
}

/**
 * Opens the configured driver's instance set and wraps it (metrics, rate limit, default tags, tag filter).
 * Throws cloud.unknown_driver for a name `drivers` does not know.
 */
export async function openInstanceSet(
  config: InstanceSetConfig,
  deps: DriverDeps & { drivers: DriverRegistry },
): Promise<InstanceSet> {
  const { drivers, ...driverDeps } = deps;
  const driver = drivers.get(config.cloud.driver);
  const id = instanceSetId(config);
  const tags = sharedTags(config);
  const set = await driver.instanceSet(config.cloud.driverParameters, id, tags, driverDeps);
  return wrapInstanceSet(set, {
    registry: deps.registry,
    clock: deps.clock,
    driver: config.cloud.driver,
    maxOpsPerSecond: config.cloud.maxCloudOpsPerSecond,
    defaultTags: { ...config.cloud.resourceTags },
    instanceSetTags: instanceSetTags(config),
  });
}
