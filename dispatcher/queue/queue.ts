/**
 * The dispatcher's in-memory view of every active bundle (staged, starting, running): the whole queue, no
 * cut-off. Loaded once (paged by uuid), then read incrementally by change_seq, woken by NOTIFY on
 * BUNDLE_CHANNEL with `pollInterval` as the fallback, plus a slow full re-read as a safety net.
 *
 * Late commits: change_seq values are taken before commit, so a transaction can commit after a reader has
 * already seen a higher number. `safeSeq` is the highest sequence S such that every row with change_seq <= S
 * has been read: a sequence seen at time t becomes safe after a read that started at least `watermarkDelay`
 * after t (every transaction is assumed to commit within that delay of taking its number). Each read asks for
 * the rows above the highest sequence read and, by number, for the unread sequences between safeSeq and it (the
 * holes), so a read costs what it returns, however busy the window. After the load, and with more than
 * MAX_HOLES holes, a read takes every row above safeSeq; the numbers of that range it found no row for become
 * holes when they are few enough to name (endRescan), else the next read does the same, until they are safe.
 * Every row is applied idempotently: only when its change_seq is higher than the one known for its uuid.
 */
import type { Clock } from "../../lib/clock.ts";
import type { Logger } from "../../lib/logger.ts";
import type { Db } from "../../store/db.ts";
import {
  activeBundlesPage,
  bundlesChangedAfterOrIn,
  changeSeqOlderThan,
  getBundle,
  maxChangeSeq,
} from "../../store/queries.ts";
import { BUNDLE_CHANNEL, type Bundle, type BundleState } from "../../store/types.ts";
import type { QueueView } from "../types.ts";

/** The reason a sleeping loop is woken with (AbortController's default reason is a DOMException, with a stack). */
const WOKEN = Symbol("woken");

/** The change_seq a one-row NOTIFY names (`<uuid> <state> <change_seq>`); null for any other payload. */
export function notifiedSeq(payload: string): number | null {
  const parts = payload.split(" ");
  if (parts.length !== 3 || parts[0] === "*") return null;
  const seq = Number(parts[2]);
  return Number.isSafeInteger(seq) && seq > 0 ? seq : null;
}

/**
 * One change the queue learned of: a bundle's row with a newer change_seq. `from` is the state the queue held
 * for it (null: it was not in the queue); `to` is the row's state, active or not (a bundle leaving the queue is
 * a change to a final state, or back to `created`).
 */
export interface QueueChange {
  readonly uuid: string;
  readonly from: BundleState | null;
  readonly to: BundleState;
  readonly bundle: Bundle;
}

export interface BundleQueue extends QueueView {
  /** Incremental read by change_seq; returns the number of rows applied (that changed the queue). */
  refresh(): Promise<number>;
  /** apply() of many committed rows, the listeners told once for them all (a batch's rows from the REST server). */
  applyAll(bundles: readonly Bundle[]): void;
  /** Initial load (active bundles only, paged) + LISTEN + the fallback poll loop. */
  start(): Promise<void>;
  stop(): Promise<void>;
  /**
   * fn runs after any load, refresh or apply that changed something, with what changed (in the order applied);
   * returns an unsubscribe function. Rows of bundles the queue never held are left out unless final.
   */
  subscribe(fn: (changes: readonly QueueChange[]) => void): () => void;
  readonly size: number;
}

export interface BundleQueueOptions {
  db: Db;
  clock: Clock;
  logger: Logger;
  /** Fallback poll interval (ms) when no NOTIFY arrives. */
  pollInterval: number;
  /** Rows per query of the initial load, full re-reads and incremental reads. Default 5000. */
  pageSize?: number;
  /** How long a transaction may take between taking its change_seq and committing (ms). Default 2 s. */
  watermarkDelay?: number;
  /** Interval of the full re-read of active rows (ms). Default 5 min. */
  fullReloadInterval?: number;
}

const ACTIVE: ReadonlySet<BundleState> = new Set(["staged", "starting", "running"]);
const FINAL: ReadonlySet<BundleState> = new Set(["ready", "failed", "killed"]);
/** Unread sequences the queue asks for by number; with more, it reads every row above safeSeq until safe. */
const MAX_HOLES = 20_000;
/** How many recently ended bundles the queue remembers (for endedAt()). */
const MAX_ENDED = 100_000;

