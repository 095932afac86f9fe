/**
 * What each user was recently told they may read in the content-addressed store, kept in the REST server's
 * memory so that find-missing and batch-read answer repeated questions without a database lookup per digest
 * (docs/storage.md, "find-missing and its cache"). Only positive answers are kept: a blob is added when an
 * upload of it was recorded for the user, or when a find-missing that touched it found it present and readable.
 * A blob missing from the cache is simply asked of the database.
 *
 * Why an entry stays true for its life without any message between REST servers: when it is added the blob's
 * `touched_at` is at most TOUCH_RESOLUTION_MS old, so garbage collection (on any server) cannot remove it before
 * `retention - TOUCH_RESOLUTION_MS` has passed; an entry lives at most `ttlMs`, which `cacheTtlFor` keeps well
 * inside that. Read rights are never taken away from a user, with one exception handled here: removing an image
 * ends its owner's right to the image tree's blobs, so the owner's entries are dropped (on the server that
 * removed it; on another server they end with their life).
 *
 * Two generations: entries go into the current one; when it is older than half the life or holds half the
 * entries allowed, it becomes the previous one and the older previous one is dropped. An entry therefore lives
 * between ttlMs/2 and ttlMs, and memory is bounded by maxEntries.
 */
import type { Digest } from "../../lib/cas/digest.ts";
import { TOUCH_RESOLUTION_MS } from "../../store/cas-queries.ts";

/** Longest life of a cached answer. */
export const MAX_CACHE_TTL_MS = 10 * 60_000;
/** Most entries kept (about 150 bytes each: a hash string and a map slot). */
export const MAX_CACHE_ENTRIES = 500_000;

/**
 * The life of a cached answer for a store whose retention is `retentionMs`: at most MAX_CACHE_TTL_MS and at
 * most half of what remains of the retention after TOUCH_RESOLUTION_MS; 0 (no cache) when nothing remains.
 */
export function cacheTtlFor(retentionMs: number): number {
  return Math.max(0, Math.min(MAX_CACHE_TTL_MS, Math.floor((retentionMs - TOUCH_RESOLUTION_MS) / 2)));
}

type Generation = { startedAt: number; size: number; byUser: Map<string, Map<string, number>> };

export class ReadableCache {
  private current: Generation;
  private previous: Generation | null = null;

  constructor(private readonly opts: { ttlMs: number; maxEntries?: number; nowMs: () => number }) {
    this.current = this.fresh();
  }

  get enabled(): boolean {
    return this.opts.ttlMs > 0;
  }

  private fresh(): Generation {
    return { startedAt: this.opts.nowMs(), size: 0, byUser: new Map() };
  }

  /** Rotates the generations when the current one is old or full; drops a previous one past its life. */
  private age(): void {
    const now = this.opts.nowMs();
    const half = this.opts.ttlMs / 2;
    if (this.previous !== null && now - this.previous.startedAt >= this.opts.ttlMs) this.previous = null;
    if (
      now - this.current.startedAt >= half ||
      this.current.size >= (this.opts.maxEntries ?? MAX_CACHE_ENTRIES) / 2
    ) {
      this.previous = now - this.current.startedAt >= this.opts.ttlMs ? null : this.current;
      this.current = this.fresh();
    }
  }

  /** Those of `digests` not known to be readable by the user (in order); all of them when the cache is off. */
  unknown(userUuid: string, digests: readonly Digest[]): Digest[] {
    if (!this.enabled) return [...digests];
    this.age();
    const cur = this.current.byUser.get(userUuid);
    const prev = this.previous?.byUser.get(userUuid);
    if (cur === undefined && prev === undefined) return [...digests];
    const out: Digest[] = [];
    for (const d of digests) {
      if (cur?.get(d.hash) === d.size || prev?.get(d.hash) === d.size) continue;
      out.push(d);
    }
    return out;
  }

  /** Records that the user may read these blobs, and that each is stored and was touched just now. */
  add(userUuid: string, digests: Iterable<Digest>): void {
    if (!this.enabled) return;
    this.age();
    const g = this.current;
    let m = g.byUser.get(userUuid);
    if (m === undefined) {
      m = new Map();
      g.byUser.set(userUuid, m);
    }
    const max = (this.opts.maxEntries ?? MAX_CACHE_ENTRIES) / 2;
    for (const d of digests) {
      if (g.size >= max) break;
      if (m.get(d.hash) === d.size) continue;
      m.set(ownCopy(d.hash), d.size);
      g.size++;
    }
  }

  /** Drops what the user was told (an image of theirs was removed). */
  forgetUser(userUuid: string): void {
    for (const g of [this.current, this.previous]) {
      const m = g?.byUser.get(userUuid);
      if (g == null || m === undefined) continue;
      g.size -= m.size;
      g.byUser.delete(userUuid);
    }
  }

  /** Drops everything (garbage collection removed blobs). */
  clear(): void {
    this.previous = null;
    this.current = this.fresh();
  }

  get size(): number {
    return this.current.size + (this.previous?.size ?? 0);
  }
}

/**
 * A string of its own for a key kept long: a hash cut from a request body by `slice` is a view that would keep
 * the whole body (up to megabytes) alive for as long as the entry lives.
 */
function ownCopy(s: string): string {
  return Buffer.from(s, "latin1").toString("latin1");
}
