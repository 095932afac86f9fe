/**
 * The cache of the content-addressed store on an instance (docs/storage.md, "The cache on every VM"), under
 * `${ROOT}/var/cache/dispatch-cloud/cas` and shared by every supervisor running there:
 *
 *   blobs/<2 hex>/<hash>   each blob, read-only (0444), put in place by rename once its bytes are verified
 *   tmp/                   downloads in progress (`<pid>-<random>`)
 *   index.json             {version, blobs: {hash: [size, lastUsed]}, manifests: {digest: lastUsed}}, written
 *                          to a temporary file and renamed; `manifests` are those held in full
 *   index.lock             held (O_EXCL, {pid, startTime}) while the index is read, changed and written; a lock
 *                          whose process is gone is broken
 *   pins/<id>.json         {lock, pid, hashes}: the blobs a bundle attempt uses; honoured while the attempt's
 *                          lock file (lock.ts) still names that pid
 *
 * Eviction, least recently used first and never a pinned blob, keeps the cache within its limits: bytes (at most
 * `maxBytes` and `maxFraction` of the filesystem), `minFreeBytes` free on the filesystem, `maxItems` blobs, and
 * nothing unused for `maxAgeMs`. A missing or unreadable index is rebuilt from a scan of blobs/ (blobs are never
 * wiped; their mtime is their last use). Downloads happen outside the lock; only index changes are inside it.
 */
import { randomBytes } from "node:crypto";
import { mkdirSync, renameSync, rmSync, statSync, utimesSync, writeFileSync } from "node:fs";
import {
  chmod,
  mkdir,
  open,
  readdir,
  readFile,
  rename,
  rm,
  stat,
  statfs,
  unlink,
  writeFile,
} from "node:fs/promises";
import path from "node:path";
import { batches, type CasClient, MAX_BATCH_BYTES, SMALL_BLOB } from "../lib/cas/client.ts";
import { type Digest, digestBytes, formatDigest, isEmptyDigest, parseDigest } from "../lib/cas/digest.ts";
import {
  type Manifest,
  manifestStats,
  parseManifest,
  subManifest,
  validateManifest,
} from "../lib/cas/manifest.ts";
import { eachInSlices, eachLimited } from "../lib/cas/tree.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { parseLock, procStartTime, readLockText, removeDeadLock } from "./lock.ts";

const GiB = 1024 ** 3;
/** Synchronous file operations between two turns of the event loop (eachInSlices). */
const SYNC_SLICE = 500;
/** Small blobs written synchronously between two turns of the event loop (up to 64 KiB each). */
const SMALL_WRITE_SLICE = 32;
/** A blob's mtime is rewritten on use only when older than this (it only orders evictions after a rebuild). */
const MTIME_RESOLUTION_MS = 3_600_000;

export interface CacheLimits {
  /** Most bytes of blobs (default 50 GiB). */
  maxBytes: number;
  /** Most bytes as a fraction of the filesystem's size (default 0.8). */
  maxFraction: number;
  /** Bytes kept free on the filesystem (default 2 GiB). */
  minFreeBytes: number;
  /** Most blobs (default 100,000). */
  maxItems: number;
  /** A blob unused for longer goes (default 21 days). */
  maxAgeMs: number;
}

export const DEFAULT_CACHE_LIMITS: CacheLimits = {
  maxBytes: 50 * GiB,
  maxFraction: 0.8,
  minFreeBytes: 2 * GiB,
  maxItems: 100_000,
  maxAgeMs: 21 * 24 * 3600 * 1000,
};

/** Manifests the index remembers (the dispatcher is told of at most 256). */
const MAX_MANIFEST_RECORDS = 1024;
export const MAX_HELD_MANIFESTS = 256;

export interface CasCacheOptions extends Partial<CacheLimits> {
  now?: () => number;
  /** The filesystem's size and free bytes (default statfs of the cache). */
  fsStats?: (dir: string) => Promise<{ total: number; free: number }>;
  /** How long to wait for the index lock before failing (default 60 s). */
  lockTimeoutMs?: number;
  /** Downloads at once (default 4). */
  concurrency?: number;
}

/** What fetching needs of the CAS client (lib/cas/client.ts). */
export type CasReader = Pick<CasClient, "getManifest" | "batchRead" | "download">;

