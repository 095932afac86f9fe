/**
 * Bundle outputs on the REST server's disk: `<dataDir>/outputs/<bundle uuid>` is a symlink to a sibling
 * directory `.<uuid>.<random>` holding the files. An upload extracts into a fresh sibling and then swaps the
 * symlink with one rename, so a reader sees the old outputs or the new ones, never half an upload; the old
 * directory is removed afterwards. Paths from requests are checked here (no `..`, no absolute paths, no NUL)
 * and every resolved path is checked to stay inside the bundle's directory.
 */
import { randomBytes } from "node:crypto";
import { createReadStream } from "node:fs";
import { link, lstat, mkdir, mkdtemp, readlink, realpath, rename, rm, symlink } from "node:fs/promises";
import path from "node:path";
import { Readable } from "node:stream";
import { DispatchCloudError } from "../lib/errors.ts";
import { extractTar, packTar, type TarSummary } from "../lib/tar.ts";
import { MAX_PATH_BYTES, pathLengthProblem } from "../lib/text-limits.ts";
import { listFilesPage, type OutputPage } from "./outputs-listing.ts";

export interface OutputFile {
  /** Path relative to the bundle's output root, `/`-separated. */
  path: string;
  size: number;
  /** A symbolic link: its target, relative to the link's directory (always inside the outputs). */
  link?: string;
}

export type OutputEntry =
  | { kind: "dir"; files: OutputFile[] }
  | { kind: "file"; path: string; size: number; open(): Readable };

export interface OutputStore {
  /**
   * Replaces the bundle's outputs by the tar archive `input` (file sizes adding up to at most maxBytes).
   * `beforeCommit` runs after the archive is extracted and before it becomes visible; if it throws, the
   * upload is discarded and the error passes through.
   */
  replace(
    uuid: string,
    input: AsyncIterable<unknown>,
    opts: { maxBytes: number; maxEntries?: number; beforeCommit?: () => Promise<void> },
  ): Promise<TarSummary>;
  /**
   * The file at `rel` ("" = the root), or the recursive listing of the directory there: all of it, or with
   * `page` the files after `page.after` in path order, at most `page.limit` of them (outputs-listing.ts).
   */
  get(uuid: string, rel: string, page?: OutputPage): Promise<OutputEntry>;
  /**
   * A tar archive of the outputs under `rel` (a directory: its contents; a file: that one file under its
   * base name); an empty archive for rel "" when the bundle has no outputs; null when `rel` does not exist.
   */
  pack(uuid: string, rel: string): Promise<Readable | null>;
}

/** Two zero blocks: a tar archive with no entries. */
const EMPTY_TAR = Buffer.alloc(1024);

/**
 * A relative output path from a request: `/`-separated names, none of them `.` or `..`, no NUL, not absolute,
 * no empty names (a trailing `/` is allowed), no name over 255 bytes and at most 4096 bytes in all (what the
 * filesystem holds). Returns the normalised path ("" for the root).
 */
export function parseOutputPath(raw: string, field = "path"): string {
  const bad = (why: string) =>
    new DispatchCloudError("request.invalid_param", `${field}: ${why}`, { path: field });
  if (raw.length > MAX_PATH_BYTES) throw bad(`is longer than ${MAX_PATH_BYTES} bytes`);
  if (raw.includes("\0")) throw bad("must not contain NUL characters");
  if (raw.startsWith("/")) throw bad("must be a relative path (no leading /)");
  const trimmed = raw.endsWith("/") ? raw.slice(0, -1) : raw;
  if (trimmed === "") return "";
  const parts = trimmed.split("/");
  for (const p of parts) {
    if (p === "") throw bad("must not contain empty names (//)");
    if (p === "." || p === "..") throw bad(`must not contain ${JSON.stringify(p)}`);
  }
  const tooLong = pathLengthProblem(parts);
  if (tooLong !== undefined) throw bad(tooLong);
  return parts.join("/");
}

const isNotFound = (err: unknown): boolean => {
  const code = (err as NodeJS.ErrnoException | null)?.code;
  // ENAMETOOLONG: a path longer than the filesystem holds (with the data directory before it) exists nowhere.
  return code === "ENOENT" || code === "ENOTDIR" || code === "ENAMETOOLONG";
};