export function createBundleQueue(opts: BundleQueueOptions): BundleQueue {
  const { db, clock } = opts;
  const logger = opts.logger.child({ component: "queue" });
  const pageSize = opts.pageSize ?? 5000;
  const delay = opts.watermarkDelay ?? 2000;
  const fullReloadInterval = opts.fullReloadInterval ?? 5 * 60_000;

  const bundles = new Map<string, Bundle>();
  /** change_seq at which a uuid left the queue, kept only while a read is in flight (it may hold older rows). */
  const tombstones = new Map<string, number>();
  /** Bundles seen leaving the queue as ready or failed, and when. */
  const ended = new Map<string, number>();
  /**
   * change_seq of the row with which a uuid left the queue (or of a final row of one it never held), so a read
   * that brings the same row again (its NOTIFY, after apply() had it) changes nothing and tells nobody twice.
   */
  const left = new Map<string, number>();
  const listeners = new Set<(changes: readonly QueueChange[]) => void>();
  /** Changes applied since listeners were last told. */
  let pending: QueueChange[] = [];
  /** Every row with change_seq <= safeSeq has been read. */
  let safeSeq = 0;
  /** The highest sequence read; every later read asks for the rows above it. */
  let maxSeen = 0;
  /**
   * Sequences in (safeSeq, maxSeen] not read yet: a transaction that took its number may not have committed
   * (or its row changed again, or it rolled back). Each read asks for them by number, until they are safe.
   */
  const holes = new Set<number>();
  /** While safeSeq is below it, sequences up to it may be unread without being in `holes`: read all above safeSeq. */
  let rescanTo = 0;
  /** (time, highest sequence seen by then): each becomes safe `delay` after its time. */
  let history: { at: number; seq: number }[] = [];

  let tail: Promise<unknown> = Promise.resolve();
  let reading = false;
  /** uuids passed to apply() during a full re-read (kept even if the re-read did not see them). */
  let touched: Set<string> | null = null;

  let started = false;
  let stopped = false;
  let woken = false;
  let wake: AbortController | null = null;
  let loopDone: Promise<void> | null = null;
  let unlisten: (() => Promise<void>) | null = null;
  let nextFullReload = 0;

  /**
   * Runs reads one at a time. While one runs, rows that leave the queue through apply() are remembered
   * (tombstones), so an older row of that same read cannot bring them back.
   */
  const serial = <T>(fn: () => Promise<T>): Promise<T> => {
    const run = tail.then(async () => {
      tombstones.clear();
      reading = true;
      try {
        return await fn();
      } finally {
        reading = false;
        tombstones.clear();
      }
    });
    tail = run.catch(() => {});
    return run;
  };

  /**
   * Applies one row if it is newer than what is known of its uuid; returns whether the queue changed. The
   * change is noted for the listeners (also a final row of a bundle the queue never held).
   */
  function applyRow(b: Bundle): boolean {
    const cur = bundles.get(b.uuid);
    const known = cur?.changeSeq ?? tombstones.get(b.uuid) ?? left.get(b.uuid) ?? -1;
    if (b.changeSeq <= known) return false;
    const from = cur?.state ?? null;
    if (ACTIVE.has(b.state)) {
      // Once per bundle and problem (every status write is a new row of it).
      if (
        b.inputManifestsProblem !== undefined &&
        b.state === "staged" &&
        cur?.inputManifestsProblem !== b.inputManifestsProblem
      ) {
        logger.warn(
          { bundleUuid: b.uuid, reason: b.inputManifestsProblem },
          "bad input_manifests: no locality for it",
        );
      }
      bundles.set(b.uuid, b);
      pending.push({ uuid: b.uuid, from, to: b.state, bundle: b });
      return true;
    }
    if (reading) tombstones.set(b.uuid, b.changeSeq);
    left.delete(b.uuid);
    left.set(b.uuid, b.changeSeq);
    // Bounded: the oldest go first (a Map iterates in insertion order).
    if (left.size > MAX_ENDED) left.delete(left.keys().next().value as string);
    const final = FINAL.has(b.state);
    if (b.state === "ready" || b.state === "failed") {
      if (!ended.has(b.uuid)) ended.set(b.uuid, clock.now());
      // Bounded: the oldest go first (a Map iterates in insertion order).
      if (ended.size > MAX_ENDED) ended.delete(ended.keys().next().value as string);
    }
    if (cur !== undefined || final) pending.push({ uuid: b.uuid, from, to: b.state, bundle: b });
    return bundles.delete(b.uuid);
  }

  /** Tells the listeners what changed since they were last told (if anything did). */
  function notify(): void {
    if (pending.length === 0) return;
    const changes = pending;
    pending = [];
    for (const fn of [...listeners]) {
      try {
        fn(changes);
      } catch (err) {
        logger.error({ err }, "queue listener failed");
      }
    }
  }

  /** Reads every active row, paged by uuid; applies them; returns [rows applied, uuids seen]. */
  async function readActive(): Promise<[number, Set<string>]> {
    const seen = new Set<string>();
    let applied = 0;
    let after = "";
    for (;;) {
      const rows = await activeBundlesPage(db, after, pageSize);
      for (const row of rows) {
        seen.add(row.uuid);
        if (applyRow(row)) applied++;
      }
      const last = rows[rows.length - 1];
      if (last === undefined || rows.length < pageSize) return [applied, seen];
      after = last.uuid;
    }
  }

  function load(): Promise<number> {
    return serial(async () => {
      const t0 = clock.now();
      const top = await maxChangeSeq(db);
      // Rows written long enough ago (database clock) are committed and thus in the load below.
      const lower = Math.min(top, await changeSeqOlderThan(db, 2 * delay));
      const [applied] = await readActive();
      safeSeq = lower;
      // The rows of (lower, top] were read only if active: read them all again until they are safe.
      holes.clear();
      rescanTo = top;
      maxSeen = top;
      history = [{ at: clock.now(), seq: top }];
      nextFullReload = clock.now() + fullReloadInterval;
      logger.info({ bundles: bundles.size, ms: clock.now() - t0 }, "queue loaded");
      notify();
      return applied;
    });
  }

  function fullReload(): Promise<number> {
    return serial(async () => {
      touched = new Set();
      try {
        let [changed, seen] = await readActive();
        for (const uuid of [...bundles.keys()]) {
          // Not active when its page was read (so final now), and not applied since: it left the queue. Its
          // row as it is now says how (for the listeners); a row that cannot be read leaves it all the same.
          if (seen.has(uuid) || touched.has(uuid)) continue;
          const was = bundles.get(uuid);
          const row = await getBundle(db, uuid).catch(() => null);
          if (row === null || !applyRow(row)) {
            // Its change_seq did not move (or it cannot be read): it leaves all the same, as the row says.
            bundles.delete(uuid);
            if (was !== undefined)
              pending.push({ uuid, from: was.state, to: row?.state ?? was.state, bundle: row ?? was });
          }
          changed++;
        }
        nextFullReload = clock.now() + fullReloadInterval;
        logger.debug({ bundles: bundles.size, changed }, "queue re-read");
        notify();
        return changed;
      } finally {
        touched = null;
      }
    });
  }

  /** Notes a sequence read: no longer a hole; above maxSeen, the numbers it skipped are holes now. */
  function sawSeq(seq: number): void {
    holes.delete(seq);
    if (seq <= maxSeen) return;
    if (seq - maxSeen - 1 + holes.size > MAX_HOLES) rescanTo = Math.max(rescanTo, seq - 1);
    else for (let s = maxSeen + 1; s < seq; s++) holes.add(s);
    maxSeen = seq;
  }

  /**
   * A read of every row above safeSeq (too many holes to name, or the load's window) notes the numbers of
   * (safeSeq, to] that no row had, in order (the rows come by change_seq), as long as they are few enough to name.
   */
  interface Rescan {
    to: number;
    /** The highest number of the range read so far. */
    last: number;
    /** The numbers of the range no row had so far; null once more than could be named. */
    unread: number[] | null;
  }

  function rescanSaw(r: Rescan, seq: number): void {
    const upTo = Math.min(seq - 1, r.to);
    for (let n = r.last + 1; n <= upTo && r.unread !== null; n++) {
      r.unread.push(n);
      if (r.unread.length > MAX_HOLES) r.unread = null;
    }
    r.last = Math.max(r.last, Math.min(seq, r.to));
  }

  /**
   * After the rescan's read: the numbers of its range that no row had are all that can still come (a transaction
   * not committed yet; the others were taken by rows changed again, or by nothing). When they can be named, they
   * become holes and the reads stop taking every row above safeSeq: after a load whose window holds many fresh
   * rows, one read of them instead of one per read until they are safe.
   */
  function endRescan(r: Rescan): void {
    rescanSaw(r, r.to + 1);
    // A row read meanwhile may have asked for a wider rescan, or too many numbers were missing.
    if (rescanTo !== r.to || r.unread === null || r.unread.length + holes.size > MAX_HOLES) return;
    for (const seq of r.unread) holes.add(seq);
    rescanTo = 0;
  }

  function refresh(): Promise<number> {
    return serial(async () => {
      const start = clock.now();
      const seenBefore = maxSeen;
      let applied = 0;
      // The rows above maxSeen and the holes below it; all above safeSeq while too many holes to name.
      const rescan: Rescan | null = rescanTo > safeSeq ? { to: rescanTo, last: safeSeq, unread: [] } : null;
      let after = rescan !== null ? safeSeq : maxSeen;
      let wanted = rescan !== null ? [] : [...holes];
      for (;;) {
        const rows = await bundlesChangedAfterOrIn(db, after, wanted, pageSize);
        for (const row of rows) {
          if (applyRow(row)) applied++;
          sawSeq(row.changeSeq);
          if (rescan !== null) rescanSaw(rescan, row.changeSeq);
        }
        const last = rows[rows.length - 1]?.changeSeq;
        if (last === undefined || rows.length < pageSize) break;
        after = Math.max(after, last);
        wanted = wanted.filter((seq) => seq > last);
      }
      if (rescan !== null) endRescan(rescan);
      // Sequences seen at least `delay` before this read started are now safe: see the file comment.
      const safeBefore = safeSeq;
      while (history[0] !== undefined && history[0].at <= start - delay) {
        safeSeq = Math.max(safeSeq, history.shift()!.seq);
      }
      if (safeSeq > safeBefore) for (const seq of holes) if (seq <= safeSeq) holes.delete(seq);
      if (maxSeen > seenBefore) history.push({ at: clock.now(), seq: maxSeen });
      notify();
      return applied;
    });
  }

  async function waitForWake(): Promise<void> {
    const ms = Math.min(opts.pollInterval, nextFullReload - clock.now());
    if (!woken && ms > 0) {
      wake = new AbortController();
      await clock.sleep(ms, wake.signal).catch(() => {});
      wake = null;
    }
    woken = false;
  }

  async function loop(): Promise<void> {
    while (!stopped) {
      await waitForWake();
      if (stopped) break;
      try {
        if (clock.now() >= nextFullReload) await fullReload();
        await refresh();
      } catch (err) {
        logger.warn({ err }, "reading the bundle queue failed; retrying at the next wake-up");
      }
    }
  }

  /** A sequence this queue has read or applied (a NOTIFY naming it brings nothing new). */
  const seen = (seq: number) =>
    seq <= safeSeq || (seq <= maxSeen && !holes.has(seq) && (seq > rescanTo || rescanTo <= safeSeq));

  /**
   * Wakes the loop for a NOTIFY, except one naming a row's change this queue already has (`<uuid> <state>
   * <change_seq>`, most often a transition made in this process and applied before its NOTIFY came): a read for
   * it would bring nothing. A notice for many rows (`* <state> <n>`) always wakes it.
   */
  const wakeUp = (payload: string) => {
    const seq = notifiedSeq(payload);
    if (woken || (seq !== null && seen(seq))) return;
    woken = true;
    wake?.abort(WOKEN);
  };

  const applyAll = (rows: readonly Bundle[]) => {
    const seenBefore = maxSeen;
    for (const b of rows) {
      touched?.add(b.uuid);
      applyRow(b);
      // Committed: a read need not bring it again (the sequences it skipped are holes, as for a read row).
      sawSeq(b.changeSeq);
    }
    if (maxSeen > seenBefore) history.push({ at: clock.now(), seq: maxSeen });
    notify();
  };

  return {
    all: () => bundles.values(),
    get: (uuid) => bundles.get(uuid),
    endedAt: (uuid) => ended.get(uuid),
    apply: (bundle) => applyAll([bundle]),
    applyAll,
    refresh,
    async start() {
      if (started) throw new Error("queue already started");
      started = true;
      // LISTEN first, so nothing written after the load goes unnoticed.
      unlisten = await db.listen(BUNDLE_CHANNEL, wakeUp);
      try {
        await load();
      } catch (err) {
        await unlisten();
        unlisten = null;
        throw err;
      }
      woken = true;
      loopDone = loop();
    },
    async stop() {
      stopped = true;
      wake?.abort(WOKEN);
      await loopDone;
      await unlisten?.();
      unlisten = null;
    },
    subscribe(fn) {
      listeners.add(fn);
      return () => {
        listeners.delete(fn);
      };
    },
    get size() {
      return bundles.size;
    },
  };
}
