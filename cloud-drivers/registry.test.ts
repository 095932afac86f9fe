import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { Registry } from "prom-client";
import { describe, expect, it } from "vitest";
import { parseConfig } from "../config/load.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { createLogger } from "../lib/logger.ts";
import { FakeClock } from "../test/fake-clock.ts";
import {
  createDefaultRegistry,
  DriverRegistry,
  type InstanceSetConfig,
  instanceSetId,
  openInstanceSet,
  sharedTags,
  tagKey,
} from "./registry.ts";
import { type CloudDriver, type Instance, type InstanceSet, TAG, type Tags } from "./types.ts";
import { METRIC } from "./wrappers.ts";

/** The cloud edge: a driver whose set records what it was opened with and ignores list filters. */
function fakeDriver() {
  const opened: { params: unknown; id: string; tags: Tags }[] = [];
  const vms: Instance[] = [];
  const vm = (id: string, tags: Tags): Instance => ({
    id,
    address: "127.0.0.1",
    remoteUser: "root",
    providerType: "p",
    tags,
    setTags: async () => {},
    destroy: async () => {},
  });
  const driver: CloudDriver = {
    async instanceSet(params, id, tags) {
      opened.push({ params, id, tags });
      const set: InstanceSet = {
        async create(_type, _image, createTags) {
          const created = vm(`vm-${vms.length}`, createTags);
          vms.push(created);
          return created;
        },
        instances: async () => vms,
        quotaGroup: () => "p",
        stop: async () => {},
      };
      return set;
    },
  };
  return { driver, opened, vms, vm };
}

function config(cloud: Partial<InstanceSetConfig["cloud"]> = {}): InstanceSetConfig {
  return {
    clusterId: "zzzzz",
    cloud: {
      driver: "stub",
      driverParameters: { seed: 1 },
      tagKeyPrefix: "DispatchCloud",
      resourceTags: { Owner: "ops" },
      instanceSetId: "",
      maxCloudOpsPerSecond: 0,
      ...cloud,
    },
  };
}

