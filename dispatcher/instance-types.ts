import type { InstanceType } from "../cloud-drivers/types.ts";
import type { Config } from "../config/schema.ts";

/** The configured instance types, resolved (scratch = included + added), sorted by price then name. */
export function instanceTypesFromConfig(config: Pick<Config, "instanceTypes">): InstanceType[] {
  return Object.entries(config.instanceTypes)
    .map(
      ([name, t]): InstanceType => ({
        name,
        providerType: t.providerType,
        vcpus: t.vcpus,
        ram: t.ram,
        includedScratch: t.includedScratch,
        addedScratch: t.addedScratch,
        scratch: t.includedScratch + t.addedScratch,
        price: t.price,
        preemptible: t.preemptible,
        gpu: t.gpu === undefined ? null : { ...t.gpu },
      }),
    )
    .sort((a, b) => a.price - b.price || a.name.localeCompare(b.name));
}
