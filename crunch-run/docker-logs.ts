/**
 * A container's stdout and stderr through the Docker Engine API, without losing its end.
 *
 * The log is followed (`logs?follow=1&timestamps=1`) and docker's multiplexed stream is split into the two
 * streams. Following alone is not enough: docker 20.10's json-file follower may stop at the container's exit
 * before it has read the last entries (it races the logger's close against the file's last write), and a follow
 * may break while the container runs (a daemon restart, a reader error). So each entry's timestamp is kept, and:
 *
 * - when the follow ends and the container has exited, the end of the log is read once more (`tail=N`, N growing
 *   until the answer reaches back to the last entry delivered) and whatever comes after that entry is delivered;
 * - when the follow ends or breaks while the container runs, it is resumed from a little before the oldest of
 *   the two streams' last timestamps (`since=`), at most MAX_RESUMES times.
 *
 * Entries read twice are recognised per stream: docker stamps each stream's entries in the order they are
 * written, so an entry of a stream older than that stream's last delivered one, or as old and within the count
 * already delivered at that instant, was delivered before. Docker's timestamps have nanosecond resolution, so two
 * entries of one stream at the same instant are not expected; if they occur, the count keeps them apart.
 */
import type { Readable } from "node:stream";
import { DockerApiError, type DockerClient } from "./docker-api.ts";

/** One entry of a container's log: 1 stdout, 2 stderr; ts is docker's RFC 3339 time in UTC, "" if absent. */
export interface LogEntry {
  stream: 1 | 2;
  ts: string;
  data: Buffer;
}

/** Docker's timestamps=1 prefix: RFC 3339 with 9 fraction digits, UTC, then one space (fixed width). */
const TS_LENGTH = 30;
const TS_SHAPE = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$/;

/** How many times a follow that ended while the container runs is resumed before giving up. */
export const MAX_RESUMES = 5;
/** A resume asks for entries from this long before the oldest last timestamp (the rest is recognised). */
const RESUME_MARGIN_S = 1;
const RESUME_DELAY_MS = 200;
/** The end is read again with tail=N for these N, then as a whole. */
const TAIL_STEPS = [64, 512, 4096, 32768];
/**
 * Most bytes of one tail=N read held in memory (its entries wait until the read is known to reach back); past
 * them the end is read again as the whole log, entry by entry, so long lines cannot make the supervisor large.
 */
const END_BUFFER_MAX_BYTES = 8 * 2 ** 20;

/**
 * Splits docker's multiplexed stream (8-byte frame headers: stream byte, 3 zero bytes, big-endian length) into
 * entries, each frame one entry with its timestamp prefix taken off.
 */
export class FrameReader {
  private pending: Buffer = Buffer.alloc(0);

  push(chunk: Buffer, each: (e: LogEntry) => void): void {
    this.pending = this.pending.length === 0 ? chunk : Buffer.concat([this.pending, chunk]);
    while (this.pending.length >= 8) {
      const size = this.pending.readUInt32BE(4);
      if (this.pending.length < 8 + size) break;
      const stream = this.pending[0] === 2 ? 2 : 1;
      const payload = this.pending.subarray(8, 8 + size);
      this.pending = this.pending.subarray(8 + size);
      each(entryOf(stream, payload));
    }
  }

  /** Bytes of an incomplete frame left over (a stream cut mid-frame). */
  get leftover(): number {
    return this.pending.length;
  }
}

function entryOf(stream: 1 | 2, payload: Buffer): LogEntry {
  if (payload.length > TS_LENGTH && payload[TS_LENGTH] === 0x20) {
    const ts = payload.toString("latin1", 0, TS_LENGTH);
    if (TS_SHAPE.test(ts)) return { stream, ts, data: payload.subarray(TS_LENGTH + 1) };
  }
  return { stream, ts: "", data: payload };
}

/** docker's `since=` for a timestamp, less some seconds: "<unix seconds>.<nanoseconds>". */
export function sinceParam(ts: string, lessSeconds: number): string {
  const seconds = Date.parse(`${ts.slice(0, 19)}Z`) / 1000 - lessSeconds;
  return `${Math.max(0, seconds)}.${ts.slice(20, 29)}`;
}

/** What was delivered of each stream: its last timestamp and how many entries carried it. */
export class LogCursor {
  private readonly last: {
    1: { ts: string; count: number } | null;
    2: { ts: string; count: number } | null;
  } = {
    1: null,
    2: null,
  };
  /** The last entry delivered of either stream: its stream (0: none yet) and timestamp. */
  private lastStream: 0 | 1 | 2 = 0;
  private lastTs = "";
  /** An entry came without a timestamp: nothing read again could be recognised, so nothing is read again. */
  untimed = false;

  /** Whether anything with a timestamp was delivered. */
  get delivered(): boolean {
    return this.lastStream !== 0;
  }

  record(e: LogEntry): void {
    if (e.ts === "") {
      this.untimed = true;
      return;
    }
    const l = this.last[e.stream];
    if (l !== null && l.ts === e.ts) l.count++;
    else this.last[e.stream] = { ts: e.ts, count: 1 };
    this.lastStream = e.stream;
    this.lastTs = e.ts;
  }

