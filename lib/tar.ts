/**
 * A small streaming tar (POSIX ustar, with pax headers for long paths and large sizes) for bundle outputs
 * and dependencies. Only regular files and directories travel; an archive with anything else (links,
 * devices, absolute paths, `..`) is refused, so extracting one can never write outside its directory.
 */
import { mkdir, open, opendir, stat } from "node:fs/promises";
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

function header(name: string, size: number, type: "0" | "5" | "x", mode: number, mtime: number): Buffer {
  const b = Buffer.alloc(BLOCK);
  const { prefix, short } = splitName(name) ?? { prefix: "", short: "long-name-in-pax-header" };
  b.write(short, 0, 100, "utf8");
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

function* entryHeaders(name: string, size: number, type: "0" | "5", mode: number, mtime: number) {
  const needsPath = splitName(name) === null;
  const needsSize = size > MAX_OCTAL_SIZE;
  if (needsPath || needsSize) {
    const pax = Buffer.from(
      (needsPath ? paxRecord("path", name) : "") + (needsSize ? paxRecord("size", String(size)) : ""),
    );
    yield header("PaxHeader", pax.length, "x", 0o644, mtime);
    yield pax;
    yield padding(pax.length);
  }
  yield header(name, size, type, mode, mtime);
}

async function* walk(root: string, rel: string): AsyncGenerator<Buffer> {
  const names: string[] = [];
  for await (const d of await opendir(path.join(root, rel))) names.push(d.name);
  names.sort();
  for (const entry of names) {
    const relPath = rel === "" ? entry : `${rel}/${entry}`;
    const full = path.join(root, relPath);
    const st = await stat(full);
    const mtime = st.mtimeMs / 1000;
    if (st.isDirectory()) {
      yield* entryHeaders(`${relPath}/`, 0, "5", 0o755, mtime);
      yield* walk(root, relPath);
    } else if (st.isFile()) {
      yield* entryHeaders(relPath, st.size, "0", st.mode & 0o111 ? 0o755 : 0o644, mtime);
      const fh = await open(full, "r");
      try {
        let left = st.size;
        while (left > 0) {
          const buf = Buffer.alloc(Math.min(left, 256 * 1024));
          const { bytesRead } = await fh.read(buf, 0, buf.length, st.size - left);
          if (bytesRead === 0) {
            throw new Error(`${relPath} shrank while it was being archived`);
          }
          left -= bytesRead;
          yield buf.subarray(0, bytesRead);
        }
      } finally {
        await fh.close();
      }
      yield padding(st.size);
    }
    // Anything else (sockets, fifos, symlinks to nowhere): not part of an output.
  }
}

async function* archive(dir: string): AsyncGenerator<Buffer> {
  yield* walk(dir, "");
  yield ZERO_BLOCK;
  yield ZERO_BLOCK;
}

/** A tar stream of `dir`'s regular files and directories (sorted, relative paths). Symlinks are followed. */
export function packTar(dir: string): Readable {
  return Readable.from(archive(dir), { objectMode: false });
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
  "2": "a symbolic link",
  "3": "a character device",
  "4": "a block device",
  "6": "a FIFO",
};

/**
 * Extracts a tar stream into `dir` (created if missing). Refuses links, devices, absolute paths and `..`
 * (runner.bad_archive), and an archive whose files add up to more than `maxBytes` (runner.output_too_large).
 */
export async function extractTar(
  input: AsyncIterable<unknown>,
  dir: string,
  opts: { maxBytes?: number } = {},
): Promise<TarSummary> {
  const maxBytes = opts.maxBytes ?? Number.POSITIVE_INFINITY;
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
    pax = new Map();
    longName = null;
    const what = TYPE_NAMES[type];
    if (what !== undefined)
      throw badArchive(`entry ${JSON.stringify(name)} is ${what}; only files and directories are allowed`);
    if (type !== "0" && type !== "5" && type !== "7")
      throw badArchive(`entry ${JSON.stringify(name)} has unsupported type ${JSON.stringify(type)}`);
    const isDir = type === "5" || name.endsWith("/");
    name = name.replace(/\/+$/, "");
    const rel = safePath(name);
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
