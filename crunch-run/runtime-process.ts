/**
 * The process runtime: no container. The bundle's command runs as a child process of the supervisor (no
 * shell), in its own process group, with cwd and DISPATCH_OUTPUT_DIR the host's out/ directory and
 * DISPATCH_INPUT_DIR the host's in/ directory. The image is not used, the memory limit and the CPU count are not
 * enforced, the network is not cut off. For trying dispatch-cloud on a machine without Docker.
 *
 * Who the command runs as (planIsolation, said in the bundle's stderr either way):
 * - The supervisor is root, the uid range is mapped in this user namespace and the work root is reachable by
 *   other users: the command gets a uid of its own (gid the same number, no supplementary groups), leased from
 *   the configured range for as long as it runs (uid-lease.ts). It cannot read the supervisor's memory or
 *   environment (/proc/<pid>/mem needs the same uid or CAP_SYS_PTRACE; Node cannot make the supervisor
 *   non-dumpable, so the uid difference is the whole guard), signal it, or enter another bundle's work dir. The
 *   work dir is root:<gid> 0710, out/ is the bundle's own, in/ is root:<gid> 0750 (read-only to it). When the
 *   command ends, every process of its uid is killed (a process that left the group does not escape), the
 *   work dir is closed (root:root 0700) and the lease is given back.
 * - Otherwise (not root; or root but the range is not mapped or the work dir is out of other users' reach):
 *   the command runs as the supervisor's own user, and the warning says what that leaves open.
 */
import { spawn } from "node:child_process";
import { readdirSync, readFileSync, statSync } from "node:fs";
import { chmod, chown } from "node:fs/promises";
import { constants as osConstants } from "node:os";
import path from "node:path";
import { PassThrough } from "node:stream";
import { processGroupAlive } from "./lock.ts";
import {
  type ContainerConfig,
  type ContainerExit,
  type ContainerRuntime,
  classifySpawnFailure,
  containerEnv,
  type RunningContainer,
  runtimeFailed,
} from "./runtime.ts";
import { killUidProcesses, leaseUid, type UidLease, type UidRange, uidPids } from "./uid-lease.ts";

const CLOCK_TICKS = 100; // USER_HZ on Linux
const PAGE_SIZE = 4096;

export interface ProcessRuntimeOptions {
  /** The uids (and gids: the same numbers) bundles get while they run, when the supervisor is root. */
  uids: UidRange;
  /** `${ROOT}/tmp/crunch-run`: every directory down to it must be enterable by other users. */
  workRoot: string;
  /** Where the uid leases are (paths.uidLeaseDir). */
  uidLeaseDir: string;
  /** The path of a bundle's supervisor lock (paths.lockFile): a lease is held while its supervisor holds it. */
  bundleLock?: (uuid: string) => string;
  /** What planIsolation decides on; default: this process's. */
  facts?: IsolationFacts;
}

/** What decides who the command runs as. */
export interface IsolationFacts {
  /** The supervisor's uid. */
  uid: number;
  /** /proc/self/uid_map and gid_map (null when unreadable). */
  uidMap: string | null;
  gidMap: string | null;
  /** The first directory on the way to the work root that other users cannot enter, or null. */
  closedDir: string | null;
}

export type IsolationPlan =
  | { kind: "own-uid"; uids: UidRange }
  | { kind: "same-user"; uid: number; why: string | null };

/** Reads the facts of this process and machine. */
export function isolationFacts(workRoot: string): IsolationFacts {
  const read = (f: string) => {
    try {
      return readFileSync(f, "utf8");
    } catch {
      return null;
    }
  };
  return {
    uid: process.getuid?.() ?? -1,
    uidMap: read("/proc/self/uid_map"),
    gidMap: read("/proc/self/gid_map"),
    closedDir: closedDirOnTheWay(workRoot),
  };
}

/** The first of `/`, each ancestor and dir itself that others may not enter (no o+x), or null. */
export function closedDirOnTheWay(dir: string): string | null {
  const abs = path.resolve(dir);
  const parts = abs.split("/").filter((p) => p !== "");
  let cur = "/";
  for (let i = 0; i <= parts.length; i++) {
    try {
      if ((statSync(cur).mode & 0o001) === 0) return cur;
    } catch {
      return cur;
    }
    if (i < parts.length) cur = path.join(cur, parts[i] ?? "");
  }
  return null;
}

