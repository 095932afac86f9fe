import type { Registry } from "prom-client";
import type { Clock } from "../lib/clock.ts";
import type { Logger } from "../lib/logger.ts";

/** Cloud tags of one instance. Keys carry the configured prefix (default `DispatchCloud`). */
export type Tags = Record<string, string>;

/** The tag names the dispatcher writes, without the prefix (DESIGN.md §4). */
export const TAG = {
  instanceSetId: "InstanceSetID",
  instanceType: "InstanceType",
  idleBehavior: "IdleBehavior",
  instanceSecret: "InstanceSecret",
} as const;

export interface GpuSpec {
  stack: "cuda" | "rocm";
  driverVersion: string;
  hardwareTarget: string;
  deviceCount: number;
  /** Per device, bytes. */
  vram: number;
}

/** A configured instance type, resolved (sizes in bytes, price in dollars per hour). */
export interface InstanceType {
  name: string;
  providerType: string;
  vcpus: number;
  ram: number;
  includedScratch: number;
  addedScratch: number;
  /** includedScratch + addedScratch. */
  scratch: number;
  price: number;
  preemptible: boolean;
  gpu: GpuSpec | null;
  /** Its tags (config instanceTypes.*.tags): a bundle naming a tag runs only where it is. Absent: none. */
  tags?: readonly string[];
}

export interface PricePoint {
  /** Milliseconds since the epoch from which this price holds. */
  startTime: number;
  price: number;
}

export interface Instance {
  readonly id: string;
  /** Where to reach its SSH server: `host` or `host:port`. */
  readonly address: string;
  readonly remoteUser: string;
  readonly providerType: string;
  readonly tags: Tags;
  /** Replaces the whole tag map. */
  setTags(tags: Tags): Promise<void>;
  destroy(): Promise<void>;
  priceHistory?(type: InstanceType): PricePoint[];
}

export interface InstanceSet {
  create(
    type: InstanceType,
    imageId: string,
    tags: Tags,
    initCommand: string,
    publicKey: string,
  ): Promise<Instance>;
  /**
   * Instances whose tags include every pair of `filter` (wrappers enforce this client-side too). An instance
   * whose create() by this instance set has not returned yet is left out when the create may still fail and
   * delete it (the pool would otherwise run bundles on it).
   */
  instances(filter: Tags): Promise<Instance[]>;
  /** Instances of one quota group share a capacity limit (e.g. EC2's vCPU quota per family). */
  quotaGroup(type: InstanceType): string;
  stop(): Promise<void>;
}

export interface DriverDeps {
  logger: Logger;
  clock: Clock;
  registry: Registry;
}

export interface CloudDriver {
  /** `params` is config `cloud.driverParameters`, validated by the driver itself. */
  instanceSet(
    params: unknown,
    instanceSetId: string,
    sharedTags: Tags,
    deps: DriverDeps,
  ): Promise<InstanceSet>;
}
