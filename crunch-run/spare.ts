/**
 * Warm spare supervisors. A Node process spends ~110 ms here before running any code (more for the one-file
 * artifact), and a supervisor started by each `--detach` puts that between the dispatcher's command and the
 * bundle's `start` call. So each `--detach`, once it has answered, leaves a spare behind: a supervisor process
 * that has loaded its modules and waits on a unix socket for one start document. The next `--detach` on the
 * instance hands its document to the spare (which answers with its pid and becomes that bundle's supervisor)
 * instead of starting a process, and leaves the next spare.
 *
 * - The socket is `${ROOT}/var/run/cr-spare-<hash>.sock`, the hash of the command that starts this
 *   runner, so a newly deployed runner never hands work to an old one's spare; mode 0600 (the document holds
 *   the runner token; only the instance's own user may connect).
 * - A spare holds no lock; `--list` prints `spare <socket>` while one waits. `--detach` takes the lock and
 *   writes the spare's pid into it, exactly as for a supervisor it starts itself. The dispatcher may also hand
 *   a start document to the spare straight over SSH (a streamlocal channel to the socket), skipping the
 *   `--detach` process altogether; the spare then takes the lock itself and starts the next spare.
 * - A spare exits after SPARE_IDLE_MS without work, or as soon as its socket file is gone (its VM root was
 *   removed). A second spare for the same socket exits at once; a dead spare's socket is replaced.
 * - Anything unexpected (no spare, a refused or slow hand-off, a path too long for a unix socket) falls back
 *   to starting a supervisor directly.
 */
import { spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { closeSync, existsSync, mkdirSync, openSync, unlinkSync } from "node:fs";
import net from "node:net";
import path from "node:path";
import {
  formatHandOff,
  parseHandOff,
  parsePidAnswer,
  pidAnswer,
  refusedAnswer,
  type SpareHandOff,
} from "../lib/runner-protocol.ts";
import type { RunnerPaths } from "./paths.ts";

export const SPARE_IDLE_MS = 10 * 60_000;
const HAND_OFF_TIMEOUT_MS = 1000;
/** sun_path holds 108 bytes with its NUL (so a local VM's root may be up to 74 bytes long for spares). */
const MAX_SOCKET_PATH = 107;

/** The spare socket of the runner started by `command`, or null when the path is too long for a socket. */
export function spareSocketPath(paths: RunnerPaths, command: readonly string[]): string | null {
  const hash = createHash("sha256").update(command.join("\0")).digest("hex").slice(0, 10);
  const file = `${paths.root}/var/run/cr-spare-${hash}.sock`;
  return Buffer.byteLength(file) <= MAX_SOCKET_PATH ? file : null;
}

/**
 * Hands a start document to the waiting spare; resolves to the pid of the process that is now the bundle's
 * supervisor, or null when there is no spare or it did not take the document.
 */
export function handToSpare(socketPath: string, uuid: string, doc: string): Promise<number | null> {
  return new Promise((resolve) => {
    let answer = "";
    let settled = false;
    const done = (pid: number | null) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      sock.destroy();
      resolve(pid);
    };
    const sock = net.connect(socketPath);
    const timer = setTimeout(() => done(null), HAND_OFF_TIMEOUT_MS);
    sock.setEncoding("utf8");
    sock.on("error", () => done(null));
    sock.on("connect", () => sock.end(formatHandOff({ mode: "detach", uuid, doc })));
    sock.on("data", (chunk: string) => {
      answer += chunk;
    });
    sock.on("end", () => done(parsePidAnswer(answer)));
  });
}

/** Starts the next spare in its own session, writing to the spare log; does not wait for it. */
export function startSpare(paths: RunnerPaths, command: readonly string[], env: NodeJS.ProcessEnv): void {
  try {
    mkdirSync(paths.logDir, { recursive: true });
    const out = openSync(path.join(paths.logDir, "spare.log"), "a");
    try {
      const [cmd, ...args] = command;
      const child = spawn(cmd as string, [...args, "--spare"], {
        detached: true,
        stdio: ["ignore", out, out],
        env,
      });
      child.on("error", () => {});
      child.unref();
    } finally {
      closeSync(out);
    }
  } catch {
    // No spare: the next --detach starts its supervisor itself.
  }
}

/** A hand-off the spare took (lib/runner-protocol.ts). */
export type SpareWork = SpareHandOff;

/**
 * The spare's wait: listens on the socket until a hand-off arrives that `accept` takes (it resolves to null,
 * or to why it refuses), answers `pid <pid>` (or `refused <why>`), and resolves to the work; null means
 * exit (idle too long, or the socket file is gone).
 */
export async function waitForWork(
  socketPath: string,
  accept: (work: SpareWork) => Promise<string | null>,
  idleMs = SPARE_IDLE_MS,
): Promise<SpareWork | null> {
  mkdirSync(path.dirname(socketPath), { recursive: true });
  const server = net.createServer({ allowHalfOpen: true });
  if (!(await listen(server, socketPath))) return null;
  return new Promise((resolve) => {
    let finished = false;
    let busy = false;
    const finish = (work: SpareWork | null) => {
      if (finished) return;
      finished = true;
      clearTimeout(idle);
      clearInterval(watch);
      server.close();
      // Unlink at once so that the next --detach finds no socket rather than a closed one.
      try {
        unlinkSync(socketPath);
      } catch {
        // Already gone.
      }
      resolve(work);
    };
    const idle = setTimeout(() => finish(null), idleMs);
    const watch = setInterval(() => {
      if (!existsSync(socketPath)) finish(null);
    }, 2000);
    watch.unref();
    server.on("connection", (sock) => {
      let text = "";
      sock.setEncoding("utf8");
      sock.on("error", () => {});
      sock.on("data", (chunk: string) => {
        text += chunk;
        if (text.length > 128 * 1024) sock.destroy();
      });
      sock.on("end", () => {
        const work = parseHandOff(text);
        if (finished || busy || work === null) {
          sock.end(refusedAnswer(work === null ? "not a hand-off" : "busy"));
          return;
        }
        busy = true;
        accept(work).then(
          (refusal) => {
            busy = false;
            if (refusal !== null) {
              sock.end(refusedAnswer(refusal));
              return;
            }
            sock.end(pidAnswer(process.pid));
            finish(work);
          },
          (err: unknown) => {
            busy = false;
            sock.end(refusedAnswer(String(err)));
          },
        );
      });
    });
  });
}

/** Listens on the socket; false when another live spare has it. A dead spare's socket file is replaced. */
async function listen(server: net.Server, socketPath: string): Promise<boolean> {
  for (let attempt = 0; attempt < 2; attempt++) {
    const err = await new Promise<NodeJS.ErrnoException | null>((resolve) => {
      server.once("error", resolve);
      server.listen({ path: socketPath, readableAll: false, writableAll: false }, () => resolve(null));
    });
    if (err === null) return true;
    if (err.code !== "EADDRINUSE") return false;
    const alive = await new Promise<boolean>((resolve) => {
      const probe = net.connect(socketPath);
      probe.on("connect", () => {
        probe.destroy();
        resolve(true);
      });
      probe.on("error", () => resolve(false));
    });
    if (alive) return false;
    try {
      unlinkSync(socketPath);
    } catch {
      return false;
    }
  }
  return false;
}
