import { describe, expect, it } from "vitest";
import type { InstanceType } from "../../cloud-drivers/types.ts";
import type { Config } from "../../config/schema.ts";
import type { Bundle, BundleResources, GpuRequest } from "../../store/types.ts";
import { instanceTypesFromConfig } from "../instance-types.ts";
import { compareVersions, demandOf, eligibleTypes, fits, shareOfInstance } from "./eligible.ts";

const MiB = 2 ** 20;
const GiB = 2 ** 30;
const TiB = 2 ** 40;

type TypeConfig = Config["instanceTypes"][string];
const t = (
  vcpus: number,
  ramGiB: number,
  scratchGiB: number,
  price: number,
  more: Partial<TypeConfig> = {},
): TypeConfig => ({
  providerType: "",
  vcpus,
  ram: ramGiB * GiB,
  includedScratch: scratchGiB * GiB,
  addedScratch: 0,
  tags: [],
  price,
  preemptible: false,
  ...more,
});
const gpu = (
  stack: "cuda" | "rocm",
  driverVersion: string,
  hardwareTarget: string,
  deviceCount: number,
  vramGiB: number,
) => ({ gpu: { stack, driverVersion, hardwareTarget, deviceCount, vram: vramGiB * GiB } });

/** The configured types; with preemptiblePriceFactor 0.4 each non-preemptible one gets a variant. */
const TYPES = instanceTypesFromConfig({
  instanceTypes: {
    "t3.small": t(2, 4, 50, 0.1),
    "spot.only": t(2, 2, 10, 0.05, { preemptible: true }),
    "c5.large": t(4, 8, 100, 0.2),
    "m5.large": t(4, 16, 100, 0.2),
    "m5.twin": t(4, 16, 100, 0.2),
    "m5.fast": t(8, 16, 100, 0.2),
    "m5.disk": t(8, 16, 200, 0.2),
    "m5.4xlarge": t(16, 64, 400, 0.8),
    "gpu.t4": t(8, 32, 200, 0.9, gpu("cuda", "11.9", "7.5", 1, 16)),
    "gpu.large": t(8, 32, 200, 1.2, gpu("cuda", "12.2", "8.6", 1, 24)),
    "gpu.v100x4": t(32, 128, 400, 2.5, gpu("cuda", "11.10", "7.0", 4, 16)),
    "rocm.mi210": t(16, 64, 400, 2.0, gpu("rocm", "6.0", "gfx90a", 1, 64)),
    "rocm.mi300": t(48, 256, 800, 4.0, gpu("rocm", "6.2", "gfx942", 2, 192)),
  },
  dispatcher: { preemptiblePriceFactor: 0.4 },
});
const ON_DEMAND = TYPES.filter((x) => !x.preemptible);
const CUDA_ONLY = TYPES.filter((x) => x.gpu?.stack === "cuda");

function bundle(resources: Partial<BundleResources>, preemptible = false): Bundle {
  const now = new Date(0);
  return {
    uuid: "zzzzz-bndl-000000000000000",
    ownerUuid: "zzzzz-user-000000000000000",
    name: "b",
    command: ["true"],
    image: "busybox",
    env: {},
    resources: { vcpus: 1, ram: GiB, scratch: 10 * GiB, gpu: null, ...resources },
    preemptible,
    priority: 1,
    limits: { time: null, disk: null, network: true },
    dependencies: [],
    allowFailedDependencies: false,
    maxAttempts: 3,
    attempt: 0,
    state: "staged",
    stateReason: null,
    schedulingStatus: null,
    instanceId: null,
    instanceType: null,
    gpuDevices: [],
    exitCode: null,
    resourceUsage: null,
    costDollars: null,
    changeSeq: 1,
    createdAt: now,
    updatedAt: now,
    stagedAt: now,
    startingAt: null,
    runningAt: null,
    finishedAt: null,
  };
}

const cuda = (over: Partial<GpuRequest> = {}): GpuRequest => ({
  stack: "cuda",
  deviceCount: 1,
  vram: 0,
  driverVersion: null,
  hardwareTarget: [],
  ...over,
});
const rocm = (over: Partial<GpuRequest> = {}): GpuRequest => cuda({ stack: "rocm", ...over });

interface Row {
  name: string;
  resources?: Partial<BundleResources>;
  preemptible?: boolean;
  always?: boolean;
  reserveExtraRam?: number;
  maximumPriceFactor?: number;
  types?: readonly InstanceType[];
  /** Expected eligible type names, in order. */
  want?: string[];
  /** Or: expected failure. */
  reason?: string;
  closest?: string | null;
}

