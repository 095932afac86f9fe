/**
 * A small streaming tar (POSIX ustar, with pax headers for long paths, link targets and large sizes) for bundle
 * outputs and dependencies. Regular files, directories and symbolic links that stay inside the tree travel.
 * Packing never follows a link (lstat, no-follow opens, the scanned inode checked again at open); extracting
 * refuses anything else (hard links, devices, absolute paths, `..`, links that leave the tree, entries below a
 * link), so neither side ever reads or writes outside its directory.
 * Close to 600 lines because the writer's and the reader's rules are the same rules (what may travel) and are
 * kept side by side; both are streaming and bounded (entries, header sizes).
 */
import { constants, type Stats } from "node:fs";
import { lstat, mkdir, open, opendir, readlink, symlink } from "node:fs/promises";
import path from "node:path";
import { Readable } from "node:stream";
import { DispatchCloudError } from "./errors.ts";
import { pathLengthProblem } from "./text-limits.ts";

const BLOCK = 512;
const ZERO_BLOCK = Buffer.alloc(BLOCK);
/** Largest size an 11-digit octal field holds. */
const MAX_OCTAL_SIZE = 0o77777777777;

export interface TarSummary {
  files: number;
  bytes: number;
}

const badArchive = (message: string) => new DispatchCloudError("runner.bad_archive", message);
/** A path within the limits that, below the extraction directory, is longer than the filesystem holds. */
const tooDeep = (rel: string) =>
  badArchive(`entry ${JSON.stringify(rel.slice(0, 80))}... is too long a path below the output directory`);

// ---- writing ----

function octal(value: number, width: number): string {
  return `${value.toString(8).padStart(width - 1, "0")}\0`;
}

/** ustar's prefix/name split of a path, or null when it does not fit (a pax header carries it then). */
function splitName(name: string): { prefix: string; short: string } | null {
  if (Buffer.byteLength(name) <= 100) return { prefix: "", short: name };
  for (let cut = name.indexOf("/"); cut > 0; cut = name.indexOf("/", cut + 1)) {
    const prefix = name.slice(0, cut);
    const short = name.slice(cut + 1);
    if (Buffer.byteLength(prefix) <= 155 && Buffer.byteLength(short) <= 100 && short !== "") {
      return { prefix, short };
    }
  }
  return null;
}

function header(
  name: string,
  size: number,
  type: "0" | "2" | "5" | "x",
  mode: number,
  mtime: number,
  linkName = "",
): Buffer {
  const b = Buffer.alloc(BLOCK);
  const { prefix, short } = splitName(name) ?? { prefix: "", short: "long-name-in-pax-header" };
  b.write(short, 0, 100, "utf8");
  if (Buffer.byteLength(linkName) <= 100) b.write(linkName, 157, 100, "utf8");
  b.write(octal(mode & 0o7777, 8), 100, "ascii");
  b.write(octal(0, 8), 108, "ascii");
  b.write(octal(0, 8), 116, "ascii");
  b.write(octal(Math.min(size, MAX_OCTAL_SIZE), 12), 124, "ascii");
  b.write(octal(Math.max(0, Math.floor(mtime)), 12), 136, "ascii");
  b.write("        ", 148, "ascii");
  b.write(type, 156, "ascii");
  b.write("ustar\0", 257, "ascii");
  b.write("00", 263, "ascii");
  b.write(prefix, 345, 155, "utf8");
  let sum = 0;
  for (const byte of b) sum += byte;
  b.write(`${sum.toString(8).padStart(6, "0")}\0 `, 148, "ascii");
  return b;
}

/** One pax record, `<len> key=value\n`, where len counts its own digits too. */
function paxRecord(key: string, value: string): string {
  const body = ` ${key}=${value}\n`;
  const base = Buffer.byteLength(body);
  let len = base + 1;
  while (base + String(len).length !== len) len = base + String(len).length;
  return `${len}${body}`;
}

function padding(size: number): Buffer {
  const rest = size % BLOCK;
  return rest === 0 ? Buffer.alloc(0) : Buffer.alloc(BLOCK - rest);
}

