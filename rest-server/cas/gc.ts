/**
 * Garbage collection of the content-addressed store (docs/storage.md, "Garbage collection and retention").
 * A blob is live when it was touched (uploaded, asked about by find-missing, named by a manifest being stored)
 * within the retention, or is named by a live manifest; a manifest is live when touched within the retention
 * or it is a bundle's output manifest, an image's tree (store/image-queries.ts), or the image tree an unfinished
 * bundle was pinned to (docs/images.md). Dead blobs are marked 'deleting' in one statement (an upload that
 * touched the row first keeps it; one that meets the mark answers cas.busy), their bytes removed, then their
 * rows. Partial uploads older than a day are removed too. Once a day (the first collection after start, then
 * every ORPHAN_SWEEP_EVERY_MS) the backend's whole list is read for bytes the store has no row for, which go
 * the same way (markOrphanBlobs): an upload that ended between writing its bytes and recording them leaves such
 * bytes, and nothing else would ever remove them.
 */
import { readdir, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import type { Digest } from "../../lib/cas/digest.ts";
import type { Clock } from "../../lib/clock.ts";
import type { Logger } from "../../lib/logger.ts";
import { deletingBlobs, forgetBlobs, markDeadBlobs, markOrphanBlobs } from "../../store/cas-queries.ts";
import type { Db } from "../../store/db.ts";
import type { BlobBackend } from "./backend.ts";

/** Partial uploads kept for resuming are removed after this long without a write. */
export const PARTIAL_UPLOAD_MAX_AGE_MS = 86_400_000;
const BATCH = 1000;
/** How often a collection also looks for bytes without a row (it reads the backend's whole list). */
export const ORPHAN_SWEEP_EVERY_MS = 86_400_000;

export interface CasGcOptions {
  db: Db;
  backend: BlobBackend;
  clock: Pick<Clock, "now">;
  retentionMs: number;
  /** `<dataDir>/cas-partial`: `<user uuid>/<hash>-<size>` files of interrupted uploads. */
  partialDir: string;
  logger?: Logger;
  /** Called after a collection that removed blobs. */
  onCollected?: () => void;
}

export interface GcResult {
  /** Blobs removed, with their bytes: dead ones, and orphans (bytes without a row, also counted below). */
  blobs: number;
  bytes: number;
  partials: number;
  /** Blobs removed because the store had no row for them; null when this collection did not look. */
  orphans: number | null;
}

export interface CasGc {
  /** One collection, to the end. */
  gcOnce(): Promise<GcResult>;
  /** Collects every intervalMs (sleeping on `sleep`, so a FakeClock drives it) until stop(). */
  start(intervalMs: number, sleep: Clock["sleep"]): void;
  stop(): Promise<void>;
}

export function createCasGc(opts: CasGcOptions): CasGc {
  const { db, backend } = opts;
  let running: Promise<void> | null = null;
  let abort: AbortController | null = null;

  const removeBlobs = async (blobs: { hash: string; size: number }[], result: GcResult) => {
    for (const b of blobs) await backend.delete(b);
    await forgetBlobs(
      db,
      blobs.map((b) => b.hash),
    );
    result.blobs += blobs.length;
    for (const b of blobs) result.bytes += b.size;
  };

  const sweepPartials = async (): Promise<number> => {
    let removed = 0;
    let users: string[];
    try {
      users = await readdir(opts.partialDir);
    } catch {
      return 0;
    }
    const cutoff = opts.clock.now() - PARTIAL_UPLOAD_MAX_AGE_MS;
    for (const u of users) {
      let names: string[];
      try {
        names = await readdir(join(opts.partialDir, u));
      } catch {
        continue;
      }
      for (const n of names) {
        const f = join(opts.partialDir, u, n);
        try {
          if ((await stat(f)).mtimeMs < cutoff) {
            await rm(f, { force: true });
            removed++;
          }
        } catch {
          // gone meanwhile
        }
      }
    }
    return removed;
  };

  let lastOrphanSweep: number | null = null;
  const sweepOrphans = async (result: GcResult): Promise<number> => {
    let removed = 0;
    let held: Digest[] = [];
    const flush = async () => {
      const orphans = await markOrphanBlobs(db, held, new Date(opts.clock.now()));
      held = [];
      await removeBlobs(orphans, result);
      removed += orphans.length;
    };
    for await (const d of backend.list()) {
      held.push(d);
      if (held.length >= BATCH) await flush();
    }
    await flush();
    return removed;
  };

  const gcOnce = async (): Promise<GcResult> => {
    const result: GcResult = { blobs: 0, bytes: 0, partials: 0, orphans: null };
    // A collection that stopped half-way left rows 'deleting': finish them first.
    for (;;) {
      const left = await deletingBlobs(db, BATCH);
      if (left.length === 0) break;
      await removeBlobs(left, result);
    }
    const cutoff = new Date(opts.clock.now() - opts.retentionMs);
    for (;;) {
      const dead = await markDeadBlobs(db, cutoff, BATCH);
      if (dead.length === 0) break;
      await removeBlobs(dead, result);
    }
    result.partials = await sweepPartials();
    const now = opts.clock.now();
    if (lastOrphanSweep === null || now - lastOrphanSweep >= ORPHAN_SWEEP_EVERY_MS) {
      lastOrphanSweep = now;
      result.orphans = await sweepOrphans(result);
    }
    if (result.blobs > 0) opts.onCollected?.();
    if (result.blobs > 0 || result.partials > 0) {
      opts.logger?.info({ ...result, backend: backend.kind }, "content-addressed store collected");
    }
    return result;
  };

  return {
    gcOnce,
    start(intervalMs, sleep) {
      if (running !== null) return;
      abort = new AbortController();
      const signal = abort.signal;
      running = (async () => {
        while (!signal.aborted) {
          try {
            await sleep(intervalMs, signal);
          } catch {
            return;
          }
          try {
            await gcOnce();
          } catch (err) {
            opts.logger?.warn({ err }, "content-addressed store collection failed; retried next interval");
          }
        }
      })();
    },
    async stop() {
      abort?.abort();
      await running;
      running = null;
    },
  };
}
