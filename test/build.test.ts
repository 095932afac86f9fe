/**
 * The one-file artifact (`npm run build`): built once into a temporary directory outside the repository, so
 * nothing beside the file (no node_modules, no store/migrations, no PGlite files) can be found by it.
 */
import { type ChildProcess, execFile, spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { mkdir, mkdtemp, readdir, readFile, rm, stat, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { promisify } from "node:util";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { loadRunnerArtifact, runningFromSources } from "../cli/runner-artifact.ts";
import { VM_MAIN_PATTERN, vmMainArgs } from "../cloud-drivers/local/launch.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import {
  ARTIFACT_LAUNCHER,
  ARTIFACT_NAME,
  buildCjs,
  LAZY_GROUPS,
  LAZY_TRAILER_MARKER,
  PGLITE_TRAILER_MARKER,
  ROOT,
} from "../scripts/build.ts";
import { cloudtestCreatesAndLists } from "./cloud-sdk-check.ts";
import { silentLogger as logger } from "./fixtures.ts";

const run = promisify(execFile);
const VERSION = (JSON.parse(await readFile(path.join(ROOT, "package.json"), "utf8")) as { version: string })
  .version;

let dir: string;
let file: string;

beforeAll(async () => {
  dir = await mkdtemp(path.join(tmpdir(), "dc-build-"));
  ({ file } = await buildCjs(path.join(dir, "dist")));
}, 180_000);

afterAll(async () => {
  if (dir !== undefined) await rm(dir, { recursive: true, force: true });
});

describe("npm run build: dist/dispatch-cloud.cjs", () => {
  it("is one executable file behind its two-line launcher, PGlite's files after the code", async () => {
    expect(await readdir(path.dirname(file))).toEqual([ARTIFACT_NAME]);
    const st = await stat(file);
    expect(st.mode & 0o111).toBe(0o111);
    const content = await readFile(file);
    expect(content.subarray(0, 300).toString().split("\n").slice(0, 2)).toEqual([...ARTIFACT_LAUNCHER]);
    const marker = content.lastIndexOf(PGLITE_TRAILER_MARKER);
    expect(marker).toBeGreaterThan(1_000_000);
    expect(content.subarray(marker - 1, marker).toString()).toBe("\n");
    expect(content.subarray(content.length - 3).toString()).toBe("*/\n");
  });

  it("carries the cloud SDKs apart, each in its trailer comment before PGlite's", async () => {
    const content = await readFile(file);
    const pglite = content.lastIndexOf(PGLITE_TRAILER_MARKER);
    for (const group of Object.keys(LAZY_GROUPS)) {
      const at = content.lastIndexOf(`${LAZY_TRAILER_MARKER}${group}:`);
      expect(at, group).toBeGreaterThan(1_000_000);
      expect(at, group).toBeLessThan(pglite);
    }
    // Not in the code itself: the SDKs' internals are only in the gzipped trailers.
    const code = content.subarray(0, content.indexOf(`${LAZY_TRAILER_MARKER}aws:`)).toString();
    for (const internal of ['"SpotPriceHistoryList"', "AzureCliCredential", "virtualMachineScaleSetVMs"]) {
      expect(code).not.toContain(internal);
    }
  });

  it("loads the ec2 and azure drivers' SDKs from those trailers: cloudtest creates and lists an instance", async () => {
    await cloudtestCreatesAndLists([process.execPath, file], dir);
  }, 120_000);

  it("runs `--version` (crunch-run's) through its shebang", async () => {
    const { stdout } = await run(file, ["--version"]);
    expect(stdout).toContain(VERSION);
  });

  it("runs as CommonJS wherever it is put: under a package.json of type module, named .mjs or .js, with NODE_OPTIONS", async () => {
    // As the dispatcher deploys it into a local VM's root inside a project whose package.json says "module".
    const project = path.join(dir, "esm-project");
    const deployed = path.join(project, "data", "local-vms", "vm-1", "root", "tmp", "dispatch-cloud");
    await mkdir(deployed, { recursive: true });
    await writeFile(path.join(project, "package.json"), '{"type":"module"}\n');
    const content = await readFile(file);
    const env = { ...process.env, DISPATCH_VM_ROOT: path.join(project, "vm-root") };
    for (const name of ["crunch-run~0123abcd", "runner.mjs", "runner.js"]) {
      const target = path.join(deployed, name);
      await writeFile(target, content, { mode: 0o755 });
      const version = await run(target, ["--version"], { env });
      expect(version.stdout, name).toBe(`crunch-run (dispatch-cloud) ${VERSION}\n`);
      const list = await run(target, ["--list"], { env });
      expect(list.stdout, name).toBe("");
    }
    const loaders = "--experimental-default-type=module --import=/nonexistent/loader.mjs";
    const withOptions = await run(path.join(deployed, "crunch-run~0123abcd"), ["--version"], {
      env: { ...env, NODE_OPTIONS: loaders },
    });
    expect(withOptions.stdout).toBe(`crunch-run (dispatch-cloud) ${VERSION}\n`);
    // Started by node itself under its .cjs name, the launcher lines are a hashbang and a statement.
    const cjs = path.join(project, "dispatch-cloud.cjs");
    await writeFile(cjs, content, { mode: 0o755 });
    expect((await run(process.execPath, [cjs, "--version"], { env })).stdout).toContain(VERSION);
  });

  it("prints the same `config defaults` as config/defaults.yml", async () => {
    const { stdout } = await run(process.execPath, [file, "config", "defaults"], { maxBuffer: 1 << 22 });
    expect(stdout).toBe(await readFile(path.join(ROOT, "config", "defaults.yml"), "utf8"));
  });

  it("runs crunch-run's `--list` on an empty instance root: nothing, exit 0", async () => {
    const root = await mkdtemp(path.join(dir, "vmroot-"));
    const { stdout } = await run(file, ["--list"], { env: { ...process.env, DISPATCH_VM_ROOT: root } });
    expect(stdout).toBe("");
  });

  it("has the hidden __local-vm command (usage error without an absolute directory)", async () => {
    const err = await run(file, ["__local-vm", "relative"]).then(
      () => null,
      (e: { code: number; stderr: string }) => e,
    );
    expect(err?.code).toBe(2);
    expect(err?.stderr).toContain("usage: vm-main.ts <absolute VM directory>");
  });

  it("serves on a fresh PGlite directory (migrations and PGlite built in) and answers /_health/ping", async () => {
    const work = await mkdtemp(path.join(dir, "serve-"));
    const config = path.join(work, "config.yml");
    await writeFile(
      config,
      `clusterId: tst01\ndataDir: ${work}/data\ndatabase:\n  url: "pglite:${work}/data/pglite"\n` +
        `restServer:\n  listen: "127.0.0.1:0"\nmanagement:\n  listen: "127.0.0.1:0"\nlogging:\n  level: warn\n`,
    );
    const child = spawn(file, ["serve", "--config", config], {
      cwd: work,
      stdio: ["ignore", "pipe", "pipe"],
    });
    try {
      const apiUrl = await listening(child);
      const res = await fetch(`${apiUrl}/_health/ping`);
      expect(res.status).toBe(200);
      expect(await res.json()).toEqual({ health: "OK" });
      const exited = new Promise<number | null>((ok) => child.once("exit", (code) => ok(code)));
      child.kill("SIGTERM");
      expect(await exited).toBe(0);
    } finally {
      if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
    }
  }, 120_000);
});

/** Resolves with the REST URL once `serve` prints it; rejects with its stderr if it exits first. */
function listening(child: ChildProcess): Promise<string> {
  let err = "";
  return new Promise<string>((ok, fail) => {
    child.stderr?.on("data", (d: Buffer) => {
      err += d.toString();
      const m = /REST API at (http:\/\/[^\s/]+)/.exec(err);
      if (m?.[1] !== undefined) ok(m[1]);
    });
    child.once("exit", (code) =>
      fail(new Error(`serve exited with ${code} before listening; stderr:\n${err}`)),
    );
  });
}

describe("loadRunnerArtifact", () => {
  it("runs from sources here, so it builds the same one-file program (cached) as npm run build", async () => {
    expect(runningFromSources()).toBe(true);
    const a = await loadRunnerArtifact({ deployRunnerBinary: "", logger });
    expect(a.sha256).toBe(createHash("sha256").update(a.content).digest("hex"));
    expect(a.content.equals(await readFile(file))).toBe(true);
    const again = await loadRunnerArtifact({ deployRunnerBinary: "", logger });
    expect(again.sha256).toBe(a.sha256);
  }, 180_000);

  it("deploys cloud.deployRunnerBinary when it is set", async () => {
    const custom = path.join(dir, "my-runner");
    await writeFile(custom, "#!/bin/sh\nexit 0\n", { mode: 0o755 });
    const a = await loadRunnerArtifact({ deployRunnerBinary: custom, logger });
    expect(a.content.toString()).toBe("#!/bin/sh\nexit 0\n");
    expect(a.sha256).toBe(createHash("sha256").update("#!/bin/sh\nexit 0\n").digest("hex"));
  });

  it("rejects a missing cloud.deployRunnerBinary with a config error naming the key", async () => {
    const err = await loadRunnerArtifact({ deployRunnerBinary: path.join(dir, "nope"), logger }).catch(
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(DispatchCloudError);
    expect(err).toMatchObject({ code: "config.unreadable_file", path: "cloud.deployRunnerBinary" });
  });
});

describe("local VM processes", () => {
  it("are recognised in both forms: vm-main (from sources) and the artifact's __local-vm command", () => {
    expect(VM_MAIN_PATTERN.test("/w/cloud-drivers/local/vm-main.ts")).toBe(true);
    expect(VM_MAIN_PATTERN.test("/w/node_modules/.cache/dispatch-cloud/vm-main-0123abcd.cjs")).toBe(true);
    expect(VM_MAIN_PATTERN.test("__local-vm")).toBe(true);
    expect(VM_MAIN_PATTERN.test("/w/dist/dispatch-cloud.cjs")).toBe(false);
    expect(VM_MAIN_PATTERN.test("x__local-vm")).toBe(false);
  });

  it("start from vm-main when running from sources", async () => {
    const args = await vmMainArgs(logger);
    expect(args.some((a) => VM_MAIN_PATTERN.test(a))).toBe(true);
    expect(args).not.toContain("__local-vm");
  });
});