function* entryHeaders(
  name: string,
  size: number,
  type: "0" | "2" | "5",
  mode: number,
  mtime: number,
  linkName = "",
) {
  const needsPath = splitName(name) === null;
  const needsSize = size > MAX_OCTAL_SIZE;
  const needsLink = Buffer.byteLength(linkName) > 100;
  if (needsPath || needsSize || needsLink) {
    const pax = Buffer.from(
      (needsPath ? paxRecord("path", name) : "") +
        (needsSize ? paxRecord("size", String(size)) : "") +
        (needsLink ? paxRecord("linkpath", linkName) : ""),
    );
    yield header("PaxHeader", pax.length, "x", 0o644, mtime);
    yield pax;
    yield padding(pax.length);
  }
  yield header(name, size, type, mode, mtime, linkName);
}

/** An entry of a tree being archived, as lstat saw it (links are never followed). */
export interface PackEntry {
  rel: string;
  kind: "dir" | "file" | "link";
  size: number;
  mode: number;
  mtime: number;
  /** A link's target, relative and normalised (see `linkInside`). */
  target: string;
  dev: number;
  ino: number;
}

export interface PackOptions {
  /** How the packed directory is named in errors, e.g. "/out" (the directory as the container saw it). */
  shownAs?: string;
  /** How absolute link targets name the packed directory (default: shownAs when it is absolute). */
  absoluteRoot?: string;
  /** Most entries (files, directories and links) the archive may hold. */
  maxEntries?: number;
  /**
   * A link to a place outside the packed directory: refused (the default: outputs as a bundle left them) or
   * left out (a subdirectory of a stored output, whose links may point elsewhere in the output).
   */
  outsideLinks?: "refuse" | "skip";
}

const badEntry = (message: string) => new DispatchCloudError("output.bad_entry", message);

const KIND_NAMES: [(st: Stats) => boolean, string][] = [
  [(st) => st.isFIFO(), "a FIFO"],
  [(st) => st.isSocket(), "a socket"],
  [(st) => st.isCharacterDevice(), "a character device"],
  [(st) => st.isBlockDevice(), "a block device"],
];

/**
 * A symbolic link's target as a relative path that stays inside the tree, or null when it leaves it. `linkRel`
 * is the link's own path in the tree; `absoluteRoot` is how the tree's root appears in absolute targets (e.g.
 * "/out" for a bundle's outputs: `/out/a` inside the container is `a` in the tree). The result climbs only out
 * of the link's own directory (`../` first, then names), so resolving it never passes above the tree's root,
 * as long as the link's directory is a real directory (archives never put entries below a link).
 */
export function linkInside(linkRel: string, target: string, absoluteRoot?: string): string | null {
  if (target === "" || target.includes("\0")) return null;
  let from: string[];
  let rest: string;
  if (target.startsWith("/")) {
    if (absoluteRoot === undefined) return null;
    const root = absoluteRoot.replace(/\/+$/, "");
    if (target !== root && !target.startsWith(`${root}/`)) return null;
    from = [];
    rest = target.slice(root.length);
  } else {
    from = linkRel.split("/").slice(0, -1);
    rest = target;
  }
  const parts = [...from];
  for (const p of rest.split("/")) {
    if (p === "" || p === ".") continue;
    if (p === "..") {
      if (parts.length === 0) return null;
      parts.pop();
    } else parts.push(p);
  }
  const dir = linkRel.split("/").slice(0, -1);
  let common = 0;
  while (common < dir.length && common < parts.length && dir[common] === parts[common]) common++;
  const up = dir.length - common;
  const down = parts.slice(common);
  const out = [...Array(up).fill(".."), ...down].join("/");
  return out === "" ? "." : out;
}

/**
 * Lists `dir`'s tree with lstat, sorted, without following any link, and checks that every entry can travel:
 * links (kept as links) must point inside the tree, anything else than files, directories and links is
 * refused, and so is a tree with more than `maxEntries` entries. Errors name paths as `shownAs/<path>`.
 */