interface Index {
  version: 1;
  /**
   * hash -> [size, lastUsed (ms), mtime (ms): the last use written to the blob's mtime, for a rebuild]; indexes
   * written before the third element existed lack it (the next use writes the mtime).
   */
  blobs: Record<string, [number, number, number?]>;
  /** manifest digest text -> lastUsed (ms) */
  manifests: Record<string, number>;
}

interface Pin {
  lock: string;
  pid: number;
  hashes: string[];
}

export interface FetchResult {
  manifest: Manifest;
  /** The part of the tree fetched (`subpath`; the whole manifest without one), null when it has no such path. */
  part: Manifest | null;
  blobsHit: number;
  blobsFetched: number;
  bytesFetched: number;
}

const HASH = /^[0-9a-f]{64}$/;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const errCode = (err: unknown) => (err as NodeJS.ErrnoException).code;

export class CasCache {
  readonly limits: CacheLimits;
  private readonly now: () => number;
  private readonly fsStats: (dir: string) => Promise<{ total: number; free: number }>;
  private readonly lockTimeoutMs: number;
  private readonly concurrency: number;
  private readonly myStart = procStartTime(process.pid) ?? "";

  constructor(
    readonly dir: string,
    opts: CasCacheOptions = {},
  ) {
    this.limits = {
      maxBytes: opts.maxBytes ?? DEFAULT_CACHE_LIMITS.maxBytes,
      maxFraction: opts.maxFraction ?? DEFAULT_CACHE_LIMITS.maxFraction,
      minFreeBytes: opts.minFreeBytes ?? DEFAULT_CACHE_LIMITS.minFreeBytes,
      maxItems: opts.maxItems ?? DEFAULT_CACHE_LIMITS.maxItems,
      maxAgeMs: opts.maxAgeMs ?? DEFAULT_CACHE_LIMITS.maxAgeMs,
    };
    this.now = opts.now ?? Date.now;
    this.fsStats =
      opts.fsStats ??
      (async (d) => {
        const s = await statfs(d);
        return { total: s.blocks * s.bsize, free: s.bavail * s.bsize };
      });
    this.lockTimeoutMs = opts.lockTimeoutMs ?? 60_000;
    this.concurrency = opts.concurrency ?? 4;
  }

  private get indexFile() {
    return path.join(this.dir, "index.json");
  }
  private get lockFile() {
    return path.join(this.dir, "index.lock");
  }
  private get pinDir() {
    return path.join(this.dir, "pins");
  }
  private tmpName() {
    return path.join(this.dir, "tmp", `${process.pid}-${randomBytes(6).toString("hex")}`);
  }

  /** Where the blob lives in the cache (whether or not it is there). */
  blobPath(d: Digest | string): string {
    const hash = typeof d === "string" ? d : d.hash;
    return path.join(this.dir, "blobs", hash.slice(0, 2), hash);
  }

  private initialised = false;
  /** blobs/<2 hex> directories known to exist (never removed). */
  private readonly subdirs = new Set<string>();

  /** Makes the directories; the first time, removes temporary files of processes that are gone. */
  async init(): Promise<void> {
    if (this.initialised) return;
    await mkdir(path.join(this.dir, "blobs"), { recursive: true });
    await mkdir(path.join(this.dir, "tmp"), { recursive: true });
    await mkdir(this.pinDir, { recursive: true });
    for (const name of await readdir(path.join(this.dir, "tmp"))) {
      const pid = Number(name.split("-")[0]);
      if (Number.isSafeInteger(pid) && pid > 0 && procStartTime(pid) === null) {
        await rm(path.join(this.dir, "tmp", name), { force: true });
      }
    }
    this.initialised = true;
  }

  /** True when the blob is in the cache with its size (the empty blob always is). */
  async has(d: Digest): Promise<boolean> {
    return this.hasSync(d);
  }

  /** has(), as one synchronous stat (fetchManifest asks it of every blob of a tree, in slices). */
  private hasSync(d: Digest): boolean {
    if (isEmptyDigest(d)) return true;
    const st = statSync(this.blobPath(d), { throwIfNoEntry: false });
    return st?.isFile() === true && st.size === d.size;
  }

  // ---- the index and its lock ----

