/**
 * Counts the container runtime's start failures on this instance (crunchrun.runtime_failed: hooks, mounts,
 * cgroups, daemon errors), so that one failure only requeues its bundle while a run of them marks the instance
 * broken. The file `${ROOT}/var/lock/crunch-run-runtime-failures` holds one line per failure since the last
 * container that started; a successful start removes it. Supervisors of bundles packed on one instance append
 * to it concurrently (each line is one write in append mode, so lines never interleave); a start that removes it
 * while another supervisor appends may lose that one count, which only delays the verdict. The file is opened
 * without following a symbolic link: /var/lock may be writable by everyone, a process-runtime bundle included.
 */
import { closeSync, constants, mkdirSync, openSync, readFileSync, rmSync, writeSync } from "node:fs";
import type { RunnerPaths } from "./paths.ts";

/**
 * Failures in a row that make the instance mark itself broken. Two: a one-off (the CI run of issue 14) only
 * requeues its bundle, and a bundle with the default 3 attempts keeps at least one for another instance.
 */
export const RUNTIME_FAILURES_BEFORE_BROKEN = 2;

/** Records one failure; returns how many there have been in a row, this one included. */
export function recordRuntimeFailure(
  paths: RunnerPaths,
  uuid: string,
  reason: string,
  now = new Date(),
): number {
  mkdirSync(paths.lockDir, { recursive: true });
  const line = `${now.toISOString()} ${uuid} ${reason.replace(/\s+/g, " ").slice(0, 300)}\n`;
  const fd = openSync(
    paths.runtimeFailuresFile,
    constants.O_WRONLY | constants.O_APPEND | constants.O_CREAT | constants.O_NOFOLLOW,
    0o644,
  );
  try {
    writeSync(fd, line);
  } finally {
    closeSync(fd);
  }
  return countRuntimeFailures(paths);
}

/** Failures in a row so far (0 when there is no file). */
export function countRuntimeFailures(paths: RunnerPaths): number {
  let text: string;
  try {
    text = readFileSync(paths.runtimeFailuresFile, "utf8");
  } catch {
    return 0;
  }
  return text.split("\n").filter((l) => l !== "").length;
}

/** A container started: the run of failures is over. Never throws (the container runs whatever happens here). */
export function clearRuntimeFailures(paths: RunnerPaths): void {
  try {
    rmSync(paths.runtimeFailuresFile, { force: true });
  } catch {
    // not a file we can remove (something else took the name): the count only stays high
  }
}
