import { type ChildProcess, spawn } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, afterEach, describe, expect, it } from "vitest";
import {
  holderAlive,
  type LockInfo,
  procStartTime,
  readLockText,
  removeDeadLock,
  tryCreateLock,
} from "./lock.ts";
import { listBundles, parseSignal, runCrunchRun } from "./main.ts";
import { lockFile, runnerPaths } from "./paths.ts";

const root = mkdtempSync(join(tmpdir(), "crunch-run-lock-"));
const env = { DISPATCH_VM_ROOT: root, DOCKER_HOST: `unix://${join(root, "no-docker.sock")}` };
const paths = runnerPaths(env);
mkdirSync(paths.lockDir, { recursive: true });
const children: ChildProcess[] = [];

let n = 0;
const uuid = () => `zzzzz-bndl-${String(++n).padStart(15, "0")}`;

/** A real process to hold a lock: `sleep`, or a shell that ignores SIGTERM. */
async function holder(opts: { ignoreTerm?: boolean; detached?: boolean } = {}): Promise<ChildProcess> {
  const child = opts.ignoreTerm
    ? spawn("sh", ["-c", "trap '' TERM; echo ready; while :; do sleep 0.1; done"], {
        stdio: ["ignore", "pipe", "ignore"],
        detached: opts.detached ?? false,
      })
    : spawn("sleep", ["60"], { stdio: ["ignore", "pipe", "ignore"], detached: opts.detached ?? false });
  children.push(child);
  if (opts.ignoreTerm) await new Promise((r) => child.stdout?.once("data", r));
  return child;
}
const infoOf = (id: string, child: ChildProcess): LockInfo => ({
  uuid: id,
  pid: child.pid as number,
  startTime: procStartTime(child.pid as number) as string,
});
const exited = (child: ChildProcess) =>
  child.exitCode !== null || child.signalCode !== null
    ? Promise.resolve()
    : new Promise<void>((r) => child.once("exit", () => r()));

async function crunchRun(args: string[]): Promise<{ code: number; out: string[]; err: string[] }> {
  const out: string[] = [];
  const err: string[] = [];
  const { Readable } = await import("node:stream");
  const code = await runCrunchRun(args, env, {
    stdin: Readable.from([]),
    out: (l) => out.push(l),
    err: (l) => err.push(l),
  });
  return { code, out, err };
}

afterEach(() => {
  rmSync(paths.lockDir, { recursive: true, force: true });
  mkdirSync(paths.lockDir, { recursive: true });
});
afterAll(() => {
  for (const c of children) {
    if (c.exitCode === null && c.signalCode === null) {
      try {
        process.kill(c.pid as number, "SIGKILL");
      } catch {
        // gone
      }
    }
  }
  rmSync(root, { recursive: true, force: true });
});

describe("lock files", () => {
  it("are exclusive: a second taker fails while the first holds it", async () => {
    const id = uuid();
    const file = lockFile(paths, id);
    const h = await holder();
    expect(tryCreateLock(file, infoOf(id, h))).toBe(true);
    expect(tryCreateLock(file, { uuid: id, pid: process.pid, startTime: "1" })).toBe(false);
    expect(JSON.parse((await readLockText(file)) as string)).toEqual(infoOf(id, h));
  });

  it("tell a live holder from a dead one and from a reused pid", async () => {
    const h = await holder();
    const info = infoOf("x", h);
    expect(holderAlive(info)).toBe(true);
    expect(holderAlive({ ...info, startTime: String(Number(info.startTime) - 1) })).toBe(false);
    h.kill("SIGKILL");
    await exited(h);
    expect(holderAlive(info)).toBe(false);
  });

  it("are not removed as dead when someone retook them after the judgement", async () => {
    const id = uuid();
    const file = lockFile(paths, id);
    const judged = JSON.stringify({ uuid: id, pid: 1, startTime: "0" });
    const h = await holder();
    expect(tryCreateLock(file, infoOf(id, h))).toBe(true);
    expect(await removeDeadLock(file, judged)).toBe(false);
    expect(JSON.parse((await readLockText(file)) as string)).toEqual(infoOf(id, h));
  });
});

