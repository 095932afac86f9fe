/**
 * The process runtime's user separation, end to end: a real REST server (in process, PGlite), crunch-run as a
 * real process from sources, and bundles whose commands probe what they can reach. Tests run as root here, so
 * each bundle gets a uid of its own; a second instance root run by the unprivileged user `dcvm` shows what is
 * left when the runner is not root (the same checks then succeed, which is also what shows they can fail).
 */
import { spawn } from "node:child_process";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { chmod, chown, mkdtemp, readdir, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runnerPaths } from "../crunch-run/paths.ts";
import { leasedUids, uidPids } from "../crunch-run/uid-lease.ts";
import { DEFAULT_PROCESS_UIDS } from "../lib/runner-protocol.ts";
import {
  type RunnerHarness,
  type RunResult,
  startRunnerHarness,
  stopProcessesOf,
  supervisorLog,
} from "./crunch-run-harness.ts";
import { useTestDb } from "./db.ts";
import { BIN } from "./serve-process.ts";

/** What a bundle's command tries; one line per probe, `<what>:<outcome>`. */
const PROBES = [
  'echo "uid=$(id -u) gid=$(id -g) ppid=$PPID"',
  "( exec 3< /proc/$PPID/mem ) 2>/dev/null && echo mem:open || echo mem:denied",
  "cat /proc/$PPID/environ >/dev/null 2>&1 && echo environ:read || echo environ:denied",
  "kill -0 $PPID 2>/dev/null && echo signal:sent || echo signal:denied",
].join("\n");

