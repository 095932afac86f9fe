/**
 * Staging a bundle's inputs from the VM's cache (docs/storage.md, "The cache on every VM"): the tree of a manifest
 * is made under a directory, each file a hard link to its cached blob (one inode, no bytes copied).
 *
 * Modes: a hard link shares the cached inode, and so its mode, which is 0444 (read-only for everyone, owned by the
 * supervisor's user). Executable files are therefore staged as copies with mode 0555 (not links): a cached blob is
 * never made executable, so the same bytes staged as data elsewhere keep 0444. Where linking fails (EXDEV: another
 * filesystem; EMLINK: too many links; EPERM: protected hard links), the file is copied, 0444. Directories are made
 * 0755 while staging and set to 0555 afterwards (deepest first), so nothing can be added, renamed or removed in the
 * staged tree by a process without the supervisor's uid (or root); use `removeStagedTree` to delete it.
 *
 * A staged tree must reach the container read-only (a read-only bind mount): a root process in a container with a
 * writable mount could write through the 0444 inode, which is the cache's blob.
 */
import { linkSync, mkdirSync } from "node:fs";
import { chmod, copyFile, lstat, mkdir, readdir, rm, symlink, writeFile } from "node:fs/promises";
import path from "node:path";
import { isEmptyDigest } from "../lib/cas/digest.ts";
import type { Manifest } from "../lib/cas/manifest.ts";
import { eachInSlices, eachLimited } from "../lib/cas/tree.ts";
import type { CasCache } from "./cas-cache.ts";

export interface StageResult {
  files: number;
  /** Files staged as hard links to the cache. */
  linked: number;
  /** Files copied (executables, and where linking failed). */
  copied: number;
  bytesCopied: number;
}

const LINK_FALLBACK = new Set(["EXDEV", "EMLINK", "EPERM"]);
/** Synchronous file operations between two turns of the event loop. */
const SYNC_SLICE = 500;

/**
 * Makes `manifest`'s tree under `targetDir` (created if missing; it should be empty) from blobs already in the
 * cache (`cache.fetchManifest` first, with a pin). `readOnlyDirs` (default true) sets the directories, the target
 * included, to 0555 at the end.
 */
export async function stageTree(
  cache: Pick<CasCache, "blobPath">,
  manifest: Manifest,
  targetDir: string,
  opts: { readOnlyDirs?: boolean; concurrency?: number } = {},
): Promise<StageResult> {
  const result: StageResult = { files: 0, linked: 0, copied: 0, bytesCopied: 0 };
  await mkdir(targetDir, { recursive: true, mode: 0o755 });
  const dirs: string[] = [];
  // Directories and plain links by synchronous calls in slices (a few microseconds each, where a promise through
  // the thread pool costs tens); what needs more (copies, symlinks, empty files, a link refused) goes after.
  const rest: Manifest["entries"] = [];
  const entries = manifest.entries;
  for (const e of entries) if (e.type === "dir") dirs.push(e.path);
  await eachInSlices(dirs, SYNC_SLICE, (d) => mkdirSync(path.join(targetDir, d), { mode: 0o755 }));
  await eachInSlices(entries, SYNC_SLICE, (e) => {
    if (e.type === "dir") return;
    const to = path.join(targetDir, e.path);
    if (e.type === "file" && !e.executable && !isEmptyDigest(e.digest)) {
      result.files++;
      try {
        linkSync(cache.blobPath(e.digest), to);
        result.linked++;
        return;
      } catch (err) {
        if (!LINK_FALLBACK.has((err as NodeJS.ErrnoException).code ?? "")) throw err;
        result.files--;
      }
    }
    rest.push(e);
  });
  await eachLimited(rest, opts.concurrency ?? 16, async (e) => {
    const to = path.join(targetDir, e.path);
    if (e.type === "link") {
      await symlink(e.target, to);
      return;
    }
    if (e.type !== "file") return;
    result.files++;
    if (isEmptyDigest(e.digest)) {
      await writeFile(to, "", { mode: e.executable ? 0o555 : 0o444, flag: "wx" });
      await chmod(to, e.executable ? 0o555 : 0o444);
      return;
    }
    await copyFile(cache.blobPath(e.digest), to);
    await chmod(to, e.executable ? 0o555 : 0o444);
    result.copied++;
    result.bytesCopied += e.digest.size;
  });
  if (opts.readOnlyDirs ?? true) {
    for (const d of dirs.reverse()) await chmod(path.join(targetDir, d), 0o555);
    await chmod(targetDir, 0o555);
  }
  return result;
}

/** Deletes a staged tree, making its read-only directories writable first (the cache's blobs are untouched). */
export async function removeStagedTree(targetDir: string): Promise<void> {
  const walk = async (dir: string): Promise<void> => {
    const st = await lstat(dir).catch(() => null);
    if (st === null || !st.isDirectory()) return;
    await chmod(dir, 0o755);
    for (const name of await readdir(dir)) await walk(path.join(dir, name));
  };
  await walk(targetDir);
  await rm(targetDir, { recursive: true, force: true });
}
