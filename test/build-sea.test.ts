/**
 * `npm run build:sea`: the Node single executable application, built into a temporary directory and run
 * from there (nothing beside it).
 */
import { execFile } from "node:child_process";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { promisify } from "node:util";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { buildSea, ROOT } from "../scripts/build.ts";

const run = promisify(execFile);
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

  it("runs crunch-run's `--list` on an empty instance root: nothing, exit 0", async () => {
    const root = await mkdtemp(path.join(dir, "vmroot-"));
    const { stdout } = await run(exe, ["--list"], { env: { ...process.env, DISPATCH_VM_ROOT: root } });
    expect(stdout).toBe("");
  });
});