  private async lock(): Promise<void> {
    const deadline = Date.now() + this.lockTimeoutMs;
    const me = JSON.stringify({ uuid: "cas-cache", pid: process.pid, startTime: this.myStart });
    for (let delay = 2; ; delay = Math.min(delay * 2, 50)) {
      try {
        const fh = await open(this.lockFile, "wx", 0o644);
        await fh.writeFile(me);
        await fh.close();
        return;
      } catch (err) {
        if (errCode(err) !== "EEXIST") throw err;
      }
      const text = await readLockText(this.lockFile).catch(() => null);
      if (text !== null) {
        const info = parseLock(text);
        // A lock being written is empty for a moment: only a parsed lock whose process is gone is broken.
        if (info !== null && procStartTime(info.pid) !== info.startTime) {
          await removeDeadLock(this.lockFile, text);
          continue;
        }
        // An empty lock for long: its taker died between creating and writing it.
        if (info === null) {
          const age = Date.now() - ((await stat(this.lockFile).catch(() => null))?.mtimeMs ?? Date.now());
          if (age > 10_000) {
            await removeDeadLock(this.lockFile, text);
            continue;
          }
        }
      }
      if (Date.now() > deadline) {
        throw new Error(`the cache's index lock ${this.lockFile} is held by another process for too long`);
      }
      await sleep(delay);
    }
  }

  private async unlock(): Promise<void> {
    await unlink(this.lockFile).catch(() => {});
  }

  private async readIndex(): Promise<Index> {
    try {
      const v = JSON.parse(await readFile(this.indexFile, "utf8")) as Index;
      if (
        v.version !== 1 ||
        typeof v.blobs !== "object" ||
        typeof v.manifests !== "object" ||
        v.blobs === null
      ) {
        throw new Error("bad index");
      }
      return v;
    } catch {
      return this.rebuild();
    }
  }

  /** The index from a scan of blobs/: sizes from stat, last use from mtime; manifests are forgotten. */
  private async rebuild(): Promise<Index> {
    const idx: Index = { version: 1, blobs: {}, manifests: {} };
    const top = path.join(this.dir, "blobs");
    for (const sub of await readdir(top).catch(() => [] as string[])) {
      for (const name of await readdir(path.join(top, sub)).catch(() => [] as string[])) {
        if (!HASH.test(name) || !name.startsWith(sub)) continue;
        const st = await stat(path.join(top, sub, name)).catch(() => null);
        if (st?.isFile()) idx.blobs[name] = [st.size, st.mtimeMs, st.mtimeMs];
      }
    }
    return idx;
  }

  private async writeIndex(idx: Index): Promise<void> {
    const tmp = this.tmpName();
    await writeFile(tmp, JSON.stringify(idx), { mode: 0o644 });
    await rename(tmp, this.indexFile);
    // The held manifests apart, so `--list` (every probe) reads a few KiB, not an index of 100k blobs.
    const held = Object.entries(idx.manifests ?? {})
      .sort((a, b) => b[1] - a[1])
      .slice(0, MAX_HELD_MANIFESTS)
      .map(([d]) => d);
    const heldTmp = this.tmpName();
    await writeFile(heldTmp, `${held.join("\n")}\n`, { mode: 0o644 });
    await rename(heldTmp, heldManifestsFile(this.dir));
  }

  /** Reads, changes and writes the index under the lock. */
  private async update<T>(fn: (idx: Index) => Promise<T> | T): Promise<T> {
    await this.init();
    await this.lock();
    try {
      const idx = await this.readIndex();
      const out = await fn(idx);
      await this.writeIndex(idx);
      return out;
    } finally {
      await this.unlock();
    }
  }

  // ---- pins ----

  /**
   * Protects blobs from eviction while the attempt whose lock file is `lockFile` (held by this process) runs.
   * `id` names the pin (e.g. `<uuid>-<attempt>`); pinning again under the same id replaces the list.
   */
  async pin(id: string, lockFile: string, hashes: Iterable<string>): Promise<void> {
    if (!/^[A-Za-z0-9._-]{1,200}$/.test(id) || id.startsWith(".")) {
      throw new Error(`pin id ${JSON.stringify(id.slice(0, 80))}: letters, digits, ".", "_" and "-" only`);
    }
    const pin: Pin = { lock: lockFile, pid: process.pid, hashes: [...new Set(hashes)] };
    // Under the index lock (the index itself is not read), so an eviction never runs between reading the pins
    // and deleting blobs.
    await this.init();
    await this.lock();
    try {
      const tmp = this.tmpName();
      await writeFile(tmp, JSON.stringify(pin));
      await rename(tmp, path.join(this.pinDir, `${id}.json`));
    } finally {
      await this.unlock();
    }
  }

