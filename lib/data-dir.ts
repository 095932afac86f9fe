/**
 * The data directory `serve` keeps its state in (admin and management tokens, the dispatcher's SSH key, the
 * PGlite database, outputs, local VMs): private to the service user, and used by one `serve` at a time.
 *
 * Privacy: the directory is made (or tightened to) mode 0700 before anything is written into it, so nothing
 * under it is reachable by another local user whatever its own mode; files of ours get explicit modes too
 * (`makeTreePrivate` for the PGlite directory, whose bundled files arrive world-writable).
 *
 * One process per directory: the holder binds a unix socket named after the directory's real path: on Linux in
 * the abstract namespace (the kernel releases it when the process dies, so a stale lock cannot exist); elsewhere
 * `<dataDir>/serve.sock`, which a later process takes over when nothing answers on it. A second process finds
 * the name taken, asks the holder who it is (it answers one JSON line: pid, command, start time) and exits
 * with `serve.data_dir_in_use`, before it opens the database.
 */
import { createHash } from "node:crypto";
import { chmod, lstat, mkdir, opendir, realpath, stat, unlink } from "node:fs/promises";
import net from "node:net";
import path from "node:path";
import { DispatchCloudError } from "./errors.ts";
import type { Logger } from "./logger.ts";

/** Creates `dir` (mode 0700) or tightens an existing one to 0700; returns its real path. */
export async function preparePrivateDir(dir: string, logger?: Logger): Promise<string> {
  const abs = path.resolve(dir);
  await mkdir(abs, { recursive: true, mode: 0o700 });
  const st = await stat(abs);
  if ((st.mode & 0o077) !== 0) {
    await chmod(abs, 0o700);
    logger?.warn(
      { dataDir: abs, was: (st.mode & 0o777).toString(8) },
      "the data directory was readable by others; it is now private (0700): it holds tokens and the database",
    );
  }
  return realpath(abs);
}

/**
 * Removes group and other permissions from every file and directory under `dir` (symlinks are not followed and
 * left alone). Returns how many entries were changed.
 */
export async function makeTreePrivate(dir: string): Promise<number> {
  let changed = 0;
  const visit = async (p: string): Promise<void> => {
    const st = await lstat(p).catch(() => null);
    if (st === null || st.isSymbolicLink()) return;
    if ((st.mode & 0o077) !== 0) {
      await chmod(p, st.mode & 0o700).catch(() => {});
      changed++;
    }
    if (!st.isDirectory()) return;
    const entries = await opendir(p).catch(() => null);
    if (entries === null) return;
    for await (const e of entries) await visit(path.join(p, e.name));
  };
  await visit(dir);
  return changed;
}

/** What a holder tells a process that asks (one JSON line). */
export interface DataDirHolder {
  pid: number;
  command: string;
  startedAt: string;
}

export interface DataDirLock {
  readonly dataDir: string;
  release(): Promise<void>;
}

/** The socket name for a data directory (its real path): abstract on Linux, a file in it elsewhere. */
export function lockSocketPath(realDataDir: string, platform: NodeJS.Platform = process.platform): string {
  if (platform === "linux") {
    const hash = createHash("sha256").update(realDataDir).digest("hex").slice(0, 32);
    return `\0dispatch-cloud-data-dir:${hash}`;
  }
  return path.join(realDataDir, "serve.sock");
}

function listen(server: net.Server, socketPath: string): Promise<NodeJS.ErrnoException | null> {
  return new Promise((resolve) => {
    const onError = (err: NodeJS.ErrnoException) => resolve(err);
    server.once("error", onError);
    server.listen({ path: socketPath, exclusive: true }, () => {
      server.off("error", onError);
      resolve(null);
    });
  });
}

/** Asks the holder of `socketPath` who it is; null when nothing answers (ECONNREFUSED: a stale socket file). */
function askHolder(socketPath: string): Promise<DataDirHolder | "unknown" | null> {
  return new Promise((resolve) => {
    const socket = net.connect({ path: socketPath });
    let text = "";
    const timer = setTimeout(() => {
      socket.destroy();
      resolve("unknown");
    }, 2000);
    socket.on("data", (d: Buffer) => {
      text += d.toString("utf8");
    });
    socket.on("end", () => {
      clearTimeout(timer);
      try {
        const h = JSON.parse(text) as DataDirHolder;
        resolve(typeof h.pid === "number" ? h : "unknown");
      } catch {
        resolve("unknown");
      }
    });
    socket.on("error", (err: NodeJS.ErrnoException) => {
      clearTimeout(timer);
      resolve(err.code === "ECONNREFUSED" || err.code === "ENOENT" ? null : "unknown");
    });
  });
}

function inUse(dataDir: string, holder: DataDirHolder | "unknown"): DispatchCloudError {
  const who =
    holder === "unknown"
      ? "another process"
      : `another dispatch-cloud ${holder.command} (pid ${holder.pid}, started ${holder.startedAt})`;
  const stop =
    holder === "unknown" ? "stop it first" : `stop it first (Ctrl-C in its terminal, or kill ${holder.pid})`;
  return new DispatchCloudError(
    "serve.data_dir_in_use",
    `the data directory ${dataDir} is in use by ${who}; ${stop}, or give this one another dataDir`,
    { path: "dataDir" },
  );
}

/**
 * Takes the data directory (already prepared: its real path) for this process, or throws
 * serve.data_dir_in_use naming the holder. The lock lasts until release() or the process's end.
 */
export async function lockDataDir(
  realDataDir: string,
  opts: { command: string; platform?: NodeJS.Platform },
): Promise<DataDirLock> {
  const socketPath = lockSocketPath(realDataDir, opts.platform);
  const me: DataDirHolder = { pid: process.pid, command: opts.command, startedAt: new Date().toISOString() };
  const server = net.createServer((socket) => {
    socket.on("error", () => {});
    socket.end(`${JSON.stringify(me)}\n`);
  });
  for (let attempt = 0; ; attempt++) {
    const err = await listen(server, socketPath);
    if (err === null) break;
    if (err.code !== "EADDRINUSE") {
      throw new DispatchCloudError(
        "serve.data_dir_in_use",
        `cannot lock the data directory ${realDataDir}: ${err.code ?? err.message}`,
        { path: "dataDir", cause: err },
      );
    }
    const holder = await askHolder(socketPath);
    // A socket file nobody answers on was left by a process that died: take it over (once).
    if (holder === null && !socketPath.startsWith("\0") && attempt === 0) {
      await unlink(socketPath).catch(() => {});
      continue;
    }
    throw inUse(realDataDir, holder ?? "unknown");
  }
  server.unref();
  return {
    dataDir: realDataDir,
    release: () =>
      new Promise<void>((resolve) => {
        server.close(() => resolve());
      }),
  };
}