describe("DriverRegistry", () => {
  it("returns registered drivers and rejects an unknown name, listing the known ones", () => {
    const { driver } = fakeDriver();
    const drivers = new DriverRegistry().register("stub", driver).register("local", driver);
    expect(drivers.get("stub")).toBe(driver);
    expect(drivers.names()).toEqual(["local", "stub"]);
    let err: unknown;
    try {
      drivers.get("ec3");
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(DispatchCloudError);
    expect((err as DispatchCloudError).code).toBe("cloud.unknown_driver");
    expect((err as DispatchCloudError).path).toBe("cloud.driver");
    expect((err as DispatchCloudError).message).toContain('"ec3"');
    expect((err as DispatchCloudError).message).toContain("local, stub");
    expect(() => new DriverRegistry().get("x")).toThrow("(none)");
  });

  it("createDefaultRegistry knows the built-in drivers", () => {
    const drivers = createDefaultRegistry();
    for (const name of drivers.names()) expect(typeof drivers.get(name).instanceSet).toBe("function");
    expect(drivers.names()).toEqual(DEFAULT_DRIVERS);
  });
});

describe("the ec2 driver's registration", () => {
  it("loads the AWS SDK only when an ec2 instance set opens", () => {
    // A fresh process: did anything load @aws-sdk/client-ec2 (a CommonJS package) before the ec2 set opened?
    const script = `
      import { createRequire } from "node:module";
      const require = createRequire(process.cwd() + "/");
      const loaded = () => Object.keys(require.cache).some((k) => k.includes("@aws-sdk/client-ec2"));
      const { createDefaultRegistry } = await import(process.cwd() + "/cloud-drivers/registry.ts");
      const { createLogger } = await import(process.cwd() + "/lib/logger.ts");
      const drivers = createDefaultRegistry();
      await drivers.get("local").instanceSet({ stateDir: process.argv[1] }, "x", {}, deps());
      const before = loaded();
      const set = await drivers.get("ec2").instanceSet({ region: "us-east-1" }, "x", {}, deps());
      console.log(JSON.stringify({ before, after: loaded() }));
      await set.stop();
      function deps() {
        return { logger: createLogger({ level: "silent", format: "json" }), clock: { now: () => 0, sleep: async () => {} }, registry: undefined };
      }
    `;
    const stateDir = mkdtempSync(path.join(tmpdir(), "registry-lazy-"));
    try {
      const out = spawnSync(
        process.execPath,
        ["--import", "tsx", "--no-warnings", "--input-type=module", "-e", script, stateDir],
        { cwd: repoRoot, encoding: "utf8", timeout: 60_000 },
      );
      expect(out.stderr).toBe("");
      expect(JSON.parse(out.stdout.trim())).toEqual({ before: false, after: true });
    } finally {
      rmSync(stateDir, { recursive: true, force: true });
    }
  });
});

const repoRoot = fileURLToPath(new URL("..", import.meta.url));

/** The drivers createDefaultRegistry registers. */
const DEFAULT_DRIVERS = ["azure", "ec2", "local", "stub"];

describe("tags from config", () => {
  it("tagKey prefixes the tag name", () => {
    expect(tagKey("DispatchCloud", TAG.instanceSetId)).toBe("DispatchCloudInstanceSetID");
    expect(tagKey("", TAG.instanceSecret)).toBe("InstanceSecret");
  });

  it("the instance set id is cloud.instanceSetId, or the cluster id", () => {
    expect(instanceSetId(config())).toBe("zzzzz");
    expect(instanceSetId(config({ instanceSetId: "blue" }))).toBe("blue");
    expect(sharedTags(config({ tagKeyPrefix: "X-", instanceSetId: "blue" }))).toEqual({
      Owner: "ops",
      "X-InstanceSetID": "blue",
    });
  });
});

describe("openInstanceSet", () => {
  it("opens the configured driver with its parameters and shared tags, and wraps the set", async () => {
    const { driver, opened, vms, vm } = fakeDriver();
    const registry = new Registry();
    const deps = {
      drivers: new DriverRegistry().register("stub", driver),
      registry,
      clock: new FakeClock(),
      logger: createLogger({ level: "silent", format: "json" }),
    };
    const set = await openInstanceSet(
      config({ resourceTags: { Owner: "ops", DispatchCloudInstanceSetID: "spoof" } }),
      deps,
    );
    expect(opened).toEqual([
      { params: { seed: 1 }, id: "zzzzz", tags: { Owner: "ops", DispatchCloudInstanceSetID: "zzzzz" } },
    ]);
    const created = await set.create(
      {
        name: "t",
        providerType: "p",
        vcpus: 1,
        ram: 1,
        includedScratch: 0,
        addedScratch: 0,
        scratch: 0,
        price: 0,
        preemptible: false,
        gpu: null,
      },
      "img",
      { Owner: "me" },
      "true",
      "key",
    );
    expect(created.tags).toEqual({ Owner: "me", DispatchCloudInstanceSetID: "zzzzz" });
    vms.push(vm("foreign", { DispatchCloudInstanceSetID: "yyyyy" }));
    expect((await set.instances({})).map((i) => i.id)).toEqual(["vm-0"]);
    expect(await registry.metrics()).toContain(
      `${METRIC.operations}{driver="stub",operation="list",error="0"} 1`,
    );
  });

  it("fails with cloud.unknown_driver for a driver the registry does not have", async () => {
    const deps = {
      drivers: new DriverRegistry(),
      registry: new Registry(),
      clock: new FakeClock(),
      logger: createLogger({ level: "silent", format: "json" }),
    };
    await expect(openInstanceSet(config(), deps)).rejects.toMatchObject({ code: "cloud.unknown_driver" });
  });

  it("takes a whole parsed Config: instance set id, prefix, resource tags and rate from cloud.*", async () => {
    const yaml = [
      "clusterId: abcde",
      "cloud:",
      "  driver: stub",
      "  driverParameters: { seed: 7 }",
      "  tagKeyPrefix: Dc-",
      "  instanceSetId: green",
      "  maxCloudOpsPerSecond: 3",
      "  resourceTags: { CostCenter: c42 }",
    ].join("\n");
    const { config, problems } = parseConfig(yaml);
    expect(problems).toEqual([]);
    const { driver, opened } = fakeDriver();
    const clock = new FakeClock();
    const deps = {
      drivers: new DriverRegistry().register("stub", driver),
      registry: new Registry(),
      clock,
      logger: createLogger({ level: "silent", format: "json" }),
    };
    const set = await openInstanceSet(config!, deps);
    expect(opened).toEqual([
      { params: { seed: 7 }, id: "green", tags: { CostCenter: "c42", "Dc-InstanceSetID": "green" } },
    ]);
    // 3 calls/s: the second list waits a third of a second of FakeClock time.
    const t0 = clock.now();
    await set.instances({});
    const second = set.instances({});
    await clock.advance(333);
    expect(clock.pending).toBe(1);
    await clock.advance(1);
    await second;
    expect(clock.now() - t0).toBe(334);
  });
});