  async unpin(id: string): Promise<void> {
    await rm(path.join(this.pinDir, `${id}.json`), { force: true });
  }

  /** Hashes pinned by live attempts; pins whose attempt's lock is gone (or names another pid) are deleted. */
  private async livePins(): Promise<Set<string>> {
    const out = new Set<string>();
    for (const name of await readdir(this.pinDir).catch(() => [] as string[])) {
      if (!name.endsWith(".json")) continue;
      const file = path.join(this.pinDir, name);
      let pin: Pin;
      try {
        pin = JSON.parse(await readFile(file, "utf8")) as Pin;
      } catch {
        await rm(file, { force: true });
        continue;
      }
      const lock = await readLockText(pin.lock).catch(() => null);
      if (lock === null || parseLock(lock)?.pid !== pin.pid) {
        await rm(file, { force: true });
        continue;
      }
      for (const h of pin.hashes) out.add(h);
    }
    return out;
  }

  // ---- putting blobs in ----

  /** Verifies bytes and puts them in place (the index learns of them at the next `record`). */
  async putBytes(d: Digest, data: Buffer): Promise<void> {
    this.putBytesSync(d, data);
  }

  /**
   * putBytes for a small blob by synchronous calls (verify, temp -> rename, read-only): a few tens of
   * microseconds for a small file, where the same through the thread pool costs a round trip per call.
   */
  private putBytesSync(d: Digest, data: Buffer): void {
    const got = digestBytes(data);
    if (got.hash !== d.hash || got.size !== d.size) {
      throw new DispatchCloudError(
        "cas.digest_mismatch",
        `the bytes received for ${formatDigest(d)} hash to ${formatDigest(got)}; not cached`,
      );
    }
    const tmp = this.tmpName();
    try {
      // Created 0444: the descriptor that creates it may still write it.
      writeFileSync(tmp, data, { mode: 0o444 });
      const sub = d.hash.slice(0, 2);
      if (!this.subdirs.has(sub)) {
        mkdirSync(path.dirname(this.blobPath(d)), { recursive: true });
        this.subdirs.add(sub);
      }
      renameSync(tmp, this.blobPath(d));
    } catch (err) {
      rmSync(tmp, { force: true });
      throw err;
    }
  }

  /** Moves a verified temporary file into blobs/, read-only. */
  private async place(d: Digest, tmp: string): Promise<void> {
    try {
      await chmod(tmp, 0o444);
      const sub = d.hash.slice(0, 2);
      if (!this.subdirs.has(sub)) {
        await mkdir(path.dirname(this.blobPath(d)), { recursive: true });
        this.subdirs.add(sub);
      }
      await rename(tmp, this.blobPath(d));
    } catch (err) {
      await rm(tmp, { force: true });
      throw err;
    }
  }

  /** Adds blobs (and a held manifest) to the index, marks them used now, then evicts what the limits require. */
  private async record(used: Digest[], manifest?: Digest): Promise<void> {
    const now = this.now();
    const stale: Digest[] = [];
    await this.update(async (idx) => {
      for (const d of used) {
        if (isEmptyDigest(d)) continue;
        const mtime = idx.blobs[d.hash]?.[2];
        const write = mtime === undefined || mtime < now - MTIME_RESOLUTION_MS || mtime > now;
        if (write) stale.push(d);
        idx.blobs[d.hash] = [d.size, now, write ? now : mtime];
      }
      if (manifest !== undefined) idx.manifests[formatDigest(manifest)] = now;
      // What was just used stays, even unpinned: its caller is about to read it.
      await this.evictIn(idx, new Set(used.map((d) => d.hash)));
    });
    // The mtime carries the last use through a rebuild of the index, to within MTIME_RESOLUTION_MS: a blob used
    // again sooner keeps its mtime (a warm tree of 10,000 blobs costs no 10,000 writes).
    const t = now / 1000;
    await eachInSlices(stale, SYNC_SLICE, (d) => {
      try {
        utimesSync(this.blobPath(d), t, t);
      } catch {
        // Evicted meanwhile by another process: nothing to mark.
      }
    });
  }

  /** Evicts under the limits now (it happens after every fetch too). */
  async evict(): Promise<{ evicted: number; bytesFreed: number }> {
    return this.update((idx) => this.evictIn(idx));
  }