export async function scanTree(dir: string, opts: PackOptions = {}): Promise<PackEntry[]> {
  const shownAs = (opts.shownAs ?? ".").replace(/\/+$/, "");
  const show = (rel: string) => (rel === "" ? shownAs : `${shownAs}/${rel}`);
  const maxEntries = opts.maxEntries ?? Number.POSITIVE_INFINITY;
  const absoluteRoot = opts.absoluteRoot ?? (shownAs.startsWith("/") ? shownAs : undefined);
  const top = await lstat(dir).catch((err: unknown) => {
    throw localFailure(err, show(""));
  });
  if (top.isSymbolicLink()) throw badEntry(`${show("")} is a symbolic link; it must be a directory`);
  if (!top.isDirectory()) throw badEntry(`${show("")} is not a directory`);
  const out: PackEntry[] = [];
  const visit = async (rel: string): Promise<void> => {
    let names: string[];
    try {
      names = [];
      for await (const d of await opendir(rel === "" ? dir : path.join(dir, rel))) names.push(d.name);
    } catch (err) {
      throw localFailure(err, show(rel));
    }
    names.sort();
    for (const name of names) {
      const relPath = rel === "" ? name : `${rel}/${name}`;
      const tooLong = pathLengthProblem(relPath.split("/"));
      if (tooLong !== undefined) throw badEntry(`${show(relPath).slice(0, 300)}: ${tooLong}`);
      const st = await lstat(path.join(dir, relPath)).catch((err: unknown) => {
        throw localFailure(err, show(relPath));
      });
      const base = { rel: relPath, mtime: st.mtimeMs / 1000, dev: st.dev, ino: st.ino, size: 0, target: "" };
      if (st.isSymbolicLink()) {
        const raw = await readlink(path.join(dir, relPath)).catch((err: unknown) => {
          throw localFailure(err, show(relPath));
        });
        const target = linkInside(relPath, raw, absoluteRoot);
        if (target === null) {
          if (opts.outsideLinks === "skip") continue;
          throw badEntry(
            `${show(relPath)} is a symbolic link to ${JSON.stringify(raw.slice(0, 300))}, outside ${shownAs}: only links that stay inside ${shownAs} are kept`,
          );
        }
        out.push({ ...base, kind: "link", mode: 0o777, target });
      } else if (st.isDirectory()) {
        out.push({ ...base, kind: "dir", mode: 0o755 });
      } else if (st.isFile()) {
        out.push({ ...base, kind: "file", size: st.size, mode: st.mode & 0o111 ? 0o755 : 0o644 });
      } else {
        const what = KIND_NAMES.find(([is]) => is(st))?.[1] ?? "a special file";
        throw badEntry(`${show(relPath)} is ${what}: outputs hold only files, directories and links`);
      }
      if (out.length > maxEntries) {
        throw new DispatchCloudError(
          "runner.output_too_many_files",
          `${shownAs} holds more than the ${maxEntries} files, directories and links allowed`,
        );
      }
      if (st.isDirectory()) await visit(relPath);
    }
  };
  await visit("");
  return out;
}

/** An fs error met while packing or extracting, as a stable error naming the path (ENOSPC stays as it is). */
function localFailure(err: unknown, shown: string): unknown {
  const code = (err as NodeJS.ErrnoException).code;
  if (code === undefined || code === "ENOSPC" || code === "EIO" || err instanceof DispatchCloudError)
    return err;
  const why: Record<string, string> = {
    ELOOP: "is a symbolic link where a directory or file was expected",
    ENAMETOOLONG: "is a longer path than the filesystem holds",
    EACCES: "cannot be read (permission denied)",
    EPERM: "cannot be read (operation not permitted)",
    ENOENT: "disappeared while it was being archived",
    ENOTDIR: "changed from a directory to something else while it was being archived",
  };
  return badEntry(`${shown.slice(0, 300)} ${why[code] ?? `could not be read (${code})`}`);
}

async function* entryBytes(dir: string, e: PackEntry, show: (rel: string) => string): AsyncGenerator<Buffer> {
  if (e.kind === "dir") {
    yield* entryHeaders(`${e.rel}/`, 0, "5", e.mode, e.mtime);
    return;
  }
  if (e.kind === "link") {
    yield* entryHeaders(e.rel, 0, "2", e.mode, e.mtime, e.target);
    return;
  }
  // No-follow open, then the same inode as scanned: a path swapped for a link since is refused, not read.
  const fh = await open(path.join(dir, e.rel), constants.O_RDONLY | constants.O_NOFOLLOW).catch(
    (err: unknown) => {
      throw localFailure(err, show(e.rel));
    },
  );
  try {
    const st = await fh.stat();
    if (!st.isFile() || st.ino !== e.ino || st.dev !== e.dev) {
      throw badEntry(`${show(e.rel)} was replaced while it was being archived`);
    }
    yield* entryHeaders(e.rel, e.size, "0", e.mode, e.mtime);
    let left = e.size;
    while (left > 0) {
      const buf = Buffer.alloc(Math.min(left, 256 * 1024));
      const { bytesRead } = await fh.read(buf, 0, buf.length, e.size - left);
      if (bytesRead === 0) throw badEntry(`${show(e.rel)} shrank while it was being archived`);
      left -= bytesRead;
      yield buf.subarray(0, bytesRead);
    }
  } finally {
    await fh.close();
  }
  yield padding(e.size);
}

