import { readFileSync } from "node:fs";
import { Kind, type TSchema } from "@sinclair/typebox";
import { describe, expect, it } from "vitest";
import { parse } from "yaml";
import { defaultsYamlText, schemaDefaults } from "./defaults.ts";
import { defaultConfig, parseConfig } from "./load.ts";
import { type Config, ConfigSchema } from "./schema.ts";

const DEFAULTS_FILE = new URL("./defaults.yml", import.meta.url);
const fileText = readFileSync(DEFAULTS_FILE, "utf8");

type AnnotatedSchema = TSchema & Record<string, unknown>;

/** Every key path the schema defines (records' entries as `*`). */
function schemaKeyPaths(schema: AnnotatedSchema, prefix = ""): string[] {
  if (schema[Kind] === "Object") {
    return Object.entries(schema["properties"] as Record<string, AnnotatedSchema>).flatMap(([k, s]) => [
      `${prefix}${k}`,
      ...schemaKeyPaths(s, `${prefix}${k}.`),
    ]);
  }
  if (schema[Kind] === "Record") {
    const entry = Object.values(schema["patternProperties"] as Record<string, AnnotatedSchema>)[0]!;
    return schemaKeyPaths(entry, `${prefix}*.`);
  }
  return [];
}

/** Every key path of a plain value (records' entries as `*` below `instanceTypes`). */
function valueKeyPaths(value: unknown, prefix = ""): string[] {
  if (typeof value !== "object" || value === null) return [];
  return Object.entries(value).flatMap(([k, v]) => {
    const key = prefix === "instanceTypes." ? "*" : k;
    const isFreeForm =
      `${prefix}${k}` === "cloud.driverParameters" || `${prefix}${k}` === "cloud.resourceTags";
    return [`${prefix}${key}`, ...(isFreeForm ? [] : valueKeyPaths(v, `${prefix}${key}.`))];
  });
}

describe("config/defaults.yml", () => {
  it("is exactly the text generated from the schema (regenerate: dispatch-cloud config defaults > config/defaults.yml)", () => {
    expect(fileText).toBe(defaultsYamlText());
  });

  it("holds the schema's default values, and the schema's defaults are all in it", () => {
    expect(parse(fileText)).toEqual(schemaDefaults());
  });

  it("has every key the schema defines, and no key the schema does not", () => {
    const inSchema = new Set(
      schemaKeyPaths(ConfigSchema as unknown as AnnotatedSchema).filter(
        // gpu has no default; nor has a registry's entry (the default is no registry at all).
        (p) => !p.startsWith("instanceTypes.*.gpu") && !p.startsWith("containers.registries.*"),
      ),
    );
    const inFile = new Set(valueKeyPaths(parse(fileText)).filter((p) => p !== "instanceTypes.*"));
    expect([...inFile].sort()).toEqual([...inSchema].sort());
    // gpu has no default; its keys appear commented out, each with its description.
    for (const key of ["gpu", "stack", "driverVersion", "hardwareTarget", "deviceCount", "vram"]) {
      expect(fileText).toMatch(new RegExp(`^ *#( +)${key}:`, "m"));
    }
  });

  it("annotates every key with a comment", () => {
    const lines = fileText.split("\n");
    lines.forEach((line, i) => {
      if (/^ *[A-Za-z.]+:/.test(line) && !/^ *local\.small:/.test(line)) {
        expect(lines[i - 1], `comment above line ${i + 1}: ${line}`).toMatch(/^ *#/);
      }
    });
  });

  it("parses to the same config as no file at all, without problems or warnings", () => {
    const result = parseConfig(fileText);
    expect(result.problems).toEqual([]);
    expect(result.warnings).toEqual([]);
    expect(result.config).toEqual(defaultConfig());
  });
});

describe("defaultConfig", () => {
  const config: Config = defaultConfig();

  it("decodes durations to milliseconds and sizes to bytes", () => {
    const idle: number = config.cloud.timeoutIdle;
    expect(idle).toBe(60_000);
    expect(config.dispatcher.pollInterval).toBe(10_000);
    expect(config.cloud.timeoutTerm).toBe(120_000);
    expect(config.dispatcher.reserveExtraRam).toBe(550 * 2 ** 20);
    expect(config.restServer.maxRequestBodySize).toBe(2 ** 20);
  });

  it("has the documented defaults", () => {
    expect(config.clusterId).toBe("local");
    expect(config.database.url).toBe("pglite:./data/pglite");
    expect(config.cloud.bootProbeCommand).toBe("true");
    expect(config.cloud.maxInstances).toBe(64);
    expect(config.management.token).toBe("");
    expect(config.instanceTypes).toEqual({
      "local.small": {
        providerType: "local.small",
        vcpus: 2,
        ram: 2 * 2 ** 30,
        includedScratch: 10 * 2 ** 30,
        addedScratch: 0,
        price: 0,
        preemptible: false,
        tags: [],
      },
    });
    expect(config.workers).toEqual({ longPoll: 2000, checkinTimeout: 60_000, deliveryTimeout: 60_000 });
  });

  it("derives instanceSetId from clusterId and providerType from the type's name", () => {
    const { config: c } = parseConfig(
      "clusterId: zzzzz\ninstanceTypes:\n  a1: {vcpus: 1, ram: 1GiB, price: 0.1}\n  b1: {providerType: m5.large, vcpus: 2, ram: 8GiB, price: 0.2}\n",
    );
    expect(c?.cloud.instanceSetId).toBe("zzzzz");
    expect(c?.instanceTypes["a1"]?.providerType).toBe("a1");
    expect(c?.instanceTypes["b1"]?.providerType).toBe("m5.large");
    // A configured list replaces the default one.
    expect(Object.keys(c?.instanceTypes ?? {})).toEqual(["a1", "b1"]);
    const { config: d } = parseConfig("cloud:\n  instanceSetId: blue\n");
    expect(d?.cloud.instanceSetId).toBe("blue");
  });

  it("is deep-frozen", () => {
    expect(Object.isFrozen(config)).toBe(true);
    expect(Object.isFrozen(config.cloud)).toBe(true);
    expect(Object.isFrozen(config.instanceTypes["local.small"])).toBe(true);
    expect(() => {
      (config.cloud as { maxInstances: number }).maxInstances = 1;
    }).toThrow(TypeError);
  });
});
