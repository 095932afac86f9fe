/**
 * What the benchmarks that build the REAL worker pool over many stub VMs share (bench:scheduler, bench:probe):
 * the config with its mix of instance types, a Db that answers nothing, the stub cloud opened through the
 * driver registry (so the pool sees the same wrapped instance set as in production), VMs created as the pool's
 * own (tags, secret in the init script), and bundles.
 */
import type { Logger } from "pino";
import { Registry } from "prom-client";
import { createDefaultRegistry, openInstanceSet } from "../cloud-drivers/registry.ts";
import { StubCloud } from "../cloud-drivers/stub/driver.ts";
import type { StubVm } from "../cloud-drivers/stub/vm.ts";
import type { InstanceSet, InstanceType } from "../cloud-drivers/types.ts";
import { parseConfig } from "../config/load.ts";
import type { Config } from "../config/schema.ts";
import { instanceTypesFromConfig } from "../dispatcher/instance-types.ts";
import { initScript, instanceTags, newInstanceSecret } from "../dispatcher/pool/bootstrap.ts";
import type { Clock } from "../lib/clock.ts";
import type { Db } from "../store/db.ts";
import type { Bundle, BundleResources, BundleState } from "../store/types.ts";

/** The bench config: nine instance types (GPU types included), no cloud-side rate limits; `cloud` adds keys. */
export function benchConfig(instances: number, cloud: Record<string, string | number> = {}): Config {
  const extra = Object.entries(cloud)
    .map(([k, v]) => `  ${k}: ${v}\n`)
    .join("");
  const { config, problems } = parseConfig(`clusterId: bench
dataDir: /nonexistent
dispatcher: {reserveExtraRam: 256MiB, maximumPriceFactor: 1.5}
cloud:
  driver: stub
  maxInstances: ${instances}
  maxCloudOpsPerSecond: 0
  maxConcurrentInstanceCreateOps: 4
  deployPublicKey: false
${extra}instanceTypes:
  c2: {vcpus: 2, ram: 4GiB, includedScratch: 50GiB, price: 0.08}
  c4: {vcpus: 4, ram: 8GiB, includedScratch: 100GiB, price: 0.16}
  c8: {vcpus: 8, ram: 16GiB, includedScratch: 200GiB, price: 0.32}
  m8: {vcpus: 8, ram: 64GiB, includedScratch: 200GiB, price: 0.5}
  m16: {vcpus: 16, ram: 128GiB, includedScratch: 400GiB, price: 1.0}
  m32: {vcpus: 32, ram: 256GiB, includedScratch: 800GiB, price: 2.0}
  g1: {vcpus: 8, ram: 32GiB, includedScratch: 200GiB, price: 1.2, gpu: {stack: cuda, driverVersion: "12.4", hardwareTarget: "8.0", deviceCount: 1, vram: 24GiB}}
  g4: {vcpus: 32, ram: 128GiB, includedScratch: 800GiB, price: 4.5, gpu: {stack: cuda, driverVersion: "12.4", hardwareTarget: "8.0", deviceCount: 4, vram: 24GiB}}
  r2: {vcpus: 16, ram: 64GiB, includedScratch: 400GiB, price: 3.0, gpu: {stack: rocm, driverVersion: "6.1", hardwareTarget: "gfx90a", deviceCount: 2, vram: 64GiB}}
`);
  if (config === undefined) throw new Error(problems.map((p) => `${p.path}: ${p.message}`).join("; "));
  return config;
}

/** Answers every statement with no rows: no database work anywhere near what is timed. */
export const nullDb: Db = {
  kind: "pglite",
  query: async () => ({ rows: [], rowCount: 0 }),
  transaction: async (fn) => fn(nullDb),
  listen: async () => async () => {},
  tryAdvisoryLock: async () => null,
  close: async () => {},
};

export interface StubFleet {
  cloud: StubCloud;
  /** The config with the stub cloud in its driverParameters (what the pool gets). */
  config: Config;
  types: InstanceType[];
  /** The stub driver's instance set, opened through the registry with its wrappers. */
  instanceSet: InstanceSet;
  /** Creates a VM of `type` as the pool would: its tags, the secret in its init script, `publicKey`. */
  createVm(type: InstanceType, opts?: { publicKey?: string }): Promise<StubVm>;
}

export async function openStubFleet(
  config: Config,
  opts: { clock: Clock; logger: Logger },
): Promise<StubFleet> {
  const cloud = new StubCloud({ clock: opts.clock, seed: 1, callLogLimit: 1000 });
  const cfg = { ...config, cloud: { ...config.cloud, driverParameters: { cloud } } } as Config;
  const instanceSet = await openInstanceSet(cfg, {
    drivers: createDefaultRegistry(),
    logger: opts.logger,
    clock: opts.clock,
    registry: new Registry(),
  });
  return {
    cloud,
    config: cfg,
    types: instanceTypesFromConfig(config),
    instanceSet,
    async createVm(type, { publicKey = "" } = {}) {
      const secret = newInstanceSecret();
      const inst = await instanceSet.create(
        type,
        "img",
        instanceTags(config, type.name, "run", secret),
        initScript(secret, ""),
        publicKey,
      );
      const vm = cloud.vm(inst.id);
      if (vm === undefined) throw new Error("stub VM missing");
      return vm;
    },
  };
}

const epoch = Date.UTC(2026, 0, 1);
let serial = 0;

/** A bundle row as the queue holds it (uuids numbered from 0 per process). */
export function benchBundle(
  state: BundleState,
  resources: BundleResources,
  priority: number,
  extra: Partial<Bundle> = {},
): Bundle {
  const n = serial++;
  const created = new Date(epoch - 3_600_000 + n);
  return {
    uuid: `bench-bndl-${n.toString(36).padStart(15, "0")}`,
    ownerUuid: "bench-user-000000000000000",
    name: `bench ${n}`,
    command: ["true"],
    image: "busybox",
    env: {},
    resources,
    preemptible: false,
    priority,
    limits: { time: null, disk: null, network: true },
    dependencies: [],
    allowFailedDependencies: false,
    maxAttempts: 3,
    attempt: state === "staged" ? 0 : 1,
    state,
    stateReason: null,
    schedulingStatus: null,
    instanceId: null,
    instanceType: null,
    gpuDevices: [],
    exitCode: null,
    resourceUsage: null,
    costDollars: null,
    changeSeq: n + 1,
    createdAt: created,
    updatedAt: created,
    stagedAt: created,
    startingAt: null,
    runningAt: null,
    finishedAt: null,
    ...extra,
  };
}

export const benchEpoch = epoch;

/** The peak RSS of this process so far, in MiB. */
export function peakRssMiB(): number {
  return process.resourceUsage().maxRSS / 1024;
}