/** The archive of entries from `scanTree(dir)`. */
export function packEntries(dir: string, entries: readonly PackEntry[], opts: PackOptions = {}): Readable {
  const shownAs = (opts.shownAs ?? ".").replace(/\/+$/, "");
  const show = (rel: string) => `${shownAs}/${rel}`;
  async function* archive(): AsyncGenerator<Buffer> {
    for (const e of entries) yield* entryBytes(dir, e, show);
    yield ZERO_BLOCK;
    yield ZERO_BLOCK;
  }
  return Readable.from(archive(), { objectMode: false });
}

/**
 * A tar stream of `dir` (sorted, relative paths): files, directories, and symbolic links that stay inside it,
 * kept as links. Nothing is followed; see `scanTree` for what is refused.
 */
export function packTar(dir: string, opts: PackOptions = {}): Readable {
  async function* archive(): AsyncGenerator<Buffer> {
    const entries = await scanTree(dir, opts);
    yield* packEntries(dir, entries, opts);
  }
  return Readable.from(archive(), { objectMode: false });
}

// ---- reading ----

/** Reads exact byte counts from a stream of chunks. */
class ByteReader {
  private buffered: Buffer[] = [];
  private length = 0;
  private readonly it: AsyncIterator<unknown>;
  private done = false;

  constructor(input: AsyncIterable<unknown>) {
    this.it = input[Symbol.asyncIterator]();
  }

  private async fill(n: number): Promise<void> {
    while (this.length < n && !this.done) {
      const next = await this.it.next();
      if (next.done === true) {
        this.done = true;
        break;
      }
      const chunk = typeof next.value === "string" ? Buffer.from(next.value) : (next.value as Buffer);
      this.buffered.push(chunk);
      this.length += chunk.length;
    }
  }

  /** Exactly n bytes, or null at a clean end of input; a partial read is a truncated archive. */
  async read(n: number): Promise<Buffer | null> {
    await this.fill(n);
    if (this.length === 0) return null;
    if (this.length < n) throw badArchive("the archive ends in the middle of an entry");
    return this.take(n);
  }

  /** Up to `max` (> 0) bytes that are available or arrive next; throws at the end of input. */
  async some(max: number): Promise<Buffer> {
    await this.fill(1);
    if (this.length === 0) throw badArchive("the archive ends in the middle of a file");
    return this.take(Math.min(max, this.length));
  }

  private take(n: number): Buffer {
    const all = this.buffered.length === 1 ? this.buffered[0]! : Buffer.concat(this.buffered);
    const out = all.subarray(0, n);
    const rest = all.subarray(n);
    this.buffered = rest.length > 0 ? [rest] : [];
    this.length = rest.length;
    return out;
  }
}

function field(b: Buffer, start: number, len: number): string {
  const raw = b.subarray(start, start + len);
  const nul = raw.indexOf(0);
  return raw.subarray(0, nul === -1 ? len : nul).toString("utf8");
}

function parseOctal(b: Buffer, start: number, len: number, what: string): number {
  const text = field(b, start, len).trim();
  if (text === "") return 0;
  if (!/^[0-7]+$/.test(text)) throw badArchive(`entry ${what} is not an octal number`);
  return Number.parseInt(text, 8);
}

function checksumOk(b: Buffer): boolean {
  const stored = parseOctal(b, 148, 8, "checksum");
  let sum = 0;
  for (let i = 0; i < BLOCK; i++) sum += i >= 148 && i < 156 ? 32 : b[i]!;
  return sum === stored;
}

function parsePax(data: Buffer): Map<string, string> {
  const out = new Map<string, string>();
  let pos = 0;
  while (pos < data.length) {
    const space = data.indexOf(32, pos);
    if (space === -1) throw badArchive("malformed pax header");
    const len = Number(data.subarray(pos, space).toString("ascii"));
    if (!Number.isInteger(len) || len <= 0 || pos + len > data.length)
      throw badArchive("malformed pax header");
    const record = data.subarray(space + 1, pos + len - 1).toString("utf8");
    const eq = record.indexOf("=");
    if (eq > 0) out.set(record.slice(0, eq), record.slice(eq + 1));
    pos += len;
  }
  return out;
}