const AT_020 = ["m5.disk", "m5.fast", "m5.large", "m5.twin", "c5.large"];

const ROWS: Row[] = [
  { name: "small bundle: cheapest type only (factor 1.5)", want: ["t3.small"] },
  {
    name: "price factor 2 admits the next price; ties by RAM, vCPUs, scratch desc, then name",
    maximumPriceFactor: 2,
    want: ["t3.small", ...AT_020],
  },
  { name: "a price factor below 1 counts as 1", maximumPriceFactor: 0.5, want: ["t3.small"] },
  {
    name: "RAM x 100/95 does not fit 4GiB in a 4GiB type",
    resources: { ram: 4 * GiB },
    want: AT_020,
  },
  {
    name: "RAM at the 95 % boundary fits exactly",
    resources: { ram: Math.floor(4 * GiB * 0.95) },
    want: ["t3.small"],
  },
  {
    name: "reserveExtraRam is added before the 95 % rule",
    resources: { ram: 3 * GiB },
    reserveExtraRam: GiB,
    maximumPriceFactor: 1,
    want: AT_020,
  },
  { name: "vCPUs", resources: { vcpus: 6 }, maximumPriceFactor: 1, want: ["m5.disk", "m5.fast"] },
  { name: "scratch", resources: { scratch: 150 * GiB }, maximumPriceFactor: 1, want: ["m5.disk"] },
  {
    name: "a bundle without GPUs may use GPU types (Arvados does)",
    resources: { vcpus: 16 },
    maximumPriceFactor: 3,
    want: ["m5.4xlarge", "rocm.mi210"],
  },
  {
    name: "a preemptible bundle gets only preemptible types (variants and configured)",
    preemptible: true,
    resources: { scratch: 5 * GiB },
    want: ["t3.small.preemptible", "spot.only"],
  },
  {
    name: "alwaysUsePreemptibleInstances makes every bundle preemptible",
    always: true,
    resources: { scratch: 5 * GiB },
    want: ["t3.small.preemptible", "spot.only"],
  },
  {
    name: "preemptible GPU bundle",
    preemptible: true,
    resources: { gpu: cuda() },
    want: ["gpu.t4.preemptible", "gpu.large.preemptible"],
  },
  { name: "CUDA, any", resources: { gpu: cuda() }, want: ["gpu.t4", "gpu.large"] },
  { name: "CUDA VRAM per device", resources: { gpu: cuda({ vram: 20 * GiB }) }, want: ["gpu.large"] },
  { name: "CUDA device count", resources: { gpu: cuda({ deviceCount: 2 }) }, want: ["gpu.v100x4"] },
  {
    name: "driver 11.10 excludes 11.9 (version, not float, compare)",
    resources: { gpu: cuda({ driverVersion: "11.10" }) },
    maximumPriceFactor: 3,
    want: ["gpu.large", "gpu.v100x4"],
  },
  {
    name: "driver 11.9 admits 11.9, 11.10 and 12.2",
    resources: { gpu: cuda({ driverVersion: "11.9" }) },
    maximumPriceFactor: 3,
    want: ["gpu.t4", "gpu.large", "gpu.v100x4"],
  },
  {
    name: "one CUDA target is a minimum (8.0 -> 8.6 only)",
    resources: { gpu: cuda({ hardwareTarget: ["8.0"] }) },
    maximumPriceFactor: 3,
    want: ["gpu.large"],
  },
  {
    name: "one CUDA target is a minimum (7.5 -> 7.5 and 8.6)",
    resources: { gpu: cuda({ hardwareTarget: ["7.5"] }) },
    want: ["gpu.t4", "gpu.large"],
  },
  {
    name: "several CUDA targets: must be in the list",
    resources: { gpu: cuda({ hardwareTarget: ["7.0", "8.6"] }) },
    maximumPriceFactor: 3,
    want: ["gpu.large", "gpu.v100x4"],
  },
  { name: "ROCm, any (stack must match)", resources: { gpu: rocm() }, want: ["rocm.mi210"] },
  {
    name: "one ROCm target is in-list, not a minimum",
    resources: { gpu: rocm({ hardwareTarget: ["gfx90a"] }) },
    maximumPriceFactor: 3,
    want: ["rocm.mi210"],
  },
  {
    name: "ROCm target gfx942",
    resources: { gpu: rocm({ hardwareTarget: ["gfx942"] }) },
    want: ["rocm.mi300"],
  },
  {
    name: "unfit: VRAM per device",
    resources: { gpu: cuda({ vram: 64 * GiB }) },
    reason:
      "no instance type fits: no instance type has 1 cuda GPU with 64GiB each (largest: gpu.v100x4, 4 x 16GiB)",
    closest: "gpu.t4",
  },
  {
    name: "unfit: device count and VRAM",
    resources: { gpu: cuda({ deviceCount: 2, vram: 40 * GiB }) },
    reason:
      "no instance type fits: no instance type has 2 cuda GPUs with 40GiB each (largest: gpu.v100x4, 4 x 16GiB)",
    closest: "gpu.v100x4",
  },
  {
    name: "unfit: RAM, with the reserve and the 95 % rule",
    resources: { ram: 300 * GiB },
    reserveExtraRam: 550 * MiB,
    reason:
      "no instance type fits: needs 316.4GiB of RAM (with 550MiB reserved, /0.95); the largest type, rocm.mi300, has 256GiB",
    closest: "t3.small",
  },
  {
    name: "unfit: two needs no type meets",
    resources: { vcpus: 64, scratch: TiB },
    reason:
      "no instance type fits: needs 64 vCPUs; the largest type, rocm.mi300, has 48; " +
      "needs 1TiB of scratch; the largest type, rocm.mi300, has 800GiB",
    closest: "t3.small",
  },
  {
    name: "unfit: each need met by some type, not together",
    resources: { vcpus: 40, gpu: cuda() },
    reason: "no instance type fits: needs 40 vCPUs; the closest type, gpu.t4, has 8",
    closest: "gpu.t4",
  },
  {
    name: "unfit: driver version",
    resources: { gpu: cuda({ driverVersion: "13.0" }) },
    reason:
      "no instance type fits: needs a cuda driver version >= 13.0; the newest type, gpu.large, has 12.2",
    closest: "gpu.t4",
  },
  {
    name: "unfit: single CUDA target",
    resources: { gpu: cuda({ hardwareTarget: ["9.0"] }) },
    reason: "no instance type fits: needs a CUDA hardware target >= 9.0; the newest type, gpu.large, has 8.6",
    closest: "gpu.t4",
  },
  {
    name: "unfit: ROCm target list",
    resources: { gpu: rocm({ hardwareTarget: ["gfx1100", "gfx1030"] }) },
    reason:
      "no instance type fits: needs a rocm hardware target in [gfx1100, gfx1030]; the newest type, rocm.mi300, has gfx942",
    closest: "rocm.mi210",
  },
  {
    name: "unfit: GPU stack nobody has",
    types: CUDA_ONLY,
    resources: { gpu: rocm() },
    reason: "no instance type fits: no instance type has 1 rocm GPU (no type has rocm GPUs)",
    closest: "gpu.t4",
  },
  {
    name: "unfit: preemptible with no preemptible type",
    types: ON_DEMAND,
    preemptible: true,
    reason: "no instance type fits: needs a preemptible instance type; none is configured",
    closest: "t3.small",
  },
  {
    name: "unfit: no types at all",
    types: [],
    reason: "no instance types are configured",
    closest: null,
  },
];

