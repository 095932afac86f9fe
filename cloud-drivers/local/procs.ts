/**
 * Finding and ending the processes of a local VM through /proc (Linux): by an environment variable they
 * inherited (DISPATCH_VM_ROOT), by mount namespace (an sshd's sessions), or by process group.
 */
import { execFileSync } from "node:child_process";
import { readdirSync, readFileSync, readlinkSync } from "node:fs";

/** State letter and process group of a process, from /proc/<pid>/stat; undefined if it is gone. */
function stat(pid: number): { state: string; pgrp: number } | undefined {
  try {
    const text = readFileSync(`/proc/${pid}/stat`, "utf8");
    const fields = text.slice(text.lastIndexOf(")") + 2).split(" ");
    return { state: fields[0] ?? "", pgrp: Number(fields[2]) };
  } catch {
    return undefined;
  }
}

/** A process's state letter (R, S, T for stopped, Z...), or undefined if it is gone. */
export function processState(pid: number): string | undefined {
  return stat(pid)?.state;
}

/** Whether a process (pid > 0) or any member of a process group (pid < 0) exists and is not a zombie. */
export function isAlive(pid: number): boolean {
  if (pid > 0) {
    const st = stat(pid);
    return st !== undefined && st.state !== "Z" && st.state !== "X";
  }
  return allPids().some((p) => {
    const st = stat(p);
    return st !== undefined && st.pgrp === -pid && st.state !== "Z" && st.state !== "X";
  });
}

/** The process's arguments, or undefined if it is gone. */
export function readCmdline(pid: number): string[] | undefined {
  try {
    const raw = readFileSync(`/proc/${pid}/cmdline`, "utf8");
    return raw.split("\0").filter((a) => a !== "");
  } catch {
    return undefined;
  }
}

/** The mount namespace's identity (`mnt:[4026531841]`), or undefined if the process is gone. */
export function mountNamespace(pid: number): string | undefined {
  try {
    return readlinkSync(`/proc/${pid}/ns/mnt`);
  } catch {
    return undefined;
  }
}

function allPids(): number[] {
  return readdirSync("/proc")
    .filter((name) => /^\d+$/.test(name))
    .map(Number)
    .filter((pid) => pid !== process.pid);
}

function hasEnv(pid: number, entry: Buffer): boolean {
  try {
    const environ = readFileSync(`/proc/${pid}/environ`);
    let start = 0;
    while (start < environ.length) {
      let end = environ.indexOf(0, start);
      if (end === -1) end = environ.length;
      if (end - start === entry.length && environ.subarray(start, end).equals(entry)) return true;
      start = end + 1;
    }
  } catch {
    // Gone, or not ours to read.
  }
  return false;
}

/**
 * Processes (other than this one) whose environment has name=value, or that live in mount namespace `ns`.
 * This process's own mount namespace never matches: a VM's namespace recorded wrongly (read before the unshare,
 * say) must not make a destroy end every process of the host.
 */
export function findPids(match: { env?: [string, string]; mountNs?: string }): number[] {
  const entry = match.env ? Buffer.from(`${match.env[0]}=${match.env[1]}`) : undefined;
  const ns =
    match.mountNs !== undefined && match.mountNs !== mountNamespace(process.pid) ? match.mountNs : undefined;
  return allPids().filter(
    (pid) => (entry !== undefined && hasEnv(pid, entry)) || (ns !== undefined && mountNamespace(pid) === ns),
  );
}

function signal(target: number, sig: NodeJS.Signals): void {
  try {
    process.kill(target, sig);
  } catch {
    // Already gone.
  }
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * Sends SIGTERM to each target (a pid, or a negative process-group id), waits up to graceMs for them to go,
 * then SIGKILLs what is left. Resolves when all are gone (or after a further second of trying).
 */
export async function terminate(targets: number[], graceMs: number): Promise<void> {
  const alive = () => targets.filter((t) => isAlive(t));
  for (const t of targets) signal(t, "SIGTERM");
  const deadline = Date.now() + graceMs;
  while (alive().length > 0 && Date.now() < deadline) await sleep(10);
  for (const t of alive()) signal(t, "SIGKILL");
  const hardDeadline = Date.now() + 1000;
  while (alive().length > 0 && Date.now() < hardDeadline) await sleep(10);
}

/** uid, gid and home of a local user, or undefined if there is no such user. */
export function lookupUser(user: string): { uid: number; gid: number; home: string } | undefined {
  try {
    const line = execFileSync("getent", ["passwd", user], { encoding: "utf8" }).trim();
    const fields = line.split(":");
    if (fields.length < 7) return undefined;
    return { uid: Number(fields[2]), gid: Number(fields[3]), home: fields[5] ?? "/" };
  } catch {
    return undefined;
  }
}
