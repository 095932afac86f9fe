/**
 * crunch-run end to end with the process runtime: a real REST server (in process, on PGlite and PostgreSQL)
 * and crunch-run as a real process from sources.
 */
import { readdir } from "node:fs/promises";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { findPids, readCmdline } from "../cloud-drivers/local/procs.ts";
import { parseLock, processGroupAlive, readLockText } from "../crunch-run/lock.ts";
import { lockFile, runnerPaths } from "../crunch-run/paths.ts";
import { type RunnerHarness, startRunnerHarness, supervisorLog } from "./crunch-run-harness.ts";
import { useTestDb } from "./db.ts";

describe("crunch-run (process runtime)", () => {
  const getDb = useTestDb("pglite");
  let h: RunnerHarness;
  beforeAll(async () => {
    h = await startRunnerHarness(getDb());
  });
  afterAll(async () => {
    await h?.close();
  });

  it("runs a command to ready: outputs, logs, lock and work dir gone, --list empty", async () => {
    const b = await h.newStartingBundle({
      command: [
        "sh",
        "-c",
        'echo "hello $GREETING" > "$DISPATCH_OUTPUT_DIR/greeting.txt"; echo to-stdout; echo to-stderr >&2',
      ],
      env: { GREETING: "world" },
    });
    const detached = await h.detach(b);
    expect(detached.code, detached.stderr).toBe(0);
    expect(JSON.parse(detached.stdout)).toMatchObject({ uuid: b.uuid, pid: expect.any(Number) });
    const final = await h.waitFinal(b.uuid);
    expect(final.state, await supervisorLog(h.root, b.uuid)).toBe("ready");
    expect(final.exitCode).toBe(0);
    expect(await h.output(b.uuid, "greeting.txt")).toEqual({ status: 200, body: "hello world\n" });
    expect(await h.log(b.uuid, "stdout")).toBe("to-stdout\n");
    const stderr = await h.log(b.uuid, "stderr");
    expect(stderr).toContain("to-stderr\n");
    expect(stderr).toContain("[crunch-run] runtime: process");
    // Tests run as root: the bundle gets a uid of its own, and the warning says what it still shares.
    expect(stderr).toContain("the bundle runs as a user of its own");
    expect(stderr).toContain("NO CONTAINER");
    // The supervisor cleans up after itself: no lock, no work dir; --list shows nothing.
    await waitFor(async () => (await h.listBundles()) === "");
    expect(await readdir(join(h.root, "tmp", "crunch-run")).catch(() => [])).toEqual([]);
    const log = await supervisorLog(h.root, b.uuid);
    expect(log).not.toContain(b.token);
    expect(log).toContain("finished");
  });

  it("hands the next bundle to a warm spare of the pool the previous --detach left behind", async () => {
    const first = await h.newStartingBundle({ command: ["true"] });
    expect((await h.detach(first)).code).toBe(0);
    expect((await h.waitFinal(first.uuid)).state).toBe("ready");
    let spares: number[] = [];
    await waitFor(async () => {
      spares = sparesOf(h.root);
      return spares.length >= 1;
    });
    const second = await h.newStartingBundle({
      command: ["sh", "-c", 'echo from-spare > "$DISPATCH_OUTPUT_DIR/x"'],
    });
    const detached = await h.detach(second);
    expect(detached.code, detached.stderr).toBe(0);
    const { pid } = JSON.parse(detached.stdout) as { pid: number };
    expect(spares).toContain(pid);
    expect((await h.waitFinal(second.uuid)).state).toBe("ready");
    expect(await h.output(second.uuid, "x")).toEqual({ status: 200, body: "from-spare\n" });
    const log = await supervisorLog(h.root, second.uuid);
    expect(log).toContain("finished");
    expect(log).not.toContain(second.token);
    // The pool starts another spare in its place.
    await waitFor(async () => sparesOf(h.root).some((p) => !spares.includes(p)));
  });

  it("fails the bundle, saying which, when a dependency cannot be staged", async () => {
    // A dependency that is not ready: the REST server has nothing to give (runner.dependency_unavailable).
    const dep = await h.newStartingBundle({ command: ["true"] });
    const b = await h.newStartingBundle({
      command: ["true"],
      dependencies: [{ bundle: dep.uuid, subpath: "", name: "input" }],
    });
    expect((await h.detach(b)).code).toBe(0);
    const final = await h.waitFinal(b.uuid);
    expect(final.state).toBe("failed");
    expect(final.stateReason).toContain(`dependency 0 (${dep.uuid}) could not be staged`);
    expect(await h.log(b.uuid, "stderr")).toContain("could not be staged");
  });

  it("fails with the exit code of a failing command", async () => {
    const b = await h.newStartingBundle({ command: ["sh", "-c", "echo bad >&2; exit 3"] });
    expect((await h.detach(b)).code).toBe(0);
    const final = await h.waitFinal(b.uuid);
    expect(final.state).toBe("failed");
    expect(final.exitCode).toBe(3);
    expect(await h.log(b.uuid, "stderr")).toContain("bad\n");
  });

  it("stops a command at its time limit and says why", async () => {
    const b = await h.newStartingBundle({
      command: ["sleep", "60"],
      limits: { time: 1000, disk: null, network: true },
    });
    expect((await h.detach(b)).code).toBe(0);
    const final = await h.waitFinal(b.uuid);
    expect(final.state).toBe("failed");
    expect(final.stateReason).toContain("time limit of 1s exceeded");
    expect(await h.log(b.uuid, "stderr")).toContain("[crunch-run] time limit of 1s exceeded");
  });

  it("stops a command at its disk limit", async () => {
    const b = await h.newStartingBundle({
      command: ["sh", "-c", 'head -c 3000000 /dev/zero > "$DISPATCH_OUTPUT_DIR/big"; sleep 60'],
      limits: { time: null, disk: 1024 * 1024, network: true },
    });
    expect((await h.detach(b)).code).toBe(0);
    const final = await h.waitFinal(b.uuid);
    expect(final.state).toBe("failed");
    expect(final.stateReason).toMatch(/disk limit of 1MiB exceeded: used 2\.9MiB/);
  });

  it("refuses a second --detach of a running bundle; --kill stops it without finishing", async () => {
    const b = await h.newStartingBundle({ command: ["sleep", "60"] });
    expect((await h.detach(b)).code).toBe(0);
    await h.waitState(b.uuid, ["running"]);
    const again = await h.detach(b);
    expect(again.code).toBe(1);
    expect(again.stderr).toContain("already running");
    expect(again.stderr).not.toContain(b.token);
    expect(await h.listBundles()).toContain(b.uuid);
    // The lock records the process group that runs the command.
    let pgid = 0;
    await waitFor(async () => {
      const ref = parseLock((await readLockText(lockFile(runnerPaths(h.env), b.uuid))) ?? "")?.container;
      pgid = ref?.runtime === "process" ? ref.pgid : 0;
      return pgid > 0;
    });
    expect(processGroupAlive(pgid)).toBe(true);
    let killed = await h.crunchRun(["--kill", "TERM", b.uuid]);
    for (let i = 0; i < 5 && killed.code !== 0; i++) killed = await h.crunchRun(["--kill", "15", b.uuid]);
    expect(killed.code).toBe(0);
    expect(await h.listBundles()).toBe("");
    expect(processGroupAlive(pgid)).toBe(false);
    // No finish: the bundle stays running for the dispatcher to sort out.
    expect((await h.waitState(b.uuid, ["running"])).state).toBe("running");
  });

  it("exits without touching anything when start is refused", async () => {
    const b = await h.newStartingBundle({ command: ["true"] });
    const detached = await h.detach({ ...b, token: `dcr_${"x".repeat(43)}` });
    expect(detached.code).toBe(0);
    await waitFor(async () => (await h.listBundles()) === "");
    expect(await supervisorLog(h.root, b.uuid)).toContain("runner start refused");
    expect((await h.waitState(b.uuid, ["starting"])).state).toBe("starting");
  });

  it("rejects a bad start document with the field's path and exit 2", async () => {
    const b = await h.newStartingBundle({ command: ["true"] });
    const res = await h.detach(b, { attempt: "one" });
    expect(res.code).toBe(2);
    expect(res.stderr).toContain("attempt");
    expect(res.stderr).toContain("crunchrun.invalid_start_document");
    const bad = await h.crunchRun(["--detach", "not-a-uuid"], "{}");
    expect(bad.code).toBe(2);
  });
});

async function waitFor(cond: () => Promise<boolean>, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error("condition not met in time");
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** Spare supervisors ready on the instance whose root is `root` (a spare takes this title once loaded). */
function sparesOf(root: string): number[] {
  return findPids({ env: ["DISPATCH_VM_ROOT", root] }).filter(
    (pid) => (readCmdline(pid) ?? []).join(" ") === "crunch-run spare",
  );
}
