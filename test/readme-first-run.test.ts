/**
 * The README's run command, exactly as written, as a newcomer types it: from the root of a fresh clone of the
 * project (its package.json says `"type": "module"`, which once made the deployed runner die at once), on the
 * embedded default (PGlite under ./data, the local driver, Docker if its daemon answers, else the process
 * runtime). Then `instance list` and `queue` with nothing else set (the management token `serve` wrote), and a
 * second `serve` in the same clone, which must exit at once naming the first.
 *
 * The clone: the files a `git clone` of the current tree gets (tracked, and new ones git would add), copied into
 * a temporary directory, so that uncommitted work is what gets tested; then the README's command, `npm ci`
 * included (npm's cache is warm after the test command's own `npm ci`). "Without Docker" runs the command in a
 * mount namespace with a tmpfs over /run, where no Docker socket exists, as on a machine without Docker.
 */
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { destroyLocalVms } from "../cloud-drivers/local/driver.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";
import { quiet, REPO } from "./serve-process.ts";

/** The two commands of the README's first ```sh block (comments stripped). */
function readmeRunCommands(readme: string): { serve: string; submit: string } {
  const block = /```sh\n([\s\S]*?)```/.exec(readme)?.[1];
  if (block === undefined) throw new Error("README.md has no ```sh block");
  const lines = block
    .split("\n")
    .map((l) => l.replace(/\s+#.*$/, "").trim())
    .filter((l) => l !== "");
  if (lines.length !== 2) throw new Error(`the README's run block should be two commands, not:\n${block}`);
  return { serve: lines[0]!, submit: lines[1]! };
}

/** A fresh clone of the working tree: every file git would check out, in a new directory. */
function freshClone(): string {
  const parent = mkdtempSync(path.join(tmpdir(), "dc-readme-"));
  const root = path.join(parent, "dispatch-cloud");
  const files = execFileSync("git", ["ls-files", "-z", "--cached", "--others", "--exclude-standard"], {
    cwd: REPO,
    encoding: "utf8",
  })
    .split("\0")
    .filter((f) => f !== "");
  for (const f of files) {
    const from = path.join(REPO, f);
    let st: ReturnType<typeof statSync>;
    try {
      st = statSync(from);
    } catch {
      continue; // deleted in the working tree, not yet committed
    }
    if (!st.isFile()) continue;
    mkdirSync(path.dirname(path.join(root, f)), { recursive: true });
    copyFileSync(from, path.join(root, f));
  }
  return root;
}

interface Running {
  child: ChildProcess;
  /** stdout and stderr as they arrived. */
  output: () => string;
  stdout: () => string;
}

function shell(command: string, cwd: string, opts: { noDocker: boolean }): Running {
  // Without Docker: a private mount namespace whose /run (so /var/run/docker.sock) is an empty tmpfs.
  const argv = opts.noDocker
    ? [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount -t tmpfs none /run && exec sh -c "$0"',
        command,
      ]
    : ["sh", "-c", command];
  const env = { ...process.env };
  for (const k of Object.keys(env)) if (k.startsWith("DISPATCH_CLOUD_")) delete env[k];
  const child = spawn(argv[0]!, argv.slice(1), {
    cwd,
    env,
    detached: true,
    stdio: ["ignore", "pipe", "pipe"],
  });
  let out = "";
  let stdout = "";
  child.stdout?.on("data", (d: Buffer) => {
    out += d.toString();
    stdout += d.toString();
  });
  child.stderr?.on("data", (d: Buffer) => {
    out += d.toString();
  });
  return { child, output: () => out, stdout: () => stdout };
}

async function until(what: string, ok: () => boolean, r: Running, ms: number): Promise<void> {
  const end = Date.now() + ms;
  while (!ok()) {
    if (r.child.exitCode !== null)
      throw new Error(`${what}: the process exited (${r.child.exitCode}):\n${r.output()}`);
    if (Date.now() > end) throw new Error(`${what}: not within ${ms} ms:\n${r.output().slice(-6000)}`);
    await new Promise((res) => setTimeout(res, 100));
  }
}

function finished(r: Running, ms: number): Promise<number | null> {
  return new Promise((resolve, reject) => {
    if (r.child.exitCode !== null) {
      resolve(r.child.exitCode);
      return;
    }
    const timer = setTimeout(() => reject(new Error(`did not end within ${ms} ms:\n${r.output()}`)), ms);
    r.child.once("exit", (code) => {
      clearTimeout(timer);
      resolve(code);
    });
  });
}

function groupAlive(pgid: number): boolean {
  try {
    process.kill(-pgid, 0);
    return true;
  } catch {
    return false;
  }
}

const clones: string[] = [];
const serves: Running[] = [];
afterAll(async () => {
  for (const s of serves) {
    if (s.child.exitCode === null && s.child.pid !== undefined) {
      try {
        process.kill(-s.child.pid, "SIGINT");
      } catch {
        // gone
      }
      await finished(s, 30_000).catch(() => s.child.kill("SIGKILL"));
    }
  }
  for (const root of clones) {
    await destroyLocalVms(path.join(root, "data", "local-vms"), quiet).catch(() => 0);
    rmSync(path.dirname(root), { recursive: true, force: true });
  }
}, 120_000);

const readme = readFileSync(path.join(REPO, "README.md"), "utf8");

describe("the README's run command, from the root of a fresh clone", () => {
  it("is two commands: npm ci && serve, then submit --wait", () => {
    const { serve, submit } = readmeRunCommands(readme);
    expect(serve).toBe("npm ci && ./bin/dispatch-cloud serve");
    expect(submit).toMatch(/^\.\/bin\/dispatch-cloud submit --wait --image busybox -- echo hello$/);
  });

  describe.each([
    { variant: "with Docker", noDocker: false },
    { variant: "without Docker", noDocker: true },
  ])("$variant", ({ noDocker }) => {
    it("prints the bundle's output; instance list and queue work with nothing else set; a second serve exits at once", async () => {
      if (!noDocker) {
        requireDockerImage();
        try {
          execFileSync("docker", ["image", "inspect", "busybox"], { stdio: "ignore" });
        } catch {
          throw new Error(
            "Docker has no image named busybox: run `bash scripts/test-services.sh` as root (tags the test image)",
          );
        }
      }
      const root = freshClone();
      clones.push(root);
      const { serve, submit } = readmeRunCommands(readme);

      const server = shell(serve, root, { noDocker });
      serves.push(server);
      await until("serve starts", () => /REST API at/.test(server.output()), server, 300_000);

      const client = shell(submit, root, { noDocker: false });
      expect(await finished(client, 240_000), client.output()).toBe(0);
      expect(client.stdout()).toMatch(/^hello$/m);
      // The runtime the bundle ran in says which variant this was.
      const events = shell(`./bin/dispatch-cloud bundles list --json`, root, { noDocker: false });
      expect(await finished(events, 60_000), events.output()).toBe(0);
      const uuid = (JSON.parse(events.stdout()) as Array<{ uuid: string }>)[0]?.uuid;
      const logs = shell(`./bin/dispatch-cloud bundles logs ${uuid} --stream stderr`, root, {
        noDocker: false,
      });
      expect(await finished(logs, 60_000), logs.output()).toBe(0);
      expect(logs.stdout()).toContain(noDocker ? "runtime: process" : "runtime: docker");

      for (const command of ["./bin/dispatch-cloud instance list", "./bin/dispatch-cloud queue"]) {
        const r = shell(command, root, { noDocker: false });
        expect(await finished(r, 60_000), `${command}: ${r.output()}`).toBe(0);
      }
      const list = shell("./bin/dispatch-cloud instance list --header", root, { noDocker: false });
      await finished(list, 60_000);
      expect(list.stdout()).toMatch(/^INSTANCE\s+ADDRESS\s+STATE/m);
      expect(list.stdout()).toMatch(/^local-\S+\s+127\.0\.0\.1:\d+\s+(idle|running)\s/m);

      const second = shell("./bin/dispatch-cloud serve", root, { noDocker: false });
      expect(await finished(second, 60_000)).not.toBe(0);
      expect(second.output()).toContain(`the data directory ${path.join(root, "data")} is in use by`);
      expect(second.output()).toMatch(/another dispatch-cloud serve \(pid \d+, started /);
      expect(second.output()).toContain("[serve.data_dir_in_use]");
      expect(second.output()).not.toMatch(/\n\s+at /); // no stack trace

      // Ctrl-C: the terminal sends SIGINT to the whole process group; serve shuts down and every process of
      // the group ends (local VMs run in their own sessions and outlive it, like cloud VMs).
      const pid = server.child.pid!;
      process.kill(-pid, "SIGINT");
      await finished(server, 60_000);
      const end = Date.now() + 60_000;
      while (groupAlive(pid)) {
        if (Date.now() > end)
          throw new Error(`serve did not end after Ctrl-C:\n${server.output().slice(-4000)}`);
        await new Promise((res) => setTimeout(res, 100));
      }
      expect(server.output()).toContain('"msg":"shutting down"');
      // The data directory and what serve wrote in it are private.
      expect(statSync(path.join(root, "data")).mode & 0o777).toBe(0o700);
      for (const f of ["admin-token", "management-token", "dispatcher-ssh-key"]) {
        expect(statSync(path.join(root, "data", f)).mode & 0o777, f).toBe(0o600);
      }
    }, 600_000);
  });
});