describe("eligibleTypes: type selection table", () => {
  it.each(ROWS)("$name", (row) => {
    const reserveExtraRam = row.reserveExtraRam ?? 0;
    const demand = demandOf(bundle(row.resources ?? {}, row.preemptible ?? false), {
      reserveExtraRam,
      alwaysUsePreemptibleInstances: row.always ?? false,
    });
    const types = row.types ?? TYPES;
    const result = eligibleTypes(demand, types, {
      maximumPriceFactor: row.maximumPriceFactor ?? 1.5,
      reserveExtraRam,
    });
    if (row.want !== undefined) {
      expect(result).toEqual({ ok: true, types: row.want.map((n) => types.find((x) => x.name === n)) });
      // fits() agrees with the table for every type not cut by price.
      for (const name of row.want) expect(fits(demand, types.find((x) => x.name === name)!)).toBe(true);
    } else {
      expect(result).toEqual({ ok: false, reason: row.reason, closest: row.closest });
      for (const type of types) expect(fits(demand, type)).toBe(false);
    }
  });

  it("has at least 25 rows", () => {
    expect(ROWS.length).toBeGreaterThanOrEqual(25);
  });
});

describe("demandOf", () => {
  it("adds reserveExtraRam, applies the 95 % rule, rounds up, and keeps the GPU request", () => {
    const g = cuda({ deviceCount: 2 });
    const d = demandOf(bundle({ vcpus: 3, ram: 1000, scratch: 7, gpu: g }), { reserveExtraRam: 900 });
    expect(d).toEqual({ vcpus: 3, ram: 2000, scratch: 7, gpu: g, preemptible: false });
    expect(demandOf(bundle({ ram: 1 }), { reserveExtraRam: 0 }).ram).toBe(2);
  });

  it("is preemptible when the bundle asks or alwaysUsePreemptibleInstances is set", () => {
    expect(demandOf(bundle({}, true), { reserveExtraRam: 0 }).preemptible).toBe(true);
    expect(
      demandOf(bundle({}), { reserveExtraRam: 0, alwaysUsePreemptibleInstances: true }).preemptible,
    ).toBe(true);
    expect(
      demandOf(bundle({}), { reserveExtraRam: 0, alwaysUsePreemptibleInstances: false }).preemptible,
    ).toBe(false);
  });

  it("explains RAM without a reserve value in generic words", () => {
    const d = demandOf(bundle({ ram: 300 * GiB }), { reserveExtraRam: 0 });
    const r = eligibleTypes(d, ON_DEMAND, { maximumPriceFactor: 1.5 });
    expect(r).toMatchObject({ ok: false, reason: expect.stringContaining("(with reserveExtraRam, /0.95)") });
  });
});