  /** For one read again: a filter that is true for entries not delivered yet. */
  unseen(): (e: LogEntry) => boolean {
    const skip = {
      1: this.last[1] === null ? null : { ...this.last[1] },
      2: this.last[2] === null ? null : { ...this.last[2] },
    };
    return (e) => {
      const s = skip[e.stream];
      if (s === null || e.ts > s.ts) return true;
      if (e.ts < s.ts) return false;
      if (s.count > 0) {
        s.count--;
        return false;
      }
      return true;
    };
  }

  /** Whether a read of the log's end reaches back to the last entry delivered (so it holds all that follows). */
  reachesBack(entries: readonly LogEntry[]): boolean {
    const stream = this.lastStream;
    return stream === 0 || entries.some((e) => e.stream === stream && e.ts !== "" && e.ts <= this.lastTs);
  }

  /** The `since=` of a resumed follow: before the older of the two streams' last timestamps. */
  resumeSince(): string | null {
    const times = [this.last[1]?.ts, this.last[2]?.ts].filter((t): t is string => t !== undefined);
    if (times.length === 0) return null;
    return sinceParam(times.sort()[0] as string, RESUME_MARGIN_S);
  }
}

export interface FollowTargets {
  stdout: NodeJS.WritableStream;
  stderr: NodeJS.WritableStream;
}

/**
 * Follows container `id`'s log into stdout and stderr until the container has exited and its log has been read
 * to the end; then ends both. Never rejects: a log that cannot be read to the end says so on stderr.
 */
export async function followContainerLog(docker: DockerClient, id: string, to: FollowTargets): Promise<void> {
  const cursor = new LogCursor();
  const deliver = (e: LogEntry) => {
    cursor.record(e);
    (e.stream === 2 ? to.stderr : to.stdout).write(e.data);
  };
  const base = `/containers/${id}/logs?stdout=1&stderr=1&timestamps=1`;
  let lastError: Error | null = null;
  try {
    for (let resumes = 0; ; resumes++) {
      const since = resumes === 0 ? null : cursor.resumeSince();
      const keep = resumes === 0 ? () => true : cursor.unseen();
      try {
        await readEntries(docker, `${base}&follow=1${since === null ? "" : `&since=${since}`}`, (e) => {
          if (keep(e)) deliver(e);
        });
        lastError = null;
      } catch (err) {
        lastError = err as Error;
      }
      if (cursor.untimed) break;
      const running = await isRunning(docker, id);
      if (running === false) {
        await readEnd(docker, base, cursor, deliver);
        lastError = null;
        break;
      }
      if (resumes >= MAX_RESUMES) {
        lastError ??= new Error(`the log stream ended ${MAX_RESUMES + 1} times while the container ran`);
        break;
      }
      await new Promise((r) => setTimeout(r, RESUME_DELAY_MS * (resumes + 1)));
    }
  } catch (err) {
    lastError = err as Error;
  }
  if (lastError !== null) {
    to.stderr.write(`[crunch-run] lost the container's log stream: ${lastError.message}\n`);
  }
  to.stdout.end();
  to.stderr.end();
}

/** Reads the log's end again until the read reaches back to the last entry delivered, and delivers the rest. */
async function readEnd(
  docker: DockerClient,
  base: string,
  cursor: LogCursor,
  deliver: (e: LogEntry) => void,
): Promise<void> {
  if (cursor.delivered) {
    for (const n of TAIL_STEPS) {
      const entries: LogEntry[] = [];
      let bytes = 0;
      const tooLarge = new AbortController();
      const read = readEntries(
        docker,
        `${base}&tail=${n}`,
        (e) => {
          bytes += e.data.length;
          if (bytes > END_BUFFER_MAX_BYTES) tooLarge.abort();
          else entries.push(e);
        },
        tooLarge.signal,
      );
      await read.catch((err: unknown) => {
        if (!tooLarge.signal.aborted) throw err;
      });
      if (tooLarge.signal.aborted) break;
      if (entries.length < n || cursor.reachesBack(entries)) {
        const keep = cursor.unseen();
        for (const e of entries) if (keep(e)) deliver(e);
        return;
      }
    }
  }
  const keep = cursor.unseen();
  await readEntries(docker, base, (e) => {
    if (keep(e)) deliver(e);
  });
}

/** One logs request, entry by entry; resolves at its end (or once `signal` stops it), rejects if it breaks. */
async function readEntries(
  docker: DockerClient,
  path: string,
  each: (e: LogEntry) => void,
  signal?: AbortSignal,
): Promise<void> {
  const res: Readable = await docker.stream("GET", path, signal === undefined ? {} : { signal });
  const frames = new FrameReader();
  await new Promise<void>((resolve, reject) => {
    res.on("data", (chunk: Buffer) => frames.push(chunk, each));
    res.on("end", () => resolve());
    res.on("error", reject);
    res.on("close", () => resolve());
  });
}

/** Whether the container still runs (a container that is gone does not); null when the daemon cannot say. */
async function isRunning(docker: DockerClient, id: string): Promise<boolean | null> {
  try {
    const info = await docker.json<{ State?: { Running?: boolean } }>("GET", `/containers/${id}/json`);
    return info.State?.Running === true;
  } catch (err) {
    return err instanceof DockerApiError && err.status === 404 ? false : null;
  }
}
