import { describe, expect, it } from "vitest";
import type { Config } from "../config/schema.ts";
import { instanceTypesFromConfig } from "./instance-types.ts";

const GiB = 2 ** 30;
type TypeConfig = Config["instanceTypes"][string];
const type = (price: number, more: Partial<TypeConfig> = {}): TypeConfig => ({
  providerType: "m5.large",
  vcpus: 2,
  ram: 8 * GiB,
  includedScratch: 10 * GiB,
  addedScratch: 5 * GiB,
  tags: [],
  price,
  preemptible: false,
  ...more,
});
const GPU = {
  stack: "cuda",
  driverVersion: "12.4",
  hardwareTarget: "8.0",
  deviceCount: 1,
  vram: 16 * GiB,
} as const;

describe("instanceTypesFromConfig", () => {
  it("resolves scratch and sorts by price, then name", () => {
    const types = instanceTypesFromConfig({
      instanceTypes: { b: type(0.2), a: type(0.2), c: type(0.1, { gpu: GPU }) },
    });
    expect(types.map((t) => t.name)).toEqual(["c", "a", "b"]);
    expect(types[0]).toEqual({
      name: "c",
      providerType: "m5.large",
      vcpus: 2,
      ram: 8 * GiB,
      includedScratch: 10 * GiB,
      addedScratch: 5 * GiB,
      scratch: 15 * GiB,
      price: 0.1,
      preemptible: false,
      gpu: GPU,
    });
  });

  it("adds no variants when preemptiblePriceFactor is 0", () => {
    const types = instanceTypesFromConfig({
      instanceTypes: { a: type(0.2) },
      dispatcher: { preemptiblePriceFactor: 0 },
    });
    expect(types.map((t) => t.name)).toEqual(["a"]);
  });

  it("adds a .preemptible variant of every non-preemptible type at price x factor", () => {
    const types = instanceTypesFromConfig({
      instanceTypes: { a: type(0.2, { gpu: GPU }), spot: type(0.05, { preemptible: true }) },
      dispatcher: { preemptiblePriceFactor: 0.5 },
    });
    expect(types.map((t) => [t.name, t.price, t.preemptible])).toEqual([
      ["spot", 0.05, true],
      ["a.preemptible", 0.1, true],
      ["a", 0.2, false],
    ]);
    const variant = types.find((t) => t.name === "a.preemptible")!;
    const base = types.find((t) => t.name === "a")!;
    expect(variant).toEqual({ ...base, name: "a.preemptible", price: 0.1, preemptible: true });
    expect(variant.gpu).not.toBe(base.gpu);
  });

  it("keeps a configured type named like a variant", () => {
    const types = instanceTypesFromConfig({
      instanceTypes: { a: type(0.2), "a.preemptible": type(0.07, { preemptible: true, vcpus: 1 }) },
      dispatcher: { preemptiblePriceFactor: 0.5 },
    });
    expect(types.map((t) => [t.name, t.price, t.vcpus])).toEqual([
      ["a.preemptible", 0.07, 1],
      ["a", 0.2, 2],
    ]);
  });
});