describe("compareVersions", () => {
  it.each([
    ["11.10", "11.9", 1],
    ["11.9", "11.10", -1],
    ["12", "12.0", 0],
    ["12.0.0", "12", 0],
    ["12.1", "12", 1],
    ["8.6", "8.6", 0],
    ["10.0", "9.9", 1],
    ["535.104.05", "535.86.10", 1],
    ["gfx90a", "gfx942", -1],
    ["7.5", "8.0", -1],
  ] as const)("compareVersions(%s, %s) has sign %i", (a, b, sign) => {
    expect(Math.sign(compareVersions(a, b))).toBe(sign);
    expect(Math.sign(compareVersions(b, a))).toBe(0 - sign || 0);
  });
});

describe("shareOfInstance: what a bundle is charged of its instance", () => {
  const type = (name: string) => TYPES.find((x) => x.name === name)!;
  const share = (resources: Partial<BundleResources>, name: string, perInstance = 0, reserveExtraRam = 0) =>
    shareOfInstance(demandOf(bundle(resources), { reserveExtraRam }), type(name), perInstance);

  it.each([
    // [resources, type, slots, expected share]: the largest of vCPUs, RAM (/0.95), scratch, GPUs and one slot.
    [{ vcpus: 1, ram: GiB, scratch: 10 * GiB }, "c5.large", 0, 1 / 4],
    [{ vcpus: 1, ram: 6 * GiB, scratch: 10 * GiB }, "c5.large", 0, 6 / 0.95 / 8],
    [{ vcpus: 1, ram: GiB, scratch: 80 * GiB }, "c5.large", 0, 80 / 100],
    [{ vcpus: 4, ram: GiB, scratch: GiB }, "c5.large", 0, 1],
    [{ vcpus: 1, ram: GiB, scratch: GiB }, "m5.4xlarge", 0, 1 / 16],
    [{ vcpus: 1, ram: GiB, scratch: GiB }, "m5.4xlarge", 4, 1 / 4],
    [{ vcpus: 1, ram: GiB, scratch: GiB }, "m5.4xlarge", 1, 1],
    [{ vcpus: 2, ram: GiB, scratch: GiB, gpu: cuda({ deviceCount: 1 }) }, "gpu.v100x4", 0, 1 / 4],
    [{ vcpus: 2, ram: GiB, scratch: GiB, gpu: cuda({ deviceCount: 3 }) }, "gpu.v100x4", 0, 3 / 4],
    [{ vcpus: 1, ram: GiB, scratch: GiB, gpu: cuda({ deviceCount: 1 }) }, "gpu.t4", 0, 1],
    [{ vcpus: 0.5, ram: GiB / 2, scratch: GiB }, "t3.small", 0, 1 / 4],
  ] as const)("%o on %s with %i slots: %d", (resources, name, slots, expected) => {
    expect(share(resources, name, slots)).toBeCloseTo(expected, 9);
  });

  it("counts reserveExtraRam as the scheduler does, and never charges more than the whole instance", () => {
    expect(share({ vcpus: 1, ram: GiB, scratch: GiB }, "c5.large", 0, 3 * GiB)).toBeCloseTo(4 / 0.95 / 8, 9);
    expect(share({ vcpus: 64, ram: GiB, scratch: GiB }, "c5.large")).toBe(1);
    expect(share({ vcpus: 1, ram: GiB, scratch: GiB, gpu: cuda() }, "c5.large")).toBe(1);
  });
});