  private async evictIn(
    idx: Index,
    keep: ReadonlySet<string> = new Set(),
  ): Promise<{ evicted: number; bytesFreed: number }> {
    const now = this.now();
    const fs = await this.fsStats(this.dir);
    const cap = Math.min(this.limits.maxBytes, Math.floor(this.limits.maxFraction * fs.total));
    let bytes = 0;
    let items = 0;
    let oldest = Number.POSITIVE_INFINITY;
    for (const [hash, [size, lastUsed]] of Object.entries(idx.blobs)) {
      bytes += size;
      items++;
      if (lastUsed < oldest && !keep.has(hash)) oldest = lastUsed;
    }
    let free = fs.free;
    const within =
      bytes <= cap &&
      items <= this.limits.maxItems &&
      free >= this.limits.minFreeBytes &&
      !(now - oldest > this.limits.maxAgeMs);
    if (within) {
      // Nothing to evict (the common case): no sort of the whole index, no read of the pins.
      this.trimManifestRecords(idx);
      return { evicted: 0, bytesFreed: 0 };
    }
    const pinned = await this.livePins();
    const order = Object.entries(idx.blobs)
      .filter(([h]) => !pinned.has(h) && !keep.has(h))
      .sort((a, b) => a[1][1] - b[1][1]);
    const gone = new Set<string>();
    let bytesFreed = 0;
    for (const [hash, [size, lastUsed]] of order) {
      const over =
        bytes > cap ||
        items > this.limits.maxItems ||
        free < this.limits.minFreeBytes ||
        now - lastUsed > this.limits.maxAgeMs;
      if (!over) break;
      await rm(this.blobPath(hash), { force: true });
      delete idx.blobs[hash];
      gone.add(hash);
      bytes -= size;
      items--;
      free += size;
      bytesFreed += size;
    }
    if (gone.size > 0) await this.dropManifests(idx, (h) => gone.has(h));
    this.trimManifestRecords(idx);
    return { evicted: gone.size, bytesFreed };
  }

  /** Keeps the MAX_MANIFEST_RECORDS most recently used manifest records. */
  private trimManifestRecords(idx: Index): void {
    const records = Object.entries(idx.manifests);
    if (records.length <= MAX_MANIFEST_RECORDS) return;
    records.sort((a, b) => b[1] - a[1]);
    for (const [d] of records.slice(MAX_MANIFEST_RECORDS)) delete idx.manifests[d];
  }

  /** Forgets held manifests that name a blob for which `lost` is true (or whose own blob is not held). */
  private async dropManifests(idx: Index, lost: (hash: string) => boolean): Promise<void> {
    for (const text of Object.keys(idx.manifests)) {
      const d = parseDigest(text);
      if (idx.blobs[d.hash] === undefined) {
        delete idx.manifests[text];
        continue;
      }
      try {
        const m = await this.readCachedManifest(d);
        if (manifestStats(m).blobs.some((b) => !isEmptyDigest(b) && lost(b.hash))) delete idx.manifests[text];
      } catch {
        delete idx.manifests[text];
      }
    }
  }

  // ---- fetching ----