export function createOutputStore(outputsDir: string): OutputStore {
  const root = path.resolve(outputsDir);
  /** One replacement of a bundle's outputs at a time (in this process), so swaps never lose a directory. */
  const busy = new Map<string, Promise<unknown>>();

  const current = (uuid: string) => path.join(root, uuid);

  /** The real directory behind the bundle's symlink, or null when it has no outputs. */
  async function baseDir(uuid: string): Promise<string | null> {
    try {
      return await realpath(current(uuid));
    } catch (err) {
      if (isNotFound(err)) return null;
      throw err;
    }
  }

  /** base + rel after checking (with symlinks resolved) that it stays inside base; null if missing. */
  async function resolveInside(base: string, rel: string): Promise<string | null> {
    if (rel === "") return base;
    let full: string;
    try {
      full = await realpath(path.join(base, rel));
    } catch (err) {
      // ELOOP: links kept in an output may form a loop (`ln -s . loop`); the path names nothing then.
      if (isNotFound(err) || (err as NodeJS.ErrnoException).code === "ELOOP") return null;
      throw err;
    }
    if (full !== base && !full.startsWith(base + path.sep)) return null;
    return full;
  }

  async function replaceNow(
    uuid: string,
    input: AsyncIterable<unknown>,
    opts: { maxBytes: number; maxEntries?: number; beforeCommit?: () => Promise<void> },
  ): Promise<TarSummary> {
    await mkdir(root, { recursive: true });
    const tag = randomBytes(6).toString("hex");
    const target = `.${uuid}.${tag}`;
    const dir = path.join(root, target);
    const linkTmp = path.join(root, `.${uuid}.${tag}.link`);
    let committed = false;
    try {
      const summary = await extractTar(input, dir, {
        maxBytes: opts.maxBytes,
        ...(opts.maxEntries === undefined ? {} : { maxEntries: opts.maxEntries }),
      });
      await opts.beforeCommit?.();
      let old: string | null = null;
      try {
        old = await readlink(current(uuid));
      } catch (err) {
        if (!isNotFound(err) && (err as NodeJS.ErrnoException).code !== "EINVAL") throw err;
      }
      await symlink(target, linkTmp);
      await rename(linkTmp, current(uuid));
      committed = true;
      if (old !== null && !old.includes("/"))
        await rm(path.join(root, old), { recursive: true, force: true });
      return summary;
    } finally {
      if (!committed) {
        await rm(dir, { recursive: true, force: true });
        await rm(linkTmp, { force: true });
      }
    }
  }

  return {
    replace(uuid, input, opts) {
      const prev = busy.get(uuid) ?? Promise.resolve();
      const run = prev.catch(() => {}).then(() => replaceNow(uuid, input, opts));
      const settled = run.catch(() => {});
      busy.set(uuid, settled);
      void settled.then(() => {
        if (busy.get(uuid) === settled) busy.delete(uuid);
      });
      return run;
    },

    async get(uuid, rel, page = { after: null, limit: Number.POSITIVE_INFINITY }) {
      const missing = () =>
        new DispatchCloudError("output.not_found", `bundle ${uuid} has no output ${JSON.stringify(rel)}`, {
          path: "path",
        });
      const base = await baseDir(uuid);
      if (base === null) {
        if (rel === "") return { kind: "dir", files: [] };
        throw missing();
      }
      const full = await resolveInside(base, rel);
      if (full === null) throw missing();
      const st = await lstat(full);
      if (st.isFile()) return { kind: "file", path: rel, size: st.size, open: () => createReadStream(full) };
      if (!st.isDirectory()) throw missing();
      let files: OutputFile[];
      try {
        files = await listFilesPage(base, path.relative(base, full).split(path.sep).join("/"), page);
      } catch (err) {
        // Replaced under the walk (the old directory was removed): the caller may simply ask again.
        if (isNotFound(err)) throw missing();
        throw err;
      }
      return { kind: "dir", files };
    },

    async pack(uuid, rel) {
      const base = await baseDir(uuid);
      if (base === null) return rel === "" ? Readable.from([EMPTY_TAR]) : null;
      const full = await resolveInside(base, rel);
      if (full === null) return null;
      const st = await lstat(full);
      // A subdirectory's links may point elsewhere in the output: those are left out of its archive.
      if (st.isDirectory()) return packTar(full, { outsideLinks: "skip" });
      if (!st.isFile()) return null;
      // One file: a hard link to it, alone in a scratch directory, archived under its base name.
      await mkdir(root, { recursive: true });
      const scratch = await mkdtemp(path.join(root, ".pack-"));
      try {
        await link(full, path.join(scratch, path.basename(full)));
      } catch (err) {
        await rm(scratch, { recursive: true, force: true });
        throw err;
      }
      const tar = packTar(scratch);
      const cleanup = () => void rm(scratch, { recursive: true, force: true });
      tar.once("close", cleanup);
      return tar;
    },
  };
}
