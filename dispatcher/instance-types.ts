import type { InstanceType } from "../cloud-drivers/types.ts";
import type { Config } from "../config/schema.ts";

/** Name suffix of the preemptible variant added for each type when `dispatcher.preemptiblePriceFactor` > 0. */
export const PREEMPTIBLE_SUFFIX = ".preemptible";

/**
 * The configured instance types, resolved (scratch = included + added), plus a `<name>.preemptible` variant of
 * every non-preemptible type (price x preemptiblePriceFactor, same provider type) when that factor is > 0.
 * A configured type of the variant's name wins over the variant. Sorted by price, then name.
 */
export function instanceTypesFromConfig(
  config: Pick<Config, "instanceTypes"> & {
    dispatcher?: Pick<Config["dispatcher"], "preemptiblePriceFactor">;
  },
): InstanceType[] {
  const types = new Map<string, InstanceType>();
  for (const [name, t] of Object.entries(config.instanceTypes)) {
    types.set(name, {
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
      ...(t.tags.length > 0 ? { tags: [...t.tags] } : {}),
    });
  }
  const factor = config.dispatcher?.preemptiblePriceFactor ?? 0;
  if (factor > 0) {
    for (const t of [...types.values()]) {
      const name = `${t.name}${PREEMPTIBLE_SUFFIX}`;
      if (t.preemptible || types.has(name)) continue;
      types.set(name, {
        ...t,
        name,
        price: t.price * factor,
        preemptible: true,
        gpu: t.gpu === null ? null : { ...t.gpu },
      });
    }
  }
  return [...types.values()].sort((a, b) => a.price - b.price || a.name.localeCompare(b.name));
}
