/**
 * Per-bundle lock files, without flock (Node has none).
 *
 * The lock is `${ROOT}/var/lock/crunch-run-<uuid>.lock`, holding JSON {uuid, pid, startTime, container?}:
 * the supervisor's pid and its start time (field 22 of /proc/<pid>/stat, in clock ticks since boot), so a
 * reused pid is not taken for the holder. `container` says what runs the bundle once it has started (the
 * docker container's name, or the process runtime's process group), for telling "stale" from "dead".
 *
 * - Taking: the content is written to a private temporary file which is then hard-linked to the lock name.
 *   link(2) fails with EEXIST if the lock exists, so creation is exclusive (like O_EXCL) and a lock file is
 *   never seen half-written. `--detach` takes the lock in its own name, spawns the supervisor, then replaces
 *   the content (write a temporary file + rename, atomic) with the supervisor's pid and start time.
 * - Holder alive: /proc/<pid>/stat exists, is not a zombie, and its start time equals the recorded one.
 * - Stale: the holder is dead but the bundle's container (docker label dispatch-cloud.bundle=<uuid> with this
 *   instance root) or process group still runs. The lock is kept, `--list` prints `<uuid> stale`.
 * - Dead: the holder is dead and nothing of the bundle runs. The lock is removed (and may be retaken).
 *   Removal renames the lock to a private name first and checks that what it moved is the content it judged
 *   dead; if another process replaced the lock in between (it took the lock anew), the live lock is linked
 *   back. Two removers racing over one dead lock thus never delete a lock someone has just taken.
 * - Release: the supervisor deletes the lock at exit if it still names its own pid.
 */
import { randomBytes } from "node:crypto";
import { linkSync, readFileSync, unlinkSync, writeFileSync } from "node:fs";
import { link, readFile, rename, unlink, writeFile } from "node:fs/promises";

export type ContainerRef = { runtime: "docker"; name: string } | { runtime: "process"; pgid: number };

export interface LockInfo {
  uuid: string;
  pid: number;
  startTime: string;
  container?: ContainerRef;
}

/** Field 22 (start time) of /proc/<pid>/stat, or null when the process is gone or a zombie. */
export function procStartTime(pid: number): string | null {
  let stat: string;
  try {
    stat = readFileSync(`/proc/${pid}/stat`, "utf8");
  } catch {
    return null;
  }
  // The command name (field 2) is in parentheses and may hold spaces: split after its closing one.
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  // fields[0] is field 3 (state); field 22 is fields[19].
  const state = fields[0];
  if (state === "Z" || state === "X") return null;
  return fields[19] ?? null;
}

export function holderAlive(info: LockInfo): boolean {
  return procStartTime(info.pid) === info.startTime;
}

export function parseLock(text: string): LockInfo | null {
  try {
    const v = JSON.parse(text) as Partial<LockInfo>;
    if (typeof v.uuid !== "string" || typeof v.pid !== "number" || typeof v.startTime !== "string")
      return null;
    return v as LockInfo;
  } catch {
    return null;
  }
}

/** The lock's raw text, or null if there is none. */
export async function readLockText(file: string): Promise<string | null> {
  try {
    return await readFile(file, "utf8");
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") return null;
    throw err;
  }
}

const tmpName = (file: string, tag: string) =>
  `${file}.${process.pid}.${randomBytes(4).toString("hex")}.${tag}`;

/**
 * Takes the lock with this content; false if a lock file exists already. Synchronous on purpose: it is on a
 * warm start's path, where three trips through libuv's thread pool cost 2-4 ms on a busy 2-core machine and
 * the calls themselves (a small file on a local disk) take microseconds.
 */
export function tryCreateLock(file: string, info: LockInfo): boolean {
  const tmp = tmpName(file, "tmp");
  writeFileSync(tmp, JSON.stringify(info), { mode: 0o644 });
  try {
    linkSync(tmp, file);
    return true;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "EEXIST") return false;
    throw err;
  } finally {
    try {
      unlinkSync(tmp);
    } catch {
      // Gone already.
    }
  }
}

/** Replaces the content of a lock this process holds (atomic). */
export async function replaceLock(file: string, info: LockInfo): Promise<void> {
  const tmp = tmpName(file, "tmp");
  await writeFile(tmp, JSON.stringify(info), { mode: 0o644 });
  await rename(tmp, file);
}

/**
 * Removes a lock judged dead, given the exact text it was judged on. Returns false (and leaves any new lock
 * in place) when the lock changed in between.
 */
export async function removeDeadLock(file: string, judged: string): Promise<boolean> {
  const moved = tmpName(file, "dead");
  try {
    await rename(file, moved);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") return true;
    throw err;
  }
  const text = await readFile(moved, "utf8").catch(() => null);
  if (text === judged) {
    await unlink(moved).catch(() => {});
    return true;
  }
  // We moved a lock someone took after our judgement: put it back (unless yet another one exists).
  await link(moved, file).catch(() => {});
  await unlink(moved).catch(() => {});
  return false;
}

/** Deletes the lock if it still names pid. */
export async function releaseLock(file: string, pid: number): Promise<void> {
  const text = await readLockText(file).catch(() => null);
  if (text === null) return;
  if (parseLock(text)?.pid === pid) await unlink(file).catch(() => {});
}

/** True when the process group still has a member. */
export function processGroupAlive(pgid: number): boolean {
  try {
    process.kill(-pgid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}