/** A safe relative path inside the target, or null for the archive root itself. */
function safePath(name: string): string | null {
  if (name.includes("\0")) throw badArchive("an entry name contains a NUL byte");
  if (name.startsWith("/")) throw badArchive(`absolute path ${JSON.stringify(name)} in the archive`);
  const parts = name.split("/").filter((p) => p !== "" && p !== ".");
  if (parts.includes("..")) throw badArchive(`path ${JSON.stringify(name)} leaves the archive`);
  const tooLong = pathLengthProblem(parts);
  if (tooLong !== undefined) throw badArchive(`entry path ${tooLong}`);
  return parts.length === 0 ? null : parts.join("/");
}

const TYPE_NAMES: Record<string, string> = {
  "1": "a hard link",
  "3": "a character device",
  "4": "a block device",
  "6": "a FIFO",
};

/**
 * Extracts a tar stream into `dir` (created if missing). Refuses hard links, devices, absolute paths, `..`,
 * symbolic links that leave the tree and entries below a symbolic link (runner.bad_archive), an archive whose
 * files add up to more than `maxBytes` (runner.output_too_large) and one with more than `maxEntries` entries
 * (runner.output_too_many_files).
 */
export async function extractTar(
  input: AsyncIterable<unknown>,
  dir: string,
  opts: { maxBytes?: number; maxEntries?: number } = {},
): Promise<TarSummary> {
  const maxBytes = opts.maxBytes ?? Number.POSITIVE_INFINITY;
  const maxEntries = opts.maxEntries ?? Number.POSITIVE_INFINITY;
  let entries = 0;
  const links = new Set<string>();
  /** Entries never go below a link: writing through one could leave the tree. */
  const checkParents = (rel: string) => {
    const parts = rel.split("/");
    for (let i = 1; i < parts.length; i++) {
      const prefix = parts.slice(0, i).join("/");
      if (links.has(prefix))
        throw badArchive(
          `entry ${JSON.stringify(rel)} lies below the symbolic link ${JSON.stringify(prefix)}`,
        );
    }
  };
  const reader = new ByteReader(input);
  const summary: TarSummary = { files: 0, bytes: 0 };
  await mkdir(dir, { recursive: true });
  let pax = new Map<string, string>();
  let longName: string | null = null;
  for (;;) {
    const h = await reader.read(BLOCK);
    if (h === null) break; // Tolerate archives without the two end blocks.
    if (h.equals(ZERO_BLOCK)) break;
    if (!checksumOk(h)) throw badArchive("an entry header has a bad checksum");
    const type = field(h, 156, 1) || "0";
    const magic = field(h, 257, 6);
    const prefix = magic.startsWith("ustar") ? field(h, 345, 155) : "";
    let name =
      longName ?? pax.get("path") ?? (prefix === "" ? field(h, 0, 100) : `${prefix}/${field(h, 0, 100)}`);
    const sizeText = pax.get("size");
    const size = sizeText !== undefined ? Number(sizeText) : parseOctal(h, 124, 12, "size");
    if (!Number.isSafeInteger(size) || size < 0) throw badArchive("an entry has an invalid size");
    const dataBlocks = Math.ceil(size / BLOCK) * BLOCK;
    if (type === "x" || type === "g" || type === "L") {
      if (size > 1024 * 1024) throw badArchive("an extended header is too large");
      const data = (await reader.read(dataBlocks)) ?? Buffer.alloc(0);
      if (type === "x") pax = parsePax(data.subarray(0, size));
      if (type === "L") longName = field(data, 0, size);
      continue;
    }
    const what = TYPE_NAMES[type];
    if (what !== undefined)
      throw badArchive(`entry ${JSON.stringify(name)} is ${what}; only files and directories are allowed`);
    if (type !== "0" && type !== "2" && type !== "5" && type !== "7")
      throw badArchive(`entry ${JSON.stringify(name)} has unsupported type ${JSON.stringify(type)}`);
    const isDir = type === "5" || name.endsWith("/");
    const linkName = pax.get("linkpath") ?? field(h, 157, 100);
    pax = new Map();
    longName = null;
    name = name.replace(/\/+$/, "");
    const rel = safePath(name);
    if (rel !== null) {
      entries += 1;
      if (entries > maxEntries)
        throw new DispatchCloudError(
          "runner.output_too_many_files",
          `the archive holds more than the ${maxEntries} files, directories and links allowed`,
        );
      checkParents(rel);
      if (links.has(rel))
        throw badArchive(`entry ${JSON.stringify(rel)} clashes with another entry of the archive`);
    }
    if (type === "2") {
      if (rel === null) throw badArchive("a symbolic link entry has an empty name");
      const target = linkInside(rel, linkName);
      if (target === null)
        throw badArchive(
          `entry ${JSON.stringify(rel)} is a symbolic link to ${JSON.stringify(linkName.slice(0, 300))}, outside the archive`,
        );
      const at = path.join(dir, rel);
      await mkdirEntry(path.dirname(at), rel);
      await symlink(target, at).catch((err: NodeJS.ErrnoException) => {
        if (err.code === "EEXIST" || err.code === "ENOTDIR")
          throw badArchive(`entry ${JSON.stringify(rel)} clashes with another entry of the archive`);
        if (err.code === "ENAMETOOLONG") throw tooDeep(rel);
        throw err;
      });
      links.add(rel);
      if (dataBlocks > 0) await skip(reader, dataBlocks);
      continue;
    }
    if (isDir) {
      if (rel !== null) await mkdirEntry(path.join(dir, rel), rel);
      if (dataBlocks > 0) await skip(reader, dataBlocks);
      continue;
    }
    if (rel === null) throw badArchive("a file entry has an empty name");
    summary.files += 1;
    summary.bytes += size;
    if (summary.bytes > maxBytes) {
      throw new DispatchCloudError(
        "runner.output_too_large",
        `the archive holds more than the ${maxBytes} bytes allowed`,
      );
    }
    const target = path.join(dir, rel);
    await mkdirEntry(path.dirname(target), rel);
    const mode = parseOctal(h, 100, 8, "mode") & 0o111 ? 0o755 : 0o644;
    const fh = await open(target, "wx", mode).catch((err: NodeJS.ErrnoException) => {
      if (err.code === "EEXIST" || err.code === "ENOTDIR" || err.code === "EISDIR")
        throw badArchive(`entry ${JSON.stringify(rel)} clashes with another entry of the archive`);
      if (err.code === "ENAMETOOLONG") throw tooDeep(rel);
      throw err;
    });
    try {
      let left = size;
      while (left > 0) {
        const chunk = await reader.some(left);
        await fh.write(chunk);
        left -= chunk.length;
      }
    } finally {
      await fh.close();
    }
    if (dataBlocks > size) await skip(reader, dataBlocks - size);
  }
  return summary;
}

