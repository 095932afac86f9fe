import { describe, expect, it } from "vitest";
import { defaultConfig } from "../../config/load.ts";
import { containerLogMaxBytes, pullRetryMs, registryAuthFor } from "./remote-runner.ts";

describe("registryAuthFor (the start document's registryAuth)", () => {
  const base = defaultConfig();
  const config = {
    containers: {
      ...base.containers,
      registries: {
        "127.0.0.1:5000": { username: "u", password: "env:DC_TEST_REG_PW" },
        "docker.io": { username: "hub", password: "env:DC_TEST_HUB_PW" },
      },
    },
  };
  const env = { DC_TEST_REG_PW: "s3cret", DC_TEST_HUB_PW: "tok" };

  it("carries only the image's own registry's entry, its password read from its reference", () => {
    const warnings: string[] = [];
    const warn = (m: string) => warnings.push(m);
    expect(registryAuthFor("127.0.0.1:5000/a/b:1", config, warn, env)).toEqual([
      { server: "127.0.0.1:5000", username: "u", password: "s3cret" },
    ]);
    expect(registryAuthFor("busybox", config, warn, env)).toEqual([
      { server: "docker.io", username: "hub", password: "tok" },
    ]);
    expect(registryAuthFor("quay.io/x/y", config, warn, env)).toEqual([]);
    expect(registryAuthFor("Not A Reference", config, warn, env)).toEqual([]);
    expect(warnings).toEqual([]);
  });

  it("leaves out a password that cannot be read, saying so by key path only", () => {
    const warnings: string[] = [];
    expect(registryAuthFor("127.0.0.1:5000/a/b:1", config, (m) => warnings.push(m), {})).toEqual([]);
    expect(warnings).toEqual([expect.stringContaining("containers.registries.127.0.0.1:5000.password")]);
    expect(warnings[0]).toContain("DC_TEST_REG_PW");
  });
});

describe("pullRetryMs (the start document's imagePullRetryMs)", () => {
  it("is containers.pullRetryTimeout within the bounds crunch-run accepts", () => {
    const c = (ms: number) => ({ containers: { ...defaultConfig().containers, pullRetryTimeout: ms } });
    expect(pullRetryMs(c(3000))).toBe(3000);
    expect(pullRetryMs(c(1))).toBe(100);
    expect(pullRetryMs(c(30 * 86_400_000))).toBe(86_400_000);
  });
});

describe("containerLogMaxBytes (the start document's cap on docker's own log)", () => {
  it("is dispatcher.containerLogMaxSize within the bounds crunch-run accepts", () => {
    const c = (bytes: number) => ({
      dispatcher: { ...defaultConfig().dispatcher, containerLogMaxSize: bytes },
    });
    expect(containerLogMaxBytes(defaultConfig())).toBe(256 * 2 ** 20);
    expect(containerLogMaxBytes(c(5 * 2 ** 20))).toBe(5 * 2 ** 20);
    expect(containerLogMaxBytes(c(1))).toBe(2 ** 20);
    expect(containerLogMaxBytes(c(2 ** 50))).toBe(2 ** 40);
  });
});
