import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { ConfigError, type ConfigProblem, closest, loadConfig, parseConfig } from "./load.ts";

function problemsOf(yaml: string): ConfigProblem[] {
  const result = parseConfig(yaml);
  expect(result.config).toBeUndefined();
  expect(result.problems.length).toBeGreaterThan(0);
  return result.problems;
}

function onlyProblem(yaml: string): ConfigProblem {
  const problems = problemsOf(yaml);
  expect(problems).toHaveLength(1);
  return problems[0]!;
}

const GPU_TYPE = `instanceTypes:
  gpu1:
    vcpus: 8
    ram: 64GiB
    price: 3.06
    gpu:
      stack: cuda
      driverVersion: "12.4"
      hardwareTarget: "8.0"
      deviceCount: 1
      vram: 40GiB
`;

describe("parseConfig", () => {
  it("reports both a bad value and a misspelt sibling key (the acceptance case)", () => {
    const problems = problemsOf('cloud:\n  timeoutIdle: "abc"\n  maxInstnces: 3\n');
    expect(problems).toEqual([
      {
        code: "config.invalid_value",
        path: "cloud.timeoutIdle",
        message: expect.stringContaining("duration such as 10s, 1m30s"),
        line: 2,
      },
      {
        code: "config.unknown_key",
        path: "cloud.maxInstnces",
        message: expect.stringContaining("did you mean maxInstances?"),
        line: 3,
      },
    ]);
  });

  it("reports a wrong type with the expected one", () => {
    const p = onlyProblem("cloud:\n  maxInstances: many\n");
    expect(p).toMatchObject({ code: "config.invalid_value", path: "cloud.maxInstances", line: 2 });
    expect(p.message).toContain("an integer >= 0");
    expect(p.message).toContain('"many"');
    expect(onlyProblem("cloud: 5\n")).toMatchObject({
      path: "cloud",
      message: expect.stringContaining("a mapping"),
    });
    expect(onlyProblem("cloud:\n  deployPublicKey: maybe\n").message).toContain("true or false");
  });

  it("reports a bare number as a duration with a hint to add a unit", () => {
    const p = onlyProblem("dispatcher:\n  staleLockTimeout: 60\n");
    expect(p).toMatchObject({ code: "config.invalid_value", path: "dispatcher.staleLockTimeout" });
    expect(p.message).toContain('"60s"');
  });

  it("reports a zero poll interval", () => {
    expect(onlyProblem("dispatcher:\n  pollInterval: 0s\n")).toMatchObject({
      path: "dispatcher.pollInterval",
      message: "must be greater than 0",
    });
  });

  it("takes 0 (off) or at least 1s for the intervals whose every run costs the database a pass", () => {
    expect(onlyProblem("database:\n  embeddedMaintenanceInterval: 20ms\n")).toMatchObject({
      code: "config.invalid_value",
      path: "database.embeddedMaintenanceInterval",
      message: 'must be 0 (off) or at least 1s; got "20ms"',
    });
    expect(onlyProblem("cas:\n  gcInterval: 999ms\n")).toMatchObject({ path: "cas.gcInterval" });
    expect(onlyProblem("cas:\n  gcInterval: 1m5\n").message).toContain("a number without a unit");
    for (const ok of ['"0"', "0s", "1s", "90m"]) {
      const { config, problems } = parseConfig(
        `database:\n  embeddedMaintenanceInterval: ${ok}\ncas:\n  gcInterval: ${ok}\n`,
      );
      expect(problems).toEqual([]);
      expect(config?.cas.gcInterval).toBe(ok === "90m" ? 5_400_000 : ok === "1s" ? 1000 : 0);
    }
  });

  it("reports a bad size unit with the valid units", () => {
    const p = onlyProblem("dispatcher:\n  reserveExtraRam: 4XB\n");
    expect(p).toMatchObject({ code: "config.invalid_value", path: "dispatcher.reserveExtraRam", line: 2 });
    expect(p.message).toContain('unknown size unit "XB"');
    expect(p.message).toContain("KiB, MiB, GiB");
    expect(onlyProblem("restServer:\n  maxRequestBodySize: -1\n").message).toContain("negative");
  });

  it("reports out-of-range numbers with the range", () => {
    expect(onlyProblem("dispatcher:\n  defaultMaxAttempts: 11\n")).toMatchObject({
      path: "dispatcher.defaultMaxAttempts",
      message: "must be an integer >= 1 and <= 10; got 11",
    });
    expect(onlyProblem("cloud:\n  sshPort: 70000\n").message).toContain("<= 65535");
    expect(onlyProblem("dispatcher:\n  maximumPriceFactor: 0.5\n").message).toContain("a number >= 1");
    expect(onlyProblem("cloud:\n  maxInstances: 1.5\n").path).toBe("cloud.maxInstances");
    expect(onlyProblem("dispatcher:\n  maximumPriceFactor: .inf\n").path).toBe(
      "dispatcher.maximumPriceFactor",
    );
  });

  it("reports a bad enum value with the allowed values", () => {
    const p = onlyProblem("logging:\n  level: verbose\n");
    expect(p).toMatchObject({ code: "config.invalid_value", path: "logging.level", line: 2 });
    expect(p.message).toBe('must be one of: fatal, error, warn, info, debug, trace, silent; got "verbose"');
    expect(onlyProblem("cloud:\n  driver: gce\n").message).toContain("local, stub, ec2, azure");
  });

  it("reports malformed strings with the accepted format", () => {
    expect(onlyProblem("clusterId: ABCDEF\n").message).toContain("exactly 5 characters a-z, 0-9");
    expect(onlyProblem("database:\n  url: mysql://x\n").message).toContain("pglite:memory:");
    expect(onlyProblem("restServer:\n  listen: localhost\n").message).toContain("host:port");
    expect(onlyProblem("restServer:\n  listen: 127.0.0.1:99999\n").path).toBe("restServer.listen");
    expect(onlyProblem("restServer:\n  publicUrl: ftp://x\n").message).toContain("http://");
    const proxy = onlyProblem("restServer:\n  trustedProxies: [10.0.0.0/8, 10.1.2.3/33]\n");
    expect(proxy).toMatchObject({ code: "config.invalid_value", path: "restServer.trustedProxies.1" });
    expect(proxy.message).toContain("an IP address or CIDR");
    expect(onlyProblem("restServer:\n  trustedProxies: [loopback]\n").path).toBe(
      "restServer.trustedProxies.0",
    );
    expect(onlyProblem("restServer:\n  trustedProxies: [10.0.0.0/]\n").path).toBe(
      "restServer.trustedProxies.0",
    );
    const proxies = parseConfig(
      "restServer:\n  trustedProxies: [10.0.0.0/8, '::1', 'fd00::/8', 192.0.2.7]\n",
    );
    expect(proxies.problems).toEqual([]);
    expect(proxies.config?.restServer.trustedProxies).toEqual(["10.0.0.0/8", "::1", "fd00::/8", "192.0.2.7"]);
    expect(onlyProblem("cloud:\n  deployRunnerDirectory: tmp/x\n").message).toContain("absolute path");
    expect(onlyProblem("cloud:\n  resourceTags: {team: 42}\n")).toMatchObject({
      path: "cloud.resourceTags.team",
      message: expect.stringContaining("quote it"),
    });
  });

  it("suggests the nearest sibling key for unknown keys, at any depth", () => {
    expect(onlyProblem("clusterID: abcde\n").message).toContain("did you mean clusterId?");
    expect(onlyProblem("databse:\n  url: 'pglite:memory:'\n")).toMatchObject({
      code: "config.unknown_key",
      path: "databse",
      message: expect.stringContaining("did you mean database?"),
    });
    expect(onlyProblem("cloud:\n  timeout_idle: 1m\n").message).toContain("did you mean timeoutIdle?");
    const far = onlyProblem("logging:\n  colour: red\n");
    expect(far.message).toContain("valid keys: level, format");
    expect(onlyProblem(`${GPU_TYPE}      deviceCont: 2\n`)).toMatchObject({
      code: "config.unknown_key",
      path: "instanceTypes.gpu1.gpu.deviceCont",
      message: expect.stringContaining("did you mean deviceCount?"),
    });
  });

  it("accepts a GPU instance type and reports each bad field of one", () => {
    const { config, problems } = parseConfig(GPU_TYPE);
    expect(problems).toEqual([]);
    expect(config?.instanceTypes["gpu1"]?.gpu).toEqual({
      stack: "cuda",
      driverVersion: "12.4",
      hardwareTarget: "8.0",
      deviceCount: 1,
      vram: 40 * 2 ** 30,
    });
    const bad = GPU_TYPE.replace('"12.4"', "12.4")
      .replace("cuda", "opencl")
      .replace("deviceCount: 1", "deviceCount: 0");
    const byPath = Object.fromEntries(problemsOf(bad).map((p) => [p.path, p]));
    expect(Object.keys(byPath).sort()).toEqual([
      "instanceTypes.gpu1.gpu.deviceCount",
      "instanceTypes.gpu1.gpu.driverVersion",
      "instanceTypes.gpu1.gpu.stack",
    ]);
    expect(byPath["instanceTypes.gpu1.gpu.stack"]?.message).toContain("one of: cuda, rocm");
    expect(byPath["instanceTypes.gpu1.gpu.driverVersion"]?.message).toContain("quote it");
    expect(byPath["instanceTypes.gpu1.gpu.deviceCount"]).toMatchObject({
      message: "must be an integer >= 1; got 0",
      line: 10,
    });
  });

  it("reports missing required instance type fields and bad type names", () => {
    const problems = problemsOf(
      'instanceTypes:\n  t1:\n    ram: 1GiB\n  "no good": {vcpus: 1, ram: 1, price: 0}\n',
    );
    expect(problems).toEqual([
      {
        code: "config.missing_key",
        path: "instanceTypes.t1.vcpus",
        message: "is required: an integer >= 1",
        line: 2,
      },
      {
        code: "config.missing_key",
        path: "instanceTypes.t1.price",
        message: "is required: a number >= 0",
        line: 2,
      },
      {
        code: "config.invalid_value",
        path: "instanceTypes.no good",
        message: expect.stringContaining("is not a valid name"),
        line: 4,
      },
    ]);
    expect(onlyProblem("instanceTypes: {}\n").message).toContain("at least one");
  });

  it("reports malformed secret references without echoing them", () => {
    const file = onlyProblem("management:\n  token: file:relative/s3cr3t\n");
    expect(file).toMatchObject({ code: "config.invalid_value", path: "management.token", line: 2 });
    expect(file.message).toContain("file:///absolute/path");
    const env = onlyProblem("dispatcher:\n  privateKey: env:1s3cr3t\n");
    expect(env.message).toContain("env:NAME");
    const notString = onlyProblem("management:\n  token: 123456789\n");
    expect(notString.message).toContain("must be a string");
    for (const p of [file, env, notString]) expect(p.message).not.toMatch(/s3cr3t|123456789/);
  });

  it("never puts a secret's value in any problem or in the thrown error", () => {
    const yaml = [
      "management:",
      "  token: hunter2-literal",
      "  tokn: hunter2-misspelt",
      "dispatcher:",
      "  privateKey: env:hunter2-bad",
      "  pollInterval: 0s",
    ].join("\n");
    const problems = problemsOf(yaml);
    expect(problems.map((p) => p.path)).toEqual([
      "management.tokn",
      "dispatcher.privateKey",
      "dispatcher.pollInterval",
    ]);
    expect(JSON.stringify(problems)).not.toContain("hunter2");
    const dir = mkdtempSync(join(tmpdir(), "dc-config-"));
    const path = join(dir, "config.yml");
    writeFileSync(path, yaml);
    expect(() => loadConfig(path)).toThrow(ConfigError);
    try {
      loadConfig(path);
    } catch (err) {
      expect((err as Error).message).not.toContain("hunter2");
      expect((err as ConfigError).problems).toHaveLength(3);
    }
  });

  it("warns about literal secrets, by key path only", () => {
    const { config, warnings } = parseConfig("management:\n  token: hunter2\n");
    expect(config?.management.token).toBe("hunter2");
    expect(warnings).toEqual([
      { path: "management.token", message: expect.stringContaining("file:///"), line: 2 },
    ]);
    expect(JSON.stringify(warnings)).not.toContain("hunter2");
    expect(parseConfig("management:\n  token: env:DC_TOKEN\n").warnings).toEqual([]);
  });

  it("reads containers.registries by host, warning about a literal password by its key path only", () => {
    const { config, warnings } = parseConfig(
      'containers:\n  registries:\n    "127.0.0.1:5000":\n      username: u\n      password: s3cret\n    docker.io:\n      username: v\n      password: env:DC_HUB\n',
    );
    expect(config?.containers.registries).toEqual({
      "127.0.0.1:5000": { username: "u", password: "s3cret" },
      "docker.io": { username: "v", password: "env:DC_HUB" },
    });
    expect(warnings).toEqual([
      {
        path: "containers.registries.127.0.0.1:5000.password",
        message: expect.stringContaining("file:///"),
        line: 5,
      },
    ]);
    expect(JSON.stringify(warnings)).not.toContain("s3cret");
    expect(config?.containers.pullRetryTimeout).toBe(120_000);
    const bad = onlyProblem("containers:\n  registries:\n    reg.example.org:\n      user: u\n");
    expect(bad.path).toBe("containers.registries.reg.example.org.user");
    expect(onlyProblem('containers:\n  registries:\n    "no such host/x": {}\n').path).toMatch(
      /^containers\.registries/,
    );
  });

  it("reports invalid YAML with its line", () => {
    const p = onlyProblem("cloud:\n  maxInstances: 3\n  driver: [local\nlogging: {}\n");
    expect(p.code).toBe("config.invalid_yaml");
    expect(p.line).toBeGreaterThanOrEqual(3);
    expect(onlyProblem("a: 1\na: 2\n")).toMatchObject({ code: "config.invalid_yaml", line: 2 });
  });

  it("reports a document that is not a mapping", () => {
    expect(onlyProblem("- cloud\n- logging\n")).toMatchObject({ code: "config.invalid_value", path: "" });
    expect(onlyProblem("just text\n").message).toContain("YAML mapping");
  });

  it("treats an empty file and empty values as the defaults", () => {
    expect(parseConfig("").problems).toEqual([]);
    expect(parseConfig("# only a comment\n").problems).toEqual([]);
    const { config } = parseConfig("cloud:\nlogging:\n  level:\n");
    expect(config?.cloud.maxInstances).toBe(64);
    expect(config?.logging.level).toBe("info");
  });

  it("accepts every kind of valid value", () => {
    const { config, problems } = parseConfig(
      [
        "clusterId: x1y2z",
        "database: {url: 'postgres://u@127.0.0.1:5432/db', maxConnections: 20}",
        "restServer: {listen: '[::1]:0', publicUrl: 'https://dc.example.com', maxRequestBodySize: 1048576}",
        "management: {token: 'file:///etc/dispatch-cloud/token'}",
        "dispatcher: {privateKey: 'env:DC_SSH_KEY', staleLockTimeout: 1m30s, runtimeEngine: process}",
        "cloud: {driver: ec2, driverParameters: {region: us-east-1, subnets: [a, b]}, resourceTags: {team: x}}",
      ].join("\n"),
    );
    expect(problems).toEqual([]);
    expect(config?.restServer.maxRequestBodySize).toBe(1048576);
    expect(config?.dispatcher.staleLockTimeout).toBe(90_000);
    expect(config?.cloud.driverParameters).toEqual({ region: "us-east-1", subnets: ["a", "b"] });
  });
});

