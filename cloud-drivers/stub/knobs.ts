/**
 * The stub cloud's fault knobs and options (driver.ts uses them; params.ts parses them from the config's
 * driverParameters).
 */
import type { Clock } from "../../lib/clock.ts";
import type { InstanceType, PricePoint } from "../types.ts";
import type { StubVm } from "./vm.ts";

/**
 * Which new VMs get a fault: `true` all, `false` none, `{ everyNth: 7 }` the 7th, 14th... VM the cloud
 * creates, `{ rate: 0.1 }` each with that probability (seeded), or a predicate. Decided once, at create time,
 * into the VM's flag (which a test may change later).
 */
export type VmSelector = boolean | { everyNth: number } | { rate: number } | ((vm: StubVm) => boolean);

export interface StubCapacityErrors {
  /** Instance type names (InstanceType.name) or provider types that have no capacity. */
  instanceTypes: Set<string>;
  /** Quota groups (as quotaGroup() names them) that have no capacity. */
  quotaGroups: Set<string>;
  /** No capacity for anything. */
  all: boolean;
}

/** Fault knobs. Durations in milliseconds. All may be changed at run time (`cloud.knobs.x = ...`). */
export interface StubKnobs {
  /** Probability that a create call fails with a CloudError. */
  errorRateCreate: number;
  /** Probability that a destroy call fails with a CloudError (the VM stays). */
  errorRateDestroy: number;
  /** Creates past this many live VMs fail with CloudQuotaError; 0 = unlimited. */
  quotaMaxInstances: number;
  /** A create (list) call sooner than this after the last accepted one fails with CloudRateLimitError. */
  minTimeBetweenCreateCalls: number;
  minTimeBetweenListCalls: number;
  capacityErrors: StubCapacityErrors;
  /** Time from create until the VM answers SSH and passes the boot probe. */
  bootDelay: number | ((vm: StubVm) => number);
  /** VMs whose `crunch-run --list` prints `broken`. */
  broken: VmSelector;
  /** VMs on which every command fails (exit 2). */
  commandsFail: VmSelector;
  /** VMs that answer SSH but never pass the boot probe. */
  neverBoot: VmSelector;
  /** VMs on which the runner cannot be installed and is never found. */
  runnerMissing: VmSelector;
  /** VMs on which the installed runner cannot run: each call prints this message on stderr and exits 1. */
  runnerFails: { message: string; on: VmSelector } | null;
  /** Probability that a runner started by --detach dies at once (it is not listed afterwards). */
  runnerCrashRate: number;
  /** Time `crunch-run --detach` takes (the runner is listed from the start of it). */
  runnerDetachDelay: number;
  /** `--kill` with any signal but KILL leaves runners running (and exits 1). */
  runnersIgnoreTerm: boolean;
  /** For this long after a setTags, instances() still shows the VM's tags from before it. */
  staleTagsFor: number;
  /** For this long after a destroy, the VM is still listed (it answers no commands). */
  destroyedVmsLinger: number;
  /** The command that is the boot probe (config cloud.bootProbeCommand). */
  bootProbeCommand: string;
  /**
   * Called when --detach starts a runner (before runnerDetachDelay; not for crashed ones), so a test harness
   * can drive the runner API. Not awaited; a throw or rejection is emitted as "hook:error".
   */
  onRunnerStart: ((vm: StubVm, uuid: string, doc: unknown) => void | Promise<void>) | null;
  /** Most entries kept in `calls` (the oldest half is dropped past it); counts are always kept. */
  callLogLimit: number;
  /** What an instance's priceHistory() says (a spot market); null: its type's price since its creation. */
  priceHistory: ((vm: StubVm, type: InstanceType) => PricePoint[]) | null;
}

export interface StubCloudOptions extends Partial<Omit<StubKnobs, "capacityErrors">> {
  clock: Clock;
  /** PRNG seed (default 1). */
  seed?: number;
  capacityErrors?: Partial<StubCapacityErrors>;
}
