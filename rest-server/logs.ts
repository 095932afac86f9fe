/**
 * Reading bundle logs: the users' `GET /bundles/:uuid/logs` streams the stored chunks of one stream of one
 * attempt, and with follow=1 keeps the response open, waking on the database's NOTIFY (LOG_CHANNEL for new
 * chunks, BUNDLE_CHANNEL for state changes) with a poll as the fallback, until the bundle is final (or a newer
 * attempt started) and every chunk has been sent.
 */

import { Readable } from "node:stream";
import type { Logger } from "pino";
import { DispatchCloudError } from "../lib/errors.ts";
import type { Db } from "../store/db.ts";
import { getBundle, readLogChunks } from "../store/queries.ts";
import { BUNDLE_CHANNEL, isFinalState, LOG_CHANNEL, LOG_STREAMS, type LogStream } from "../store/types.ts";
import { createKeyedWaiters, type KeyedWaiters } from "./keyed-waiters.ts";

/** Chunks read per query (each at most 1 MiB). */
const CHUNKS_PER_READ = 8;

export interface LogQuery {
  stream: LogStream;
  follow: boolean;
  /** null = the bundle's current attempt. */
  attempt: number | null;
}

const badQuery = (path: string, message: string) =>
  new DispatchCloudError("request.invalid_query", `${path}: ${message}`, { path });

function single(key: string, raw: unknown): string {
  if (Array.isArray(raw)) throw badQuery(key, "given more than once");
  return String(raw);
}

/** `stream` must be stdout or stderr (default stdout). */
export function parseStream(raw: unknown): LogStream {
  if (raw === undefined) return "stdout";
  const s = single("stream", raw);
  if (!(LOG_STREAMS as readonly string[]).includes(s)) {
    throw badQuery(
      "stream",
      `must be one of ${LOG_STREAMS.join(", ")}, not ${JSON.stringify(s.slice(0, 40))}`,
    );
  }
  return s as LogStream;
}

/** The largest PostgreSQL integer (int4), for numbers stored in such a column (attempt). */
export const MAX_INT4 = 2 ** 31 - 1;

/**
 * A whole number in decimal from min to max (default 2^53 - 1, within PostgreSQL's bigint); the bounds are
 * those of the column the number is compared with, so the database never sees one out of its range.
 */
export function parseCount(key: string, raw: unknown, min = 0, max = Number.MAX_SAFE_INTEGER): number {
  const s = single(key, raw);
  const n = Number(s);
  if (!/^(0|[1-9][0-9]{0,15})$/.test(s) || !Number.isSafeInteger(n) || n < min || n > max) {
    throw badQuery(
      key,
      `must be a whole number from ${min} to ${max}, not ${JSON.stringify(s.slice(0, 40))}`,
    );
  }
  return n;
}

/** `?stream=stdout|stderr&follow=1&attempt=N`; anything else is refused. */
export function parseLogQuery(query: unknown): LogQuery {
  const out: LogQuery = { stream: "stdout", follow: false, attempt: null };
  for (const [key, raw] of Object.entries((query ?? {}) as Record<string, unknown>)) {
    if (key === "stream") out.stream = parseStream(raw);
    else if (key === "follow") {
      const v = single(key, raw);
      if (!["0", "1", "true", "false"].includes(v)) throw badQuery(key, "must be 1 or 0");
      out.follow = v === "1" || v === "true";
    } else if (key === "attempt") out.attempt = parseCount(key, raw, 1, MAX_INT4);
    else throw badQuery(key, "unknown query parameter; known: stream, follow, attempt");
  }
  return out;
}

/**
 * Wakes log followers of a bundle (rest-server/keyed-waiters.ts): a stored chunk (LOG_CHANNEL) or a transition
 * (BUNDLE_CHANNEL) of the bundle. One LISTEN per channel per server, shared by every follower; closing wakes every
 * follower for good (they end their responses).
 */
export type LogNotifier = KeyedWaiters;

export function createLogNotifier(db: Db, logger: Logger): LogNotifier {
  return createKeyedWaiters({
    db,
    channels: [LOG_CHANNEL, BUNDLE_CHANNEL],
    keyOf: (payload) => payload.split(" ", 1)[0] ?? "",
    logger,
    listenFailed: "cannot listen for log notifications; followers poll",
  });
}

export interface LogReadArgs {
  db: Db;
  notifier: LogNotifier;
  uuid: string;
  stream: LogStream;
  /** The attempt to read. */
  attempt: number;
  /** The attempt was not given by the caller: a follower of attempt 0 (not started yet) moves to attempt 1. */
  attemptDefaulted: boolean;
  follow: boolean;
  pollIntervalMs: number;
  logger: { warn(obj: object, msg: string): void };
}

/**
 * The bytes of one stream of one attempt as a Readable; a follower waits for more until the bundle is final
 * or a newer attempt has started, and everything stored is sent.
 */
export function logReadable(args: LogReadArgs): Readable {
  const { db, notifier, uuid, stream } = args;
  const ac = new AbortController();
  let attempt = args.attempt;
  let sent = 0;
  let sawEnd = false;
  const pending: Buffer[] = [];

  async function next(): Promise<Buffer | null> {
    for (;;) {
      const chunk = pending.shift();
      if (chunk !== undefined) return chunk;
      if (ac.signal.aborted) return null;
      const watch = args.follow && !sawEnd ? await notifier.watch(uuid) : null;
      try {
        const chunks =
          attempt === 0
            ? []
            : await readLogChunks(db, { uuid, attempt, stream, from: sent, limit: CHUNKS_PER_READ });
        for (const c of chunks) {
          const data = c.offset < sent ? c.data.subarray(sent - c.offset) : c.data;
          if (data.length === 0) continue;
          pending.push(data);
          sent = c.offset + c.data.length;
        }
        if (pending.length > 0) continue;
        if (!args.follow || sawEnd || notifier.closed) return null;
        const b = await getBundle(db, uuid);
        if (b === null) return null;
        if (attempt === 0 && args.attemptDefaulted && b.attempt > 0) {
          attempt = 1;
          continue;
        }
        if (isFinalState(b.state) || b.attempt !== attempt) {
          // Every chunk of this attempt committed before the state changed: one more read gets the rest.
          sawEnd = true;
          continue;
        }
        await watch?.wait(args.pollIntervalMs, ac.signal);
      } finally {
        watch?.cancel();
      }
    }
  }

  let reading = false;
  const readable = new Readable({
    read() {
      if (reading) return;
      reading = true;
      next().then(
        (buf) => {
          reading = false;
          readable.push(buf);
        },
        (err: unknown) => {
          reading = false;
          args.logger.warn({ err, bundle: uuid }, "reading a log failed");
          readable.destroy(err instanceof Error ? err : new Error(String(err)));
        },
      );
    },
    destroy(err, callback) {
      ac.abort();
      callback(err);
    },
  });
  return readable;
}