describe("loadConfig", () => {
  it("returns the defaults without a path", () => {
    expect(loadConfig().cloud.timeoutIdle).toBe(60_000);
  });

  it("reads a file and lists every problem in the thrown error", () => {
    const dir = mkdtempSync(join(tmpdir(), "dc-config-"));
    const good = join(dir, "good.yml");
    writeFileSync(good, "cloud:\n  maxInstances: 5\n");
    expect(loadConfig(good).cloud.maxInstances).toBe(5);
    const bad = join(dir, "bad.yml");
    writeFileSync(bad, 'cloud:\n  timeoutIdle: "abc"\n  maxInstnces: 3\n');
    let caught: unknown;
    try {
      loadConfig(bad);
    } catch (err) {
      caught = err;
    }
    expect(caught).toBeInstanceOf(ConfigError);
    const err = caught as ConfigError;
    expect(err.code).toBe("config.invalid_value");
    expect(err.path).toBe("cloud.timeoutIdle");
    expect(err.message).toContain("cloud.timeoutIdle");
    expect(err.message).toContain("did you mean maxInstances?");
    expect(err.problems).toHaveLength(2);
  });

  it("reports an unreadable file", () => {
    expect(() => loadConfig("/nonexistent/dispatch-cloud.yml")).toThrow(
      expect.objectContaining({ code: "config.unreadable_file" }),
    );
  });
});

describe("closest", () => {
  it("finds near keys ignoring case and separators, and nothing for far ones", () => {
    expect(closest("maxInstnces", ["maxInstances", "maxProbesPerSecond"])).toBe("maxInstances");
    expect(closest("MAX_INSTANCES", ["maxInstances"])).toBe("maxInstances");
    expect(closest("colour", ["level", "format"])).toBeUndefined();
  });
});
