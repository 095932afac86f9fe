/**
 * A worker's upgrade: the server's runner artifact, checked against the sha256 the upgrade message and the
 * download's header announce, written beside the worker's own program file and renamed over it; then the new
 * program is started with the same arguments. Node 20 has no execve: the old process stays as the new one's
 * parent, with the terminal (stdio inherited), forwarding signals and exiting with its exit code.
 */
import { spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { chmod, rename, rm, writeFile } from "node:fs/promises";
import { constants } from "node:os";
import path from "node:path";
import { DispatchCloudError } from "../../lib/errors.ts";

/**
 * Checks a downloaded artifact against what the upgrade message and the response header said;
 * worker.artifact_mismatch when any of the three disagree (the worker then keeps its program).
 */
export function verifyArtifact(
  content: Buffer,
  expected: { sha256: string; bytes: number },
  headerSha256: string,
): string {
  const actual = createHash("sha256").update(content).digest("hex");
  if (actual !== expected.sha256 || headerSha256 !== expected.sha256 || content.length !== expected.bytes) {
    throw new DispatchCloudError(
      "worker.artifact_mismatch",
      `the downloaded artifact has sha256 ${actual} (${content.length} bytes); the server announced ` +
        `${expected.sha256} (${expected.bytes} bytes) and its header said ${headerSha256 || "nothing"}`,
    );
  }
  return actual;
}

/** Writes the new program beside `file` (mode 0755) and renames it over `file`, so no one sees half a file. */
export async function replaceProgram(file: string, content: Buffer): Promise<void> {
  const tmp = path.join(path.dirname(file), `.${path.basename(file)}.new-${process.pid}`);
  try {
    await writeFile(tmp, content, { mode: 0o755 });
    await chmod(tmp, 0o755);
    await rename(tmp, file);
  } catch (err) {
    await rm(tmp, { force: true });
    throw err;
  }
}

/**
 * Starts `file` (the replaced program) with `args` and the terminal, forwards SIGINT, SIGTERM and SIGHUP to
 * it, and resolves to its exit code (128 + signal number when a signal ended it).
 */
export function relaunch(file: string, args: string[]): Promise<number> {
  // A SEA executable is its own program; the .cjs artifact starts by its two-line launcher (it is executable).
  // In a process group of its own: a Ctrl-C at the terminal reaches this process alone, which passes it on once
  // (reaching both, the new program would count two: the second means "hand back").
  const child = spawn(file, args, { stdio: "inherit", detached: true });
  const forward = (signal: NodeJS.Signals) => () => {
    child.kill(signal);
  };
  const handlers = (["SIGINT", "SIGTERM", "SIGHUP"] as const).map((s) => [s, forward(s)] as const);
  for (const [s, h] of handlers) process.on(s, h);
  return new Promise((resolve) => {
    child.on("error", (err) => {
      process.stderr.write(`dispatch-cloud: cannot start the upgraded program ${file}: ${err.message}\n`);
      resolve(1);
    });
    child.on("exit", (code, signal) => {
      for (const [s, h] of handlers) process.off(s, h);
      resolve(code ?? 128 + (signal === null ? 0 : constants.signals[signal]));
    });
  });
}