  /**
   * Makes the manifest `digest` and every blob it names present: the manifest from the cache or the store,
   * small missing blobs by batch-read, large ones by streaming downloads (a few at once), all verified. With
   * `pin`, the blobs are pinned for that attempt before anything is looked up (see `pin`). With `subpath`, only
   * the blobs of that part of the tree are fetched and pinned (`part` is that part, null when the tree has no
   * such path); the manifest is then not counted as held whole (the `--list` cache line).
   */
  async fetchManifest(
    client: CasReader,
    digest: Digest,
    opts: { pin?: { id: string; lockFile: string }; subpath?: string } = {},
  ): Promise<FetchResult> {
    await this.init();
    let manifest: Manifest;
    let bytesFetched = 0;
    let manifestFetched = false;
    if (await this.has(digest)) {
      manifest = await this.readCachedManifest(digest);
    } else {
      const got = await client.getManifest(digest);
      await this.putBytes(digest, got.bytes);
      manifest = got.manifest;
      bytesFetched += got.bytes.length;
      manifestFetched = true;
    }
    const whole = opts.subpath === undefined || opts.subpath === "";
    const part = whole ? manifest : subManifest(manifest, opts.subpath!);
    const blobs = part === null ? [] : manifestStats(part).blobs.filter((b) => !isEmptyDigest(b));
    if (opts.pin !== undefined) {
      await this.pin(opts.pin.id, opts.pin.lockFile, [digest.hash, ...blobs.map((b) => b.hash)]);
    }
    const missing: Digest[] = [];
    await eachInSlices(blobs, SYNC_SLICE, (b) => {
      if (!this.hasSync(b)) missing.push(b);
    });
    const small = missing.filter((b) => b.size <= SMALL_BLOB);
    const large = missing.filter((b) => b.size > SMALL_BLOB);
    const groups = batches(small, 1000, MAX_BATCH_BYTES, (b) => b.size);
    // Batches of small blobs and downloads of large ones at once: the first are bound by round trips and the
    // CPU, the second by bytes moved, so together they take about the longer of the two, not the sum.
    const smallDone = eachLimited(groups, this.concurrency, async (group) => {
      const got = await client.batchRead(group);
      await eachInSlices(group, SMALL_WRITE_SLICE, (b) => {
        const data = got.get(b.hash);
        if (data === undefined)
          throw new DispatchCloudError("cas.not_found", `${formatDigest(b)} was not returned`);
        this.putBytesSync(b, data);
        bytesFetched += b.size;
      });
    });
    const largeDone = eachLimited(large, this.concurrency, async (b) => {
      const tmp = this.tmpName();
      try {
        await client.download(b, tmp);
        // The client hashed the bytes as it wrote them; the size is checked again here.
        if ((await stat(tmp)).size !== b.size) {
          throw new DispatchCloudError(
            "cas.digest_mismatch",
            `${formatDigest(b)}: the download has another size`,
          );
        }
      } catch (err) {
        await rm(tmp, { force: true });
        throw err;
      }
      await this.place(b, tmp);
      bytesFetched += b.size;
    });
    // Both settle before either's failure is thrown (no download left writing behind the caller's back).
    const [smallResult, largeResult] = await Promise.allSettled([smallDone, largeDone]);
    if (smallResult.status === "rejected") throw smallResult.reason;
    if (largeResult.status === "rejected") throw largeResult.reason;
    await this.record([digest, ...blobs], whole ? digest : undefined);
    return {
      manifest,
      part,
      blobsHit: blobs.length - missing.length,
      blobsFetched: missing.length + (manifestFetched ? 1 : 0),
      bytesFetched,
    };
  }

  /**
   * A manifest from the cache: checked as a manifest, but not again for canonical form (a cached blob's bytes
   * were hashed against its digest on the way in, and the digest is of the canonical bytes).
   */
  private async readCachedManifest(d: Digest): Promise<Manifest> {
    let value: unknown;
    try {
      value = JSON.parse(await readFile(this.blobPath(d), "utf8"));
    } catch (err) {
      if (err instanceof SyntaxError) return parseManifest(await readFile(this.blobPath(d)));
      throw err;
    }
    return validateManifest(value);
  }

  /** The manifests held in full, most recently used first, at most 256 (for the dispatcher's locality). */
  async heldManifests(): Promise<Digest[]> {
    return readHeldManifests(this.dir);
  }

  /** Blobs and bytes the index holds. */
  async usage(): Promise<{ items: number; bytes: number }> {
    return this.update((idx) => {
      let bytes = 0;
      const all = Object.values(idx.blobs);
      for (const [s] of all) bytes += s;
      return { items: all.length, bytes };
    });
  }
}

/** The small file beside the index listing the manifests held in full, most recently used first. */
export const heldManifestsFile = (cacheDir: string): string => path.join(cacheDir, "held-manifests");

/**
 * The manifests a cache holds in full, read without opening the cache (crunch-run `--list`): nothing when there
 * is no cache yet, and lines that are not digests are passed over, so a damaged file never breaks `--list`.
 */
export async function readHeldManifests(cacheDir: string): Promise<Digest[]> {
  let text: string;
  try {
    text = await readFile(heldManifestsFile(cacheDir), "utf8");
  } catch {
    return [];
  }
  const out: Digest[] = [];
  for (const line of text.split("\n").slice(0, MAX_HELD_MANIFESTS)) {
    try {
      if (line !== "") out.push(parseDigest(line));
    } catch {
      // Not a digest: passed over.
    }
  }
  return out;
}