async function mkdirEntry(target: string, rel: string): Promise<void> {
  try {
    await mkdir(target, { recursive: true });
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === "EEXIST" || code === "ENOTDIR")
      throw badArchive(`entry ${JSON.stringify(rel)} clashes with another entry of the archive`);
    if (code === "ENAMETOOLONG") throw tooDeep(rel);
    throw err;
  }
}

async function skip(reader: ByteReader, n: number): Promise<void> {
  let left = n;
  while (left > 0) left -= (await reader.some(left)).length;
}

/** An entry of a tree kept elsewhere (a manifest of the content-addressed store), for `packFromEntries`. */
export interface StoredEntry {
  rel: string;
  kind: "dir" | "file" | "link";
  size: number;
  executable: boolean;
  /** A link's target, relative to its directory and inside the tree. */
  target: string;
}

/**
 * A tar stream of entries whose file bytes come from `open` (the store), checked to have the size the entry says.
 * Modification times are 0: a stored tree has none.
 */
export function packFromEntries(
  entries: readonly StoredEntry[],
  open: (e: StoredEntry) => Promise<AsyncIterable<Uint8Array>>,
): Readable {
  async function* archive(): AsyncGenerator<Buffer> {
    for (const e of entries) {
      if (e.kind === "dir") yield* entryHeaders(`${e.rel}/`, 0, "5", 0o755, 0);
      else if (e.kind === "link") yield* entryHeaders(e.rel, 0, "2", 0o777, 0, e.target);
      else {
        yield* entryHeaders(e.rel, e.size, "0", e.executable ? 0o755 : 0o644, 0);
        let got = 0;
        for await (const chunk of await open(e)) {
          got += chunk.byteLength;
          if (got > e.size) throw badArchive(`${e.rel}: the stored blob is longer than its digest says`);
          yield Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength);
        }
        if (got !== e.size) throw badArchive(`${e.rel}: the stored blob is shorter than its digest says`);
        yield padding(e.size);
      }
    }
    yield ZERO_BLOCK;
    yield ZERO_BLOCK;
  }
  return Readable.from(archive(), { objectMode: false });
}
