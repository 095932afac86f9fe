/**
 * `npm run build:sea`: the Node single executable application, built into a temporary directory and run
 * from there (nothing beside it), and deployed by a dispatcher as crunch-run to run a bundle.
 */
import { execFile } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { copyFile, mkdtemp, readdir, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { promisify } from "node:util";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { buildSea, ROOT } from "../scripts/build.ts";
import { cloudtestCreatesAndLists } from "./cloud-sdk-check.ts";
import { E2eSystem } from "./e2e-harness.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";

const run = promisify(execFile);
const IMAGE = requireDockerImage();
const VERSION = (JSON.parse(await readFile(path.join(ROOT, "package.json"), "utf8")) as { version: string })
  .version;

let dir: string;
let exe: string;

beforeAll(async () => {
  dir = await mkdtemp(path.join(tmpdir(), "dc-build-sea-"));
  exe = await buildSea(path.join(dir, "dist"));
}, 300_000);

afterAll(async () => {
  if (dir !== undefined) await rm(dir, { recursive: true, force: true });
});

describe("npm run build:sea: dist/dispatch-cloud", () => {
  it("runs `--version`", async () => {
    const { stdout, stderr } = await run(exe, ["--version"]);
    expect(stdout).toContain(VERSION);
    expect(stderr).toBe("");
  });

  it("prints the same `config defaults` as config/defaults.yml", async () => {
    const { stdout } = await run(exe, ["config", "defaults"], { maxBuffer: 1 << 22 });
    expect(stdout).toBe(await readFile(path.join(ROOT, "config", "defaults.yml"), "utf8"));
  });

  it("loads the ec2 and azure drivers' SDKs from its assets: cloudtest creates and lists an instance", async () => {
    await cloudtestCreatesAndLists([exe], dir);
  }, 120_000);

  it("runs crunch-run's `--list` on an empty instance root: nothing, exit 0", async () => {
    const root = await mkdtemp(path.join(dir, "vmroot-"));
    const { stdout } = await run(exe, ["--list"], { env: { ...process.env, DISPATCH_VM_ROOT: root } });
    expect(stdout).toBe("");
  });

  it("runs the same under a package.json of type module and with loader settings in NODE_OPTIONS", async () => {
    const project = await mkdtemp(path.join(dir, "esm-project-"));
    await writeFile(path.join(project, "package.json"), '{"type":"module"}\n');
    const deployed = path.join(project, "crunch-run~0123abcd");
    await copyFile(exe, deployed);
    const env = {
      ...process.env,
      DISPATCH_VM_ROOT: path.join(project, "vm-root"),
      NODE_OPTIONS: "--experimental-default-type=module --import=/nonexistent/loader.mjs",
    };
    expect((await run(deployed, ["--version"], { env })).stdout).toBe(
      `crunch-run (dispatch-cloud) ${VERSION}\n`,
    );
    expect((await run(deployed, ["--list"], { env })).stdout).toBe("");
  });
});

describe("the single executable as the deployed crunch-run", () => {
  let sys: E2eSystem;
  beforeAll(async () => {
    sys = await E2eSystem.start({
      database: "pglite",
      sshServer: "embedded",
      runtimeEngine: "docker",
      cloudYaml: `  deployRunnerBinary: ${exe}`,
    });
  }, 180_000);
  afterAll(async () => {
    await sys?.stop();
  }, 120_000);

  it("runs a bundle to ready on a local VM, where the runner is the executable's bytes", async () => {
    const uuid = await sys.submit({ image: IMAGE, command: ["sh", "-c", "echo sea > /out/which"] });
    const b = await sys.waitState(uuid);
    expect(b.state, sys.output().slice(-4000)).toBe("ready");
    expect((await sys.text(`/bundles/${uuid}/outputs/which`)).body).toBe("sea\n");
    const sha = createHash("sha256")
      .update(await readFile(exe))
      .digest("hex");
    const vms = path.join(sys.dir, "vms");
    const deployed = (await readdir(vms)).map((vm) =>
      path.join(vms, vm, "root/tmp/dispatch-cloud", `crunch-run~${sha}`),
    );
    expect(deployed.some((f) => existsSync(f))).toBe(true);
  }, 180_000);
});
