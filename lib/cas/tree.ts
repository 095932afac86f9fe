/**
 * The manifest of a local directory (docs/storage.md): lib/tar.ts's `scanTree` lists it without following any
 * link (links kept when they stay inside, anything else refused, errors naming paths as the container saw them),
 * then every file is hashed through a no-follow open whose inode must be the one scanned, a few files at once.
 */
import { constants } from "node:fs";
import { open } from "node:fs/promises";
import path from "node:path";
import { DispatchCloudError } from "../errors.ts";
import { type PackOptions, scanTree } from "../tar.ts";
import { type Digest, DigestBuilder } from "./digest.ts";
import { comparePaths, type Manifest, type ManifestEntry } from "./manifest.ts";

export interface TreeOptions extends PackOptions {
  /** Files hashed at once (default 8). */
  concurrency?: number;
}

export interface LocalBlob {
  /** One local file holding the blob's bytes (to upload from). */
  path: string;
  size: number;
}

export interface TreeManifest {
  manifest: Manifest;
  /** One local file per distinct blob, by hash. */
  files: Map<string, LocalBlob>;
}

const badEntry = (message: string) => new DispatchCloudError("output.bad_entry", message);

/** Runs `fn` on every item, at most `limit` at once; the first failure is thrown once the running ones end. */
export async function eachLimited<T>(
  items: readonly T[],
  limit: number,
  fn: (item: T, index: number) => Promise<void>,
): Promise<void> {
  let next = 0;
  let failure: { err: unknown } | undefined;
  const worker = async () => {
    while (failure === undefined && next < items.length) {
      const i = next++;
      try {
        await fn(items[i] as T, i);
      } catch (err) {
        failure ??= { err };
      }
    }
  };
  await Promise.all(Array.from({ length: Math.max(1, Math.min(limit, items.length)) }, worker));
  if (failure !== undefined) throw failure.err;
}

/**
 * Runs a synchronous `fn` over `items`, giving the event loop a turn after every `slice` of them. For many cheap
 * file operations (stat, link) on a local disk: the synchronous calls cost a few microseconds each, where each
 * promise through the thread pool costs tens, and the turns keep timers and sockets served meanwhile.
 */
export async function eachInSlices<T>(
  items: readonly T[],
  slice: number,
  fn: (item: T, index: number) => void,
): Promise<void> {
  for (let i = 0; i < items.length; i++) {
    fn(items[i] as T, i);
    if ((i + 1) % slice === 0) await new Promise<void>((r) => setImmediate(r));
  }
}

/**
 * Hashes one file opened without following links; `expect` (from a scan) must match the opened inode and the
 * bytes read. `shown` names the file in errors.
 */
export async function hashFile(
  file: string,
  shown: string,
  expect?: { dev: number; ino: number; size: number },
): Promise<Digest> {
  const fh = await open(file, constants.O_RDONLY | constants.O_NOFOLLOW).catch((err: unknown) => {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === "ELOOP") throw badEntry(`${shown} was replaced by a symbolic link while it was being read`);
    if (code === "ENOENT") throw badEntry(`${shown} disappeared while it was being read`);
    if (code === "EACCES" || code === "EPERM") throw badEntry(`${shown} cannot be read (permission denied)`);
    throw err;
  });
  try {
    const st = await fh.stat();
    if (!st.isFile() || (expect !== undefined && (st.ino !== expect.ino || st.dev !== expect.dev))) {
      throw badEntry(`${shown} was replaced while it was being read`);
    }
    const size = expect?.size ?? st.size;
    const b = new DigestBuilder();
    const buf = Buffer.allocUnsafe(Math.min(Math.max(size, 1), 1024 * 1024));
    for (;;) {
      const { bytesRead } = await fh.read(buf, 0, buf.length, b.size);
      if (bytesRead === 0) break;
      b.update(buf.subarray(0, bytesRead));
      if (b.size > size) throw badEntry(`${shown} grew while it was being read`);
    }
    if (b.size !== size) throw badEntry(`${shown} shrank while it was being read`);
    return b.digest();
  } finally {
    await fh.close();
  }
}

/** Scans and hashes `dir` into its canonical manifest. */
export async function manifestOfTree(dir: string, opts: TreeOptions = {}): Promise<TreeManifest> {
  const scanned = await scanTree(dir, opts);
  const shownAs = (opts.shownAs ?? ".").replace(/\/+$/, "");
  const entries: ManifestEntry[] = new Array(scanned.length);
  const files = new Map<string, LocalBlob>();
  await eachLimited(scanned, opts.concurrency ?? 8, async (e, i) => {
    if (e.kind === "dir") entries[i] = { path: e.rel, type: "dir" };
    else if (e.kind === "link") entries[i] = { path: e.rel, type: "link", target: e.target };
    else {
      const local = path.join(dir, e.rel);
      const digest = await hashFile(local, `${shownAs}/${e.rel}`, e);
      entries[i] = { path: e.rel, type: "file", digest, executable: (e.mode & 0o111) !== 0 };
      if (!files.has(digest.hash)) files.set(digest.hash, { path: local, size: digest.size });
    }
  });
  // scanTree sorts names per directory; the manifest's order is the UTF-8 bytes of whole paths ("a-b" < "a/x").
  entries.sort((a, b) => comparePaths(a.path, b.path));
  return { manifest: { version: 1, entries }, files };
}
