/**
 * The README's run command, end to end, on the embedded default: `serve` with no --config (PGlite under
 * ./data, the local driver with embedded SSH, Docker because the daemon answers) and `submit --wait` from the
 * same directory, which prints the bundle's output when it is ready.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { destroyLocalVms } from "../cloud-drivers/local/driver.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";
import { BIN, quiet } from "./serve-process.ts";

const IMAGE = requireDockerImage();

function run(args: string[], cwd: string): Promise<{ code: number | null; out: string; err: string }> {
  return new Promise((resolve) => {
    const child = spawn(BIN, args, { cwd, stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    let err = "";
    child.stdout.on("data", (d: Buffer) => {
      out += d.toString();
    });
    child.stderr.on("data", (d: Buffer) => {
      err += d.toString();
    });
    child.on("exit", (code) => resolve({ code, out, err }));
  });
}

describe("the embedded default (serve with no config)", () => {
  let dir: string;
  let serve: ChildProcess;
  let serveErr = "";

  beforeAll(async () => {
    dir = mkdtempSync(path.join(tmpdir(), "dc-embedded-"));
    const env = { ...process.env };
    delete env["DISPATCH_CLOUD_CONFIG"];
    serve = spawn(BIN, ["serve"], { cwd: dir, env, stdio: ["ignore", "ignore", "pipe"] });
    serve.stderr?.on("data", (d: Buffer) => {
      serveErr += d.toString();
    });
    const until = Date.now() + 90_000;
    while (!/REST API at/.test(serveErr)) {
      if (serve.exitCode !== null || Date.now() > until) throw new Error(`serve did not start:\n${serveErr}`);
      await new Promise((r) => setTimeout(r, 50));
    }
  }, 120_000);

  afterAll(async () => {
    if (serve !== undefined && serve.exitCode === null) {
      serve.kill("SIGTERM");
      await new Promise((r) => serve.once("exit", r));
    }
    if (dir !== undefined) {
      await destroyLocalVms(path.join(dir, "data", "local-vms"), quiet);
      rmSync(dir, { recursive: true, force: true });
    }
  }, 60_000);

  it("runs a first bundle to ready and prints its output", async () => {
    const r = await run(
      [
        "submit",
        "--wait",
        "--image",
        IMAGE,
        "--",
        "sh",
        "-c",
        'echo hello; echo "hi there" > "$DISPATCH_OUTPUT_DIR/greeting"',
      ],
      dir,
    );
    expect(r.code, `${r.out}\n${r.err}\n--- serve:\n${serveErr.slice(-4000)}`).toBe(0);
    expect(r.out).toContain("hello");
    expect(r.err).toContain("greeting");
    // The state lives under ./data: PGlite's files and the admin token.
    expect(readFileSync(path.join(dir, "data", "admin-token"), "utf8")).toMatch(/^dcu_/);
  }, 180_000);
});