/** True when every id of the range is mapped in a `/proc/self/{uid,gid}_map` text. */
export function rangeMapped(map: string | null, range: UidRange): boolean {
  if (map === null) return false;
  const last = range.first + range.count - 1;
  return map.split("\n").some((line) => {
    const [inside, , length] = line.trim().split(/\s+/).map(Number);
    if (inside === undefined || length === undefined || Number.isNaN(inside) || Number.isNaN(length)) {
      return false;
    }
    return range.first >= inside && last < inside + length;
  });
}

/** Who the command runs as, and why not as a uid of its own when it cannot. */
export function planIsolation(facts: IsolationFacts, uids: UidRange): IsolationPlan {
  if (facts.uid !== 0) return { kind: "same-user", uid: facts.uid, why: null };
  const last = uids.first + uids.count - 1;
  if (!rangeMapped(facts.uidMap, uids) || !rangeMapped(facts.gidMap, uids)) {
    return {
      kind: "same-user",
      uid: 0,
      why: `the uids ${uids.first}-${last} are not mapped in this user namespace (/proc/self/uid_map, gid_map)`,
    };
  }
  if (facts.closedDir !== null) {
    return {
      kind: "same-user",
      uid: 0,
      why: `other users cannot enter ${facts.closedDir} (it needs o+x), on the way to the bundles' work dirs`,
    };
  }
  return { kind: "own-uid", uids };
}

const NOT_ENFORCED =
  "its image is not used and its memory limit, CPU count and network setting are not enforced";

/** The sentence for the bundle's stderr: what the plan isolates, and what it leaves open. */
export function isolationWarning(plan: IsolationPlan): string {
  if (plan.kind === "own-uid") {
    const last = plan.uids.first + plan.uids.count - 1;
    return (
      `process runtime: the bundle runs as a user of its own (a uid and gid from ${plan.uids.first}-${last}, not ` +
      "the runner's): it cannot read the runner's memory or its token, signal it, or enter other bundles' work " +
      "dirs. Still NO CONTAINER: it sees the files everyone may read on this instance, its processes and its " +
      `network (the cloud's metadata service included); ${NOT_ENFORCED}`
    );
  }
  if (plan.uid === 0) {
    return (
      `process runtime: NO ISOLATION — the bundle runs as root, the runner's own user, because ${plan.why}: it ` +
      "controls this instance, can read the runner's memory and in it this attempt's runner token, and can read " +
      `or change every other bundle on it; ${NOT_ENFORCED}`
    );
  }
  return (
    `process runtime: NO ISOLATION — the runner is not root, so the bundle runs as the runner's own user (uid ` +
    `${plan.uid}): it can read the runner's memory (/proc/<pid>/mem) and in it this attempt's runner token, good ` +
    "for this bundle's logs, outputs and outcome until the attempt ends; it can signal the runner and read or " +
    `change all the runner's user can, other bundles' work dirs on this instance included; ${NOT_ENFORCED}`
  );
}

export function createProcessRuntime(opts: ProcessRuntimeOptions): ContainerRuntime {
  const plan = planIsolation(opts.facts ?? isolationFacts(opts.workRoot), opts.uids);
  return {
    name: "process",
    warnings: [isolationWarning(plan)],
    async prepare() {},
    async start(config: ContainerConfig): Promise<RunningContainer> {
      const lease =
        plan.kind === "own-uid"
          ? await leaseUid(opts.uidLeaseDir, plan.uids, config.uuid, opts.bundleLock)
          : null;
      try {
        if (lease !== null) await handOver(config, lease.uid);
        return await spawnCommand(config, lease);
      } catch (err) {
        if (lease !== null) await closeWorkDir(config).catch(() => {});
        await lease?.release();
        throw err;
      }
    },
  };
}

/** The work dir root:<gid> 0710, out/ the bundle's own (0700), in/ root:<gid> 0750. */
async function handOver(config: ContainerConfig, uid: number): Promise<void> {
  const dir = path.dirname(config.outDir);
  try {
    await chown(dir, 0, uid);
    await chmod(dir, 0o710);
    await chown(config.outDir, uid, uid);
    await chmod(config.outDir, 0o700);
    await chown(config.inDir, 0, uid);
    await chmod(config.inDir, 0o750);
  } catch (err) {
    throw runtimeFailed(`cannot give the work dir to uid ${uid}: ${(err as Error).message}`, err);
  }
}

/** After the command: nobody but root enters the work dir (its uid may go to another bundle next). */
async function closeWorkDir(config: ContainerConfig): Promise<void> {
  const dir = path.dirname(config.outDir);
  await chown(dir, 0, 0);
  await chmod(dir, 0o700);
}

