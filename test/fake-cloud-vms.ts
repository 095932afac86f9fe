/**
 * What the fake clouds (test/fake-ec2.ts, test/fake-arm.ts) share to back their VMs with local-driver VMs: each
 * one has its own sshd (openssh) on 127.0.x.y, runs the init script the cloud was given, and can be pointed at a
 * fake instance metadata service (test/fake-imds.ts).
 */
import { Registry } from "prom-client";
import { localDriver } from "../cloud-drivers/local/driver.ts";
import { shQuote } from "../cloud-drivers/local/ssh-openssh.ts";
import type { Instance, InstanceSet } from "../cloud-drivers/types.ts";
import { systemClock } from "../lib/clock.ts";
import { createLogger } from "../lib/logger.ts";
import { GiB, instanceType } from "./fixtures.ts";

/**
 * Where the backing VMs live and whom they admit; `addressPrefix` (default the local driver's "127.0.0.") keeps
 * test files' VMs apart.
 */
export interface BackingVmOptions {
  stateDir: string;
  user: string;
  addressPrefix?: string;
  bootDelay?: string;
}

/** The local-driver instance set behind a fake cloud's VMs (its instance set ID: `name`). */
export function openBackingVms(opts: BackingVmOptions, name: string): Promise<InstanceSet> {
  const { stateDir, user, bootDelay, addressPrefix } = opts;
  return localDriver.instanceSet(
    {
      stateDir,
      sshServer: "openssh",
      user,
      ...(bootDelay === undefined ? {} : { bootDelay }),
      ...(addressPrefix === undefined ? {} : { addressPrefix }),
    },
    name,
    {},
    {
      logger: createLogger({ level: "warn", format: "json" }),
      clock: systemClock,
      registry: new Registry(),
    },
  );
}

/**
 * Starts one backing VM for a cloud VM of `providerType`, running `init` (after a line that writes
 * `imdsEndpoint` into `$DISPATCH_VM_ROOT/etc/dispatch-cloud/imds-endpoint`, when given) and admitting `publicKey`.
 */
export function startBackingVm(
  set: InstanceSet,
  vm: {
    providerType: string;
    vcpus: number;
    preemptible: boolean;
    imageId: string;
    tags: Record<string, string>;
    init: string;
    publicKey: string;
    imdsEndpoint?: string;
  },
): Promise<Instance> {
  const lines: string[] = [];
  if (vm.imdsEndpoint !== undefined) {
    const dir = '"$DISPATCH_VM_ROOT/etc/dispatch-cloud"';
    lines.push(`mkdir -p ${dir} && echo ${shQuote(vm.imdsEndpoint)} > ${dir}/imds-endpoint`);
  }
  if (vm.init !== "") lines.push(vm.init.replace(/\n$/, ""));
  const type = instanceType(vm.providerType, {
    vcpus: vm.vcpus,
    ram: GiB,
    price: 0,
    preemptible: vm.preemptible,
  });
  const script = lines.length === 0 ? "" : `${lines.join("\n")}\n`;
  return set.create(type, vm.imageId, vm.tags, script, vm.publicKey);
}
