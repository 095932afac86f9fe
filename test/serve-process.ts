import { type ChildProcess, execFile, spawn } from "node:child_process";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { destroyLocalVms } from "../cloud-drivers/local/driver.ts";
import { silentLogger as quiet } from "./fixtures.ts";

export { silentLogger as quiet } from "./fixtures.ts";

export const REPO = resolve(import.meta.dirname, "..");
export const BIN = join(REPO, "bin", "dispatch-cloud");

/** Runs `bin/dispatch-cloud <args>` to its end (at most 2 minutes): its exit code (-1: killed) and output. */
export function runBin(
  args: string[],
  env: NodeJS.ProcessEnv = process.env,
): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((ok) => {
    execFile(BIN, args, { timeout: 120_000, env }, (err, stdout, stderr) => {
      ok({ code: err === null ? 0 : typeof err.code === "number" ? err.code : -1, stdout, stderr });
    });
  });
}

export interface ServeProcess {
  dir: string;
  apiUrl: string;
  child: ChildProcess;
  stderr: () => string;
  stop(): Promise<number | null>;
}

/**
 * Starts `bin/dispatch-cloud serve` as a real process on a fresh PGlite directory and an ephemeral port,
 * and resolves once it prints the address it listens on. `opts.dir`: the directory to use (its `data/` is the
 * data directory; removed by stop()) instead of a new one.
 */
export async function startServe(extraYaml = "", opts: { dir?: string } = {}): Promise<ServeProcess> {
  const dir = opts.dir ?? (await mkdtemp(join(tmpdir(), "dc-serve-")));
  const config = join(dir, "config.yml");
  await writeFile(
    config,
    `clusterId: tst01\ndataDir: ${dir}/data\ndatabase:\n  url: "pglite:${dir}/data/pglite"\n` +
      `restServer:\n  listen: "127.0.0.1:0"\nmanagement:\n  listen: "127.0.0.1:0"\nlogging:\n  level: warn\n${extraYaml}`,
  );
  const child = spawn(BIN, ["serve", "--config", config], { cwd: dir, stdio: ["ignore", "pipe", "pipe"] });
  let err = "";
  child.stderr?.on("data", (d: Buffer) => {
    err += d.toString();
  });
  const apiUrl = await new Promise<string>((ok, fail) => {
    const timer = setTimeout(
      () => fail(new Error(`serve did not start within 60 s; stderr:\n${err}`)),
      60_000,
    );
    child.stderr?.on("data", () => {
      const m = /REST API at (http:\/\/[^\s/]+)/.exec(err);
      if (m?.[1] !== undefined) {
        clearTimeout(timer);
        ok(m[1]);
      }
    });
    child.on("exit", (code) => {
      clearTimeout(timer);
      fail(new Error(`serve exited with ${code} before listening; stderr:\n${err}`));
    });
  });
  return {
    dir,
    apiUrl,
    child,
    stderr: () => err,
    async stop() {
      const exited = new Promise<number | null>((ok) => child.once("exit", (code) => ok(code)));
      child.kill("SIGTERM");
      const code = await exited;
      await destroyLocalVms(join(dir, "data", "local-vms"), quiet);
      await rm(dir, { recursive: true, force: true });
      return code;
    },
  };
}

/** A silent logger for clean-up (VMs outlive the serve that made them, as cloud VMs do). */
