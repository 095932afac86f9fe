/**
 * Leases of the process runtime's uids: while a bundle runs as uid N, `${ROOT}/var/lock/crunch-run-uids/<N>`
 * holds its supervisor's {uuid, pid, startTime} (lock.ts's format, taken the same exclusive way). A uid is free
 * when it has no lease, or its lease's supervisor is dead or no longer holds that bundle's lock, and no process
 * runs as it (a dead supervisor's bundle may still run; a local VM sharing the machine may use the uid under
 * another root). Leases are handed out round robin from `next` (a new directory starts at a random place, so
 * local VMs sharing a machine seldom meet), and a uid comes back to a bundle only after the whole range went
 * round: files a bundle left in /tmp stay its uid's.
 *
 * The directory must be root's and closed to others (0700): /var/lock may be writable by everyone, and a
 * bundle that could make the directory itself could give two bundles one uid. When it is not, leasing fails
 * with crunchrun.runtime_failed (nothing runs as root instead).
 */
import { randomInt } from "node:crypto";
import { lstatSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { unlink } from "node:fs/promises";
import path from "node:path";
import {
  holderAlive,
  type LockInfo,
  parseLock,
  procStartTime,
  readLockText,
  removeDeadLock,
  tryCreateLock,
} from "./lock.ts";
import { runtimeFailed } from "./runtime.ts";

export interface UidRange {
  first: number;
  count: number;
}

export interface UidLease {
  readonly uid: number;
  /** Gives the uid back (only once no process runs as it). */
  release(): Promise<void>;
}

/**
 * Leases a free uid for bundle `uuid`. With `bundleLock` (the path of a bundle's supervisor lock, paths.lockFile),
 * a lease counts as held only while its supervisor still holds the lock of the lease's bundle: a supervisor goes
 * back to the warm pool after its bundle, so a lease it could not give back (something ran on as the uid) must
 * not stay taken for the rest of that process's life.
 */
export async function leaseUid(
  dir: string,
  range: UidRange,
  uuid: string,
  bundleLock?: (uuid: string) => string,
): Promise<UidLease> {
  openLeaseDir(dir);
  const stillHeld = async (held: LockInfo): Promise<boolean> => {
    if (!holderAlive(held)) return false;
    if (bundleLock === undefined) return true;
    const text = await readLockText(bundleLock(held.uuid)).catch(() => null);
    const lock = text === null ? null : parseLock(text);
    return lock !== null && lock.pid === held.pid && lock.startTime === held.startTime;
  };
  const info = { uuid, pid: process.pid, startTime: procStartTime(process.pid) ?? "" };
  const start = nextOffset(dir, range);
  for (let i = 0; i < range.count; i++) {
    const offset = (start + i) % range.count;
    const uid = range.first + offset;
    const file = path.join(dir, String(uid));
    if (!tryCreateLock(file, info)) {
      const text = await readLockText(file).catch(() => null);
      const held = text === null ? null : parseLock(text);
      if (text === null || (held !== null && (await stillHeld(held))) || uidPids(uid).length > 0) continue;
      // A lease of a dead supervisor, or of one that no longer supervises its bundle, with nothing left running
      // as the uid: take it over (unless someone just did).
      if (!(await removeDeadLock(file, text)) || !tryCreateLock(file, info)) continue;
    }
    if (uidPids(uid).length > 0) {
      // Free by the leases, yet something runs as it (another instance root on this machine): not this one.
      await unlink(file).catch(() => {});
      continue;
    }
    writeNext(dir, (offset + 1) % range.count);
    return {
      uid,
      async release() {
        const now = await readLockText(file).catch(() => null);
        if (now !== null && parseLock(now)?.pid === process.pid) await unlink(file).catch(() => {});
      },
    };
  }
  throw runtimeFailed(`all ${range.count} uids of the process runtime (from ${range.first}) are in use`);
}

/** Creates the lease directory (root's, 0700) and refuses one that anybody else could have made or changed. */
function openLeaseDir(dir: string): void {
  try {
    mkdirSync(path.dirname(dir), { recursive: true });
    mkdirSync(dir, { mode: 0o700 });
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== "EEXIST") {
      throw runtimeFailed(`cannot make the uid lease directory ${dir}: ${(err as Error).message}`, err);
    }
  }
  const st = lstatSync(dir);
  if (!st.isDirectory() || st.uid !== 0 || (st.mode & 0o077) !== 0) {
    throw runtimeFailed(
      `the uid lease directory ${dir} must be a directory of root's with mode 0700; it is not, so no uid is leased`,
    );
  }
}

/** Where the round robin goes on; a new directory starts at random, so instance roots sharing a machine differ. */
function nextOffset(dir: string, range: UidRange): number {
  try {
    const n = Number(readFileSync(path.join(dir, "next"), "utf8").trim());
    if (Number.isSafeInteger(n) && n >= 0) return n % range.count;
  } catch {
    // none yet
  }
  return randomInt(range.count);
}

function writeNext(dir: string, offset: number): void {
  try {
    writeFileSync(path.join(dir, "next"), `${offset}\n`, { mode: 0o600 });
  } catch {
    // only the round robin's starting point
  }
}

/**
 * Pids of the live (not zombie) processes whose real, effective, saved or filesystem uid is `uid`, from
 * /proc/<pid>/status (not the owner of /proc/<pid>, which a non-dumpable process shows as root).
 */
export function uidPids(uid: number): number[] {
  let names: string[];
  try {
    names = readdirSync("/proc").filter((n) => /^\d+$/.test(n));
  } catch {
    return [];
  }
  const pids: number[] = [];
  for (const name of names) {
    let status: string;
    try {
      status = readFileSync(`/proc/${name}/status`, "utf8");
    } catch {
      continue;
    }
    // A zombie runs nothing and takes no signal: it is gone but for its parent's wait.
    if (/^State:\s+[ZX]/m.test(status)) continue;
    const m = /^Uid:\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)/m.exec(status);
    if (m?.slice(1).some((u) => Number(u) === uid)) pids.push(Number(name));
  }
  return pids;
}

/**
 * SIGKILLs every process of the uid until none is left (one that forks meanwhile is caught in the next
 * round); gives up after ~2 s. Returns how many are left (0: all gone).
 */
export async function killUidProcesses(uid: number): Promise<number> {
  for (let round = 0; round < 100; round++) {
    const pids = uidPids(uid).filter((pid) => pid !== process.pid);
    if (pids.length === 0) return 0;
    for (const pid of pids) {
      try {
        process.kill(pid, "SIGKILL");
      } catch {
        // gone meanwhile
      }
    }
    await new Promise((r) => setTimeout(r, 20));
  }
  return uidPids(uid).length;
}

/** Leases present in the directory (for tests and diagnostics). */
export function leasedUids(dir: string): number[] {
  try {
    return readdirSync(dir)
      .filter((n) => /^\d+$/.test(n))
      .map(Number);
  } catch {
    return [];
  }
}