describe("--list", () => {
  it("lists live holders, marks stale ones, deletes dead ones, and reports broken", async () => {
    const live = uuid();
    const liveHolder = await holder();
    tryCreateLock(lockFile(paths, live), infoOf(live, liveHolder));

    // Dead supervisor, but the bundle's process group still runs: stale, lock kept.
    const stale = uuid();
    const deadSupervisor = await holder();
    const group = await holder({ detached: true });
    const staleInfo = {
      ...infoOf(stale, deadSupervisor),
      container: { runtime: "process" as const, pgid: group.pid as number },
    };
    deadSupervisor.kill("SIGKILL");
    await exited(deadSupervisor);
    tryCreateLock(lockFile(paths, stale), staleInfo);

    // Dead supervisor and nothing runs (docker unreachable here): removed.
    const dead = uuid();
    const deadOne = await holder();
    const deadInfo = infoOf(dead, deadOne);
    deadOne.kill("SIGKILL");
    await exited(deadOne);
    tryCreateLock(lockFile(paths, dead), deadInfo);
    // A pid reused by another process (start time differs): also dead.
    const reused = uuid();
    tryCreateLock(lockFile(paths, reused), { uuid: reused, pid: process.pid, startTime: "1" });
    // Garbage in a lock file: dead.
    const garbage = uuid();
    writeFileSync(lockFile(paths, garbage), "not json");

    writeFileSync(paths.brokenFile, "docker daemon unreachable\n");
    const res = await crunchRun(["--list"]);
    expect(res.code).toBe(0);
    expect(res.out).toEqual(expect.arrayContaining([live, `${stale} stale`, "broken"]));
    expect(res.out).toHaveLength(3);
    expect(existsSync(lockFile(paths, stale))).toBe(true);
    expect(existsSync(lockFile(paths, dead))).toBe(false);
    expect(existsSync(lockFile(paths, reused))).toBe(false);
    expect(existsSync(lockFile(paths, garbage))).toBe(false);
    expect(await listBundles(paths, env)).toEqual(res.out);

    // --kill on the stale one signals the leftover process group; then the lock goes.
    expect((await crunchRun(["--kill", "TERM", stale])).code).toBe(0);
    await exited(group);
    expect(existsSync(lockFile(paths, stale))).toBe(false);
    expect((await crunchRun(["--kill", "KILL", live])).code).toBe(0);
    await exited(liveHolder);
  });

  it("prints nothing when there is nothing (no lock dir at all)", async () => {
    const out: string[] = [];
    expect(await listBundles(runnerPaths({ DISPATCH_VM_ROOT: join(root, "nowhere") }), env)).toEqual(out);
  });
});

describe("--kill", () => {
  it("exits 0 once the holder is gone, 1 if it survives the signal, 0 when there is nothing", async () => {
    const id = uuid();
    const h = await holder();
    tryCreateLock(lockFile(paths, id), infoOf(id, h));
    expect((await crunchRun(["--kill", "15", id])).code).toBe(0);
    await exited(h);
    expect(h.signalCode).toBe("SIGTERM");

    const stubborn = uuid();
    const s = await holder({ ignoreTerm: true });
    tryCreateLock(lockFile(paths, stubborn), infoOf(stubborn, s));
    const res = await crunchRun(["--kill", "SIGTERM", stubborn]);
    expect(res.code).toBe(1);
    expect(res.err.join("\n")).toContain("still running");
    expect((await crunchRun(["--kill", "KILL", stubborn])).code).toBe(0);

    expect((await crunchRun(["--kill", "TERM", uuid()])).code).toBe(0);
  });

  it("parses signals by number and name", () => {
    expect(parseSignal("15")).toBe("SIGTERM");
    expect(parseSignal("TERM")).toBe("SIGTERM");
    expect(parseSignal("sigint")).toBe("SIGINT");
    expect(parseSignal("9")).toBe("SIGKILL");
    expect(parseSignal("NOPE")).toBeNull();
    expect(parseSignal("999")).toBeNull();
  });
});

describe("usage", () => {
  it("answers --version, and exit 2 with usage for a bad command line", async () => {
    const v = await crunchRun(["--version"]);
    expect(v).toMatchObject({
      code: 0,
      out: [expect.stringMatching(/^crunch-run \(dispatch-cloud\) \d+\.\d+\.\d+/)],
    });
    expect((await crunchRun(["--bogus"])).code).toBe(2);
    expect((await crunchRun(["--detach", "zzzzz-bndl-short"])).code).toBe(2);
    expect((await crunchRun(["--kill", "TERM"])).code).toBe(2);
    expect((await crunchRun(["--kill", "NOPE", uuid()])).code).toBe(2);
    expect((await crunchRun(["--list", "extra"])).code).toBe(2);
  });

  it("--detach rejects an empty start document with exit 2 and takes no lock", async () => {
    const id = uuid();
    const res = await crunchRun(["--detach", id]);
    expect(res.code).toBe(2);
    expect(res.err.join("\n")).toContain("crunchrun.invalid_start_document");
    expect(existsSync(lockFile(paths, id))).toBe(false);
  });
});