async function spawnCommand(config: ContainerConfig, lease: UidLease | null): Promise<RunningContainer> {
  const [cmd, ...args] = config.spec.command;
  const command = cmd ?? "";
  const env = containerEnv(config.spec, config.outDir, config.inDir);
  const stdout = new PassThrough();
  const stderr = new PassThrough();
  const child = spawn(command, args, {
    cwd: config.outDir,
    env,
    detached: true,
    stdio: ["ignore", "pipe", "pipe"],
    ...(lease === null ? {} : { uid: lease.uid, gid: lease.uid }),
  });
  // Node reports a command that cannot be executed after spawn() returns: wait for one or the other.
  await new Promise<void>((resolve, reject) => {
    const onError = (err: Error) => {
      child.off("spawn", onSpawn);
      reject(classifySpawnFailure(err as NodeJS.ErrnoException, command));
    };
    const onSpawn = () => {
      child.off("error", onError);
      resolve();
    };
    child.once("error", onError);
    child.once("spawn", onSpawn);
  });
  const exited = new Promise<ContainerExit>((resolve) => {
    child.once("exit", (code, signal) => {
      const signo = signal === null ? 0 : ((osConstants.signals as Record<string, number>)[signal] ?? 0);
      resolve({ exitCode: code ?? 128 + signo, oomKilled: false });
    });
  });
  child.stdout?.pipe(stdout);
  child.stderr?.pipe(stderr);
  const pgid = child.pid ?? 0;
  const uid = lease?.uid ?? null;
  const kill = (signal: NodeJS.Signals) => {
    if (pgid > 0 && processGroupAlive(pgid)) {
      try {
        process.kill(-pgid, signal);
      } catch {
        // gone meanwhile
      }
    }
  };
  const alive = () => (pgid > 0 && processGroupAlive(pgid)) || (uid !== null && uidPids(uid).length > 0);
  let released = false;
  return {
    ref: { runtime: "process", pgid },
    stdout,
    stderr,
    wait: () => exited,
    async stats() {
      const u = usageOf(uid === null ? groupPids(pgid) : uidPids(uid));
      return { cpuSeconds: u.cpuSeconds, memoryBytes: u.memoryBytes, maxMemoryBytes: u.memoryBytes };
    },
    writableLayerBytes: async () => 0,
    async stop(graceSeconds: number) {
      const gone = async (ms: number) => {
        const deadline = Date.now() + ms;
        while (Date.now() < deadline && alive()) {
          await new Promise((r) => setTimeout(r, 50));
        }
      };
      kill("SIGTERM");
      await gone(graceSeconds * 1000);
      kill("SIGKILL");
      if (uid !== null) await killUidProcesses(uid);
      // Returns once the group is gone (a SIGKILLed process still takes a moment to exit).
      await gone(2000);
    },
    async remove() {
      kill("SIGKILL");
      // Children that outlive the leader may hold the pipes open; don't wait for them.
      child.stdout?.destroy();
      child.stderr?.destroy();
      if (lease === null || released) return;
      // Every process of the uid, whatever its group; the lease goes back only once none is left.
      const left = await killUidProcesses(lease.uid);
      await closeWorkDir(config).catch(() => {});
      if (left === 0) {
        released = true;
        await lease.release();
      }
    },
  };
}

function procPids(): string[] {
  try {
    return readdirSync("/proc").filter((n) => /^\d+$/.test(n));
  } catch {
    return [];
  }
}

/** Fields after the command name of /proc/<pid>/stat (f[0] is field 3), or null when gone. */
function statFields(pid: string | number): string[] | null {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    return stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  } catch {
    return null;
  }
}

/** Pids of the processes of a process group. */
function groupPids(pgid: number): number[] {
  return procPids()
    .filter((pid) => Number(statFields(pid)?.[2]) === pgid)
    .map(Number);
}

/** CPU seconds and resident memory of these processes, from /proc. */
function usageOf(pids: number[]): { cpuSeconds: number; memoryBytes: number } {
  let ticks = 0;
  let pages = 0;
  for (const pid of pids) {
    const f = statFields(pid);
    if (f === null) continue;
    // Field 14 utime f[11], 15 stime f[12], 24 rss f[21].
    ticks += Number(f[11] ?? 0) + Number(f[12] ?? 0);
    pages += Number(f[21] ?? 0);
  }
  return { cpuSeconds: ticks / CLOCK_TICKS, memoryBytes: pages * PAGE_SIZE };
}

/** CPU seconds and resident memory of every process in the group, from /proc. */
export function groupUsage(pgid: number): { cpuSeconds: number; memoryBytes: number } {
  return usageOf(groupPids(pgid));
}