describe("crunch-run (process runtime): a uid of its own per bundle", () => {
  const getDb = useTestDb("pglite");
  let h: RunnerHarness;
  beforeAll(async () => {
    if (process.getuid?.() !== 0) {
      throw new Error("these tests run crunch-run as root (as scripts/test.sh does): run them as root");
    }
    h = await startRunnerHarness(getDb());
  });
  afterAll(async () => {
    await h?.close();
  });

  const workDirOf = (b: { uuid: string; attempt: number }) =>
    join(h.root, "tmp", "crunch-run", `${b.uuid}-${b.attempt}`);

  it("keeps the runner's memory, environment and other bundles' work dirs from the command; outputs still upload", async () => {
    // A ready bundle to depend on.
    const dep = await h.newStartingBundle({
      command: ["sh", "-c", 'echo data > "$DISPATCH_OUTPUT_DIR/data.txt"'],
    });
    expect((await h.detach(dep)).code).toBe(0);
    expect((await h.waitFinal(dep.uuid)).state).toBe("ready");

    // Bundle A runs until the test lets it go; it leaves a process outside its group behind.
    const a = await h.newStartingBundle({
      command: [
        "sh",
        "-c",
        "id -u > uid; echo secret-a > secret; setsid sleep 600 </dev/null >/dev/null 2>&1 & while [ ! -e stop ]; do sleep 0.05; done",
      ],
    });
    expect((await h.detach(a)).code).toBe(0);
    const aOut = join(workDirOf(a), "out");
    // The shell makes the file before `id` writes to it: wait for the whole line (an empty file read as uid 0).
    const uidLine = () => (existsSync(join(aOut, "uid")) ? readFileSync(join(aOut, "uid"), "utf8") : "");
    await waitFor(async () => /^\d+\n$/.test(uidLine()));
    const uidA = Number(uidLine());
    expect(uidA).toBeGreaterThan(0);

    // Bundle B probes the runner, bundle A's work dir and its own inputs.
    const b = await h.newStartingBundle({
      command: [
        "sh",
        "-c",
        [
          PROBES,
          'ls "$A_DIR" >/dev/null 2>&1 && echo a-dir:listed || echo a-dir:denied',
          'cat "$A_DIR/out/secret" >/dev/null 2>&1 && echo a-secret:read || echo a-secret:denied',
          'touch "$DISPATCH_INPUT_DIR/new" 2>/dev/null && echo in:written || echo in:read-only',
          'touch "$DISPATCH_INPUT_DIR/first/new" 2>/dev/null && echo in-first:written || echo in-first:read-only',
          'echo more >> "$DISPATCH_INPUT_DIR/first/data.txt" 2>/dev/null && echo in-file:written || echo in-file:read-only',
          'cat "$DISPATCH_INPUT_DIR/first/data.txt" > result.txt',
        ].join("\n"),
      ],
      env: { A_DIR: workDirOf(a) },
      dependencies: [{ bundle: dep.uuid, subpath: "", name: "first" }],
    });
    const detached = await h.detach(b);
    expect(detached.code, detached.stderr).toBe(0);
    const supervisorPid = (JSON.parse(detached.stdout) as { pid: number }).pid;
    const final = await h.waitFinal(b.uuid);
    expect(final.state, await supervisorLog(h.root, b.uuid)).toBe("ready");
    const lines = (await h.log(b.uuid, "stdout")).trim().split("\n");
    const [, uid, gid, ppid] = /^uid=(\d+) gid=(\d+) ppid=(\d+)$/.exec(lines[0] ?? "") ?? [];
    expect(Number(ppid)).toBe(supervisorPid);
    const uidB = Number(uid);
    expect(uidB).not.toBe(0);
    expect(uidB).toBeGreaterThanOrEqual(DEFAULT_PROCESS_UIDS.first);
    expect(uidB).toBeLessThan(DEFAULT_PROCESS_UIDS.first + DEFAULT_PROCESS_UIDS.count);
    expect(Number(gid)).toBe(uidB);
    expect(uidB).not.toBe(uidA);
    expect(lines.slice(1)).toEqual([
      "mem:denied",
      "environ:denied",
      "signal:denied",
      "a-dir:denied",
      "a-secret:denied",
      "in:read-only",
      "in-first:read-only",
      "in-file:read-only",
    ]);
    expect(await h.output(b.uuid, "result.txt")).toEqual({ status: 200, body: "data\n" });
    expect(await h.log(b.uuid, "stderr")).toContain("the bundle runs as a user of its own");

    // A ends: its outputs (its uid's files) upload, and nothing of its uid is left running.
    expect(uidPids(uidA).length).toBeGreaterThan(1);
    writeFileSync(join(aOut, "stop"), "");
    const finalA = await h.waitFinal(a.uuid);
    expect(finalA.state, await supervisorLog(h.root, a.uuid)).toBe("ready");
    expect(await h.output(a.uuid, "secret")).toEqual({ status: 200, body: "secret-a\n" });
    await waitFor(async () => (await h.listBundles()) === "");
    expect(uidPids(uidA)).toEqual([]);
    expect(uidPids(uidB)).toEqual([]);
    // The uids went back; the work dirs are gone.
    const leases = leasedUids(runnerPaths(h.env).uidLeaseDir);
    expect(leases).not.toContain(uidA);
    expect(leases).not.toContain(uidB);
    expect(await readdir(join(h.root, "tmp", "crunch-run"))).toEqual([]);
  });

  it("fails a bundle whose command cannot be run, naming the command", async () => {
    const b = await h.newStartingBundle({ command: ["no-such-command-here", "x"] });
    expect((await h.detach(b)).code).toBe(0);
    const final = await h.waitFinal(b.uuid);
    expect(final.state).toBe("failed");
    expect(final.exitCode).toBeNull();
    expect(final.stateReason).toContain('the command "no-such-command-here" cannot be run');
    const script = await h.newStartingBundle({ command: ["/etc/passwd"] });
    expect((await h.detach(script)).code).toBe(0);
    expect((await h.waitFinal(script.uuid)).stateReason).toBe(
      'the command "/etc/passwd" cannot be run: permission denied',
    );
  });

  describe("run by a runner that is not root (the user dcvm)", () => {
    const user = process.env["DISPATCH_CLOUD_TEST_VM_USER"] ?? "dcvm";
    let root = "";
    let ids = { uid: -1, gid: -1 };
    beforeAll(async () => {
      ids = await idsOf(user);
      root = await mkdtemp(join(tmpdir(), "crunch-run-vm-dcvm-"));
      await chown(root, ids.uid, ids.gid);
      await chmod(root, 0o755);
    });
    afterAll(async () => {
      if (root === "") return;
      // The warm pool, its spare and a supervisor gone back to it write under the root: stop them first.
      const left = await stopProcessesOf(root);
      await rm(root, { recursive: true, force: true, maxRetries: 5 });
      expect(left, "processes of the runner's root that outlived SIGKILL").toEqual([]);
    });

    it("runs the bundle as the runner's own user and says in its stderr what that leaves open", async () => {
      const b = await h.newStartingBundle({ command: ["sh", "-c", PROBES] });
      const res = await runAs(
        ids,
        ["--detach", b.uuid],
        {
          ...h.env,
          DISPATCH_VM_ROOT: root,
        },
        JSON.stringify({
          uuid: b.uuid,
          attempt: b.attempt,
          apiUrl: h.apiUrl,
          token: b.token,
          instanceType: "small",
          gpuDevices: [],
          runtimeEngine: "process",
          heartbeatIntervalMs: 200,
        }),
      );
      expect(res.code, res.stderr).toBe(0);
      const supervisorPid = (JSON.parse(res.stdout) as { pid: number }).pid;
      const final = await h.waitFinal(b.uuid);
      expect(final.state, await supervisorLog(root, b.uuid)).toBe("ready");
      // Same uid: the very probes that root's separation denies succeed.
      expect((await h.log(b.uuid, "stdout")).trim().split("\n")).toEqual([
        `uid=${ids.uid} gid=${ids.gid} ppid=${supervisorPid}`,
        "mem:open",
        "environ:read",
        "signal:sent",
      ]);
      const stderr = await h.log(b.uuid, "stderr");
      expect(stderr).toContain(
        `[crunch-run] WARNING: process runtime: NO ISOLATION — the runner is not root, so the bundle runs as the runner's own user (uid ${ids.uid})`,
      );
      expect(stderr).toContain(
        "it can read the runner's memory (/proc/<pid>/mem) and in it this attempt's runner token",
      );
      expect(stderr).toContain("other bundles' work dirs on this instance included");
      expect(await supervisorLog(root, b.uuid)).not.toContain(b.token);
    });
  });
});

async function waitFor(cond: () => Promise<boolean>, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error("condition not met in time");
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** A user's uid and gid, from /etc/passwd; a missing user fails with how to get it. */
async function idsOf(user: string): Promise<{ uid: number; gid: number }> {
  const line = readFileSync("/etc/passwd", "utf8")
    .split("\n")
    .find((l) => l.startsWith(`${user}:`));
  const [, , uid, gid] = line?.split(":") ?? [];
  if (uid === undefined || gid === undefined) {
    throw new Error(`no user ${user} on this machine: scripts/test-services.sh creates it`);
  }
  return { uid: Number(uid), gid: Number(gid) };
}

/** crunch-run from sources as another user. */
function runAs(
  ids: { uid: number; gid: number },
  args: string[],
  env: NodeJS.ProcessEnv,
  stdin: string,
): Promise<RunResult> {
  return new Promise((resolve, reject) => {
    const child = spawn(BIN, args, { env, uid: ids.uid, gid: ids.gid, stdio: ["pipe", "pipe", "pipe"] });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (d: Buffer) => {
      stdout += d.toString();
    });
    child.stderr.on("data", (d: Buffer) => {
      stderr += d.toString();
    });
    child.on("error", reject);
    child.on("close", (code) => resolve({ code, stdout, stderr }));
    child.stdin.end(stdin);
  });
}
