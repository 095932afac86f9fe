/**
 * The content-addressed store's API (docs/storage.md, "The API"): find-missing, batch upload and read,
 * streaming uploads (compressed or not, resumable) and downloads (ranges, gzip), and manifests. Users' tokens
 * and runner tokens are both accepted: a runner acts for its bundle's owner (what it uploads belongs to the
 * owner) and reads what the owner may read plus its dependencies' output manifests and their blobs, and the
 * image tree its bundle was pinned to.
 *
 * Every write is verified before it is stored: the body is inflated with a size guard (the digest's size),
 * hashed and written to a partial file under `<dataDir>/cas-partial/<user>/`, which an interrupted upload
 * leaves behind for a resume (HEAD /cas/uploads/...). Bodies are streamed, never buffered whole (manifests and
 * batches aside, which are bounded).
 */
import { randomBytes } from "node:crypto";
import { createReadStream } from "node:fs";
import { mkdir, open, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import { pipeline, Readable } from "node:stream";
import { createBrotliDecompress, createGunzip, createGzip, createInflate, gzipSync } from "node:zlib";
import { Type } from "@sinclair/typebox";
import type { FastifyInstance, FastifyReply, FastifyRequest } from "fastify";
import { BATCH_BINARY_TYPE, type BatchEntry, joinBatch } from "../../lib/cas/batch.ts";
import {
  type Digest,
  DigestBuilder,
  digestBytes,
  digestOf,
  formatDigest,
  isEmptyDigest,
  parseDigest,
  parseDigestList,
  sameDigest,
} from "../../lib/cas/digest.ts";
import { type Manifest, manifestStats, parseManifest } from "../../lib/cas/manifest.ts";
import { eachInSlices, eachLimited } from "../../lib/cas/tree.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import { allowSlowUpload } from "../../lib/http-timeouts.ts";
import { RUNNER_TOKEN_PREFIX } from "../../lib/tokens.ts";
import {
  beginUpload,
  type CasReader,
  canRead,
  findMissing,
  outputManifestsOf,
  recordUpload,
  recordUploads,
  touchReadable,
} from "../../store/cas-queries.ts";
import type { Db } from "../../store/db.ts";
import { authenticateRunner, authenticateUser, bearerToken } from "../auth.ts";
import type { RouteContext } from "../context.ts";
import { validate } from "../validate.ts";
import type { BlobBackend } from "./backend.ts";
import type { CasMetrics } from "./metrics.ts";

/** What the CAS routes need besides the RouteContext. */
export interface CasContext {
  backend: BlobBackend;
  /** `<dataDir>/cas-partial`. */
  partialDir: string;
  /** Largest batch (cas.maxBatchBytes): the blobs' bytes of one batch upload or read. */
  maxBatchBytes: number;
  metrics: CasMetrics | null;
}

export const MAX_FIND_MISSING = 10_000;
export const MAX_BATCH_READ = 1_000;
/** Blobs of one batch read from the backend at once. */
const BATCH_READ_CONCURRENCY = 16;
/** Blobs of one batch read by synchronous calls between two turns of the event loop (about 5 ms of reads). */
const BATCH_READ_SLICE = 100;
/** Largest blob of a batch upload or read. */
export const MAX_BATCH_BLOB = 2 ** 20;
/** Largest manifest (its canonical JSON). */
export const MAX_MANIFEST_BYTES = 256 * 2 ** 20;

const PREFIX = "/api/v1/cas";

export const FindMissingRequest = Type.Object(
  { digests: Type.Array(Type.String({ maxLength: 100 }), { maxItems: MAX_FIND_MISSING }) },
  { additionalProperties: false },
);
export const BatchReadRequest = Type.Object(
  { digests: Type.Array(Type.String({ maxLength: 100 }), { maxItems: MAX_BATCH_READ }) },
  { additionalProperties: false },
);
export const BatchUploadRequest = Type.Object(
  {
    blobs: Type.Array(
      Type.Object(
        { digest: Type.String({ maxLength: 100 }), data: Type.String() },
        { additionalProperties: false },
      ),
      { maxItems: MAX_BATCH_READ },
    ),
  },
  { additionalProperties: false },
);

interface Caller {
  reader: CasReader;
  /** The user whose blobs uploads become (the runner's bundle's owner). */
  owner: string;
}

const callers = new WeakMap<FastifyRequest, Caller>();

function callerOf(request: FastifyRequest): Caller {
  const c = callers.get(request);
  if (c === undefined) throw new Error("CAS route without its authentication hook");
  return c;
}

const notFound = (d: Digest) =>
  new DispatchCloudError("cas.not_found", `no blob ${formatDigest(d)} readable by the caller`);
const tooLarge = (why: string) => new DispatchCloudError("cas.too_large", why);
const busy = (d: Digest) =>
  new DispatchCloudError(
    "cas.busy",
    `blob ${formatDigest(d)} is being removed by garbage collection right now; retry the upload`,
  );

function digestParam(request: FastifyRequest): Digest {
  const p = request.params as { hash?: string; size?: string };
  return digestOf(p.hash ?? "", p.size ?? "", "digest");
}

type Encoding = "identity" | "gzip" | "deflate" | "br";

function contentEncoding(request: FastifyRequest): Encoding {
  const raw = (request.headers["content-encoding"] ?? "identity").toString().trim().toLowerCase();
  if (raw === "" || raw === "identity") return "identity";
  if (raw === "gzip" || raw === "x-gzip") return "gzip";
  if (raw === "deflate" || raw === "br") return raw;
  throw new DispatchCloudError(
    "cas.unsupported_encoding",
    `Content-Encoding ${JSON.stringify(raw)} is not supported; use identity, gzip, deflate or br`,
  );
}

/** The body as an async iterable of Buffers (nothing when there is none). */
function bodyOf(request: FastifyRequest): AsyncIterable<Buffer> {
  const body = request.body as AsyncIterable<Buffer> | undefined | null;
  if (body !== undefined && body !== null && Symbol.asyncIterator in Object(body)) return body;
  if (Buffer.isBuffer(body)) return Readable.from([body]);
  return Readable.from([]);
}

class Interrupted extends Error {}

/**
 * The uncompressed bytes of the body, refusing (cas.too_large) as soon as they pass `limit`; a body that
 * breaks off throws Interrupted.
 */
async function* inflated(request: FastifyRequest, encoding: Encoding, limit: number): AsyncGenerator<Buffer> {
  const source = Readable.from(bodyOf(request));
  let clientError: unknown = null;
  source.on("error", (err) => {
    clientError = err;
  });
  const out =
    encoding === "identity"
      ? source
      : pipeline(
          source,
          encoding === "gzip"
            ? createGunzip()
            : encoding === "deflate"
              ? createInflate()
              : createBrotliDecompress(),
          () => {},
        );
  let n = 0;
  try {
    for await (const chunk of out) {
      const buf = chunk as Buffer;
      n += buf.length;
      if (n > limit) throw tooLarge(`the upload inflates beyond the digest's ${limit} bytes`);
      yield buf;
    }
  } catch (err) {
    if (err instanceof DispatchCloudError) throw err;
    if (clientError !== null || (err as NodeJS.ErrnoException).code === "ECONNRESET" || isAbort(err)) {
      throw new Interrupted("the request body was interrupted", { cause: err });
    }
    throw new DispatchCloudError(
      "request.invalid_body",
      `the body is not valid ${encoding} data: ${(err as Error).message}`,
      { cause: err },
    );
  } finally {
    out.destroy();
    source.destroy();
  }
}

function isAbort(err: unknown): boolean {
  const code = (err as NodeJS.ErrnoException | null)?.code;
  return (
    code === "ECONNRESET" || code === "ERR_STREAM_PREMATURE_CLOSE" || (err as Error)?.name === "AbortError"
  );
}

/** The first bytes of compressed formats: such blobs are sent as they are even to a gzip-accepting client. */
const COMPRESSED_MAGIC = [
  [0x1f, 0x8b], // gzip
  [0x28, 0xb5, 0x2f, 0xfd], // zstd
  [0xfd, 0x37, 0x7a, 0x58, 0x5a, 0x00], // xz
  [0x42, 0x5a, 0x68], // bzip2
  [0x50, 0x4b, 0x03, 0x04], // zip
  [0x89, 0x50, 0x4e, 0x47], // png
  [0xff, 0xd8, 0xff], // jpeg
];

export function looksCompressed(head: Uint8Array): boolean {
  return COMPRESSED_MAGIC.some((m) => m.length <= head.length && m.every((b, i) => head[i] === b));
}

/**
 * Bytes of a blob's start that a trial compression looks at before the server gzips a download: 4 KiB costs
 * about a tenth of a millisecond (64 KiB cost 1.5 ms, most of the server's CPU for a download of random data).
 */
const GZIP_TRIAL_BYTES = 4 * 1024;

/**
 * Whether gzipping a download pays: not a compressed format, not tiny, and a fast trial on its first bytes
 * shrinks them by a tenth. Random or already-compressed data would only cost both sides CPU.
 */
export function worthGzip(head: Buffer): boolean {
  if (head.length < 512 || looksCompressed(head)) return false;
  const trial = head.subarray(0, GZIP_TRIAL_BYTES);
  return gzipSync(trial, { level: 1 }).length < trial.length * 0.9;
}

/**
 * The stream's first chunk (null when it is empty), and a stream of all its bytes, that first chunk included:
 * a download looks at its first bytes without opening the blob twice.
 */
async function peekStream(s: Readable): Promise<{ head: Buffer | null; all: Readable }> {
  const it = s[Symbol.asyncIterator]();
  const first = await it.next();
  async function* all(): AsyncGenerator<Buffer> {
    try {
      if (first.done) return;
      yield first.value as Buffer;
      for (;;) {
        const n = await it.next();
        if (n.done) return;
        yield n.value as Buffer;
      }
    } finally {
      s.destroy();
    }
  }
  return {
    head: first.done ? null : (first.value as Buffer),
    all: Readable.from(all(), { objectMode: false }),
  };
}

async function readAll(s: Readable): Promise<Buffer> {
  const parts: Buffer[] = [];
  for await (const c of s) parts.push(c as Buffer);
  return Buffer.concat(parts);
}

/** `bytes=N-` or `bytes=N-M` (inclusive M): [start, end) within size, or null for the whole blob. */
function parseRange(header: string | undefined, d: Digest): { start: number; end: number } | null {
  if (header === undefined) return null;
  const m = /^bytes=(\d{1,16})-(\d{0,16})$/.exec(header.trim());
  if (m === null) {
    throw new DispatchCloudError("request.invalid_param", "Range: must be bytes=N- or bytes=N-M", {
      path: "Range",
    });
  }
  const start = Number(m[1]);
  const last = m[2] === "" ? d.size - 1 : Math.min(Number(m[2]), d.size - 1);
  if (start >= d.size || last < start) {
    throw new DispatchCloudError(
      "cas.range_not_satisfiable",
      `Range ${header} is outside the blob's ${d.size} bytes`,
    );
  }
  return { start, end: last + 1 };
}

export function registerCasRoutes(app: FastifyInstance, ctx: RouteContext, cas: CasContext): void {
  const { db } = ctx;
  const { backend } = cas;
  const now = () => new Date(ctx.nowMs());
  /** Uploads in progress, by partial file: a second upload of the same blob by the same user uses a file of its own. */
  const activePartials = new Set<string>();

  const readable = ctx.casReadable;
  /**
   * find-missing through the readable cache: only digests the cache does not know are asked of the database.
   * The present ones a touching question found are remembered for the user, but only for a reader without
   * extra manifests (a runner may read its dependencies' trees, which its owner's other readers may not).
   */
  const missingFor = async (reader: CasReader, digests: Digest[], touch: boolean): Promise<Digest[]> => {
    const unknown = readable.unknown(reader.userUuid, digests);
    if (unknown.length === 0) return [];
    const missing = await findMissing(db, reader, unknown, now(), { touch });
    if (touch && reader.manifests.length === 0) {
      const gone = new Set(missing.map((d) => d.hash));
      readable.add(
        reader.userUuid,
        unknown.filter((d) => !gone.has(d.hash)),
      );
    }
    return missing;
  };

  const onRequest = async (request: FastifyRequest) => {
    const token = bearerToken(request);
    if (token.startsWith(RUNNER_TOKEN_PREFIX)) {
      const bundle = await authenticateRunner(db, request);
      request.runnerBundle = bundle;
      const manifests = await outputManifestsOf(
        db,
        bundle.dependencies.map((d) => d.bundle),
      );
      // The image tree it was pinned to at submit time, even if its owner removed the image since.
      if (bundle.imageStore != null) manifests.push(bundle.imageStore.manifest.split("/")[0]!);
      callers.set(request, { reader: { userUuid: bundle.ownerUuid, manifests }, owner: bundle.ownerUuid });
    } else {
      const { user, token: t } = await authenticateUser(db, request, ctx.nowMs(), ctx.tokenCache);
      request.caller = user;
      request.callerToken = t;
      callers.set(request, { reader: { userUuid: user.uuid, manifests: [] }, owner: user.uuid });
      // Users upload blobs of any size too: the same allowance as runners' uploads.
      allowSlowUpload(request.raw);
    }
  };

  app.post(`${PREFIX}/find-missing`, { onRequest, bodyLimit: 2 * 2 ** 20 }, async (request) => {
    const { reader } = callerOf(request);
    const body = validate(FindMissingRequest, request.body);
    const digests = parseDigestList(body.digests, "digests");
    const asked = digests.filter((d) => !isEmptyDigest(d));
    const missing = await missingFor(reader, asked, true);
    if (cas.metrics !== null) {
      let skipped = 0;
      for (const d of asked) skipped += d.size;
      for (const d of missing) skipped -= d.size;
      cas.metrics.bytesSkipped.inc(skipped);
    }
    return { missing: missing.map(formatDigest) };
  });

  const batchBodyLimit = Math.ceil((cas.maxBatchBytes * 4) / 3) + 2 ** 20;

  app.post(`${PREFIX}/batch-upload`, { onRequest, bodyLimit: batchBodyLimit }, async (request) => {
    const { owner } = callerOf(request);
    const body = validate(BatchUploadRequest, request.body);
    const items = body.blobs.map((b, i) => {
      const digest = parseDigest(b.digest, `blobs/${i}/digest`);
      if (!/^[A-Za-z0-9+/]*={0,2}$/.test(b.data)) {
        throw new DispatchCloudError("request.invalid_body", `blobs/${i}/data: must be base64`, {
          path: `blobs/${i}/data`,
        });
      }
      return { digest, data: Buffer.from(b.data, "base64") };
    });
    let total = 0;
    for (const it of items) total += it.data.length;
    if (total > cas.maxBatchBytes) {
      throw tooLarge(`a batch may hold at most ${cas.maxBatchBytes} bytes of blobs (cas.maxBatchBytes)`);
    }
    type Result =
      | { digest: string; ok: true }
      | { digest: string; ok: false; error: { code: string; message: string } };
    const results: Result[] = items.map((it) => ({ digest: formatDigest(it.digest), ok: true }));
    const fail = (i: number, err: DispatchCloudError) => {
      results[i] = {
        digest: formatDigest(items[i]!.digest),
        ok: false,
        error: { code: err.code, message: err.message },
      };
    };
    const verified: number[] = [];
    items.forEach((it, i) => {
      if (it.data.length > MAX_BATCH_BLOB)
        fail(i, tooLarge(`a blob of a batch may hold at most ${MAX_BATCH_BLOB} bytes`));
      else if (!sameDigest(digestBytes(it.data), it.digest)) {
        fail(
          i,
          new DispatchCloudError(
            "cas.digest_mismatch",
            `the data does not hash to ${formatDigest(it.digest)}`,
          ),
        );
      } else if (!isEmptyDigest(it.digest)) verified.push(i);
    });
    const states = new Map<number, string>();
    for (const i of verified) states.set(i, await beginUpload(db, items[i]!.digest, now()));
    const toStore: number[] = [];
    for (const i of verified) {
      const s = states.get(i);
      if (s === "deleting") fail(i, busy(items[i]!.digest));
      else toStore.push(i);
    }
    for (const i of toStore) {
      if (states.get(i) === "absent") await backend.writeBytes(items[i]!.digest, items[i]!.data);
    }
    const refused = await recordUploads(
      db,
      toStore.map((i) => items[i]!.digest),
      owner,
      now(),
    );
    const stored: Digest[] = [];
    for (const i of toStore) {
      if (refused.has(items[i]!.digest.hash)) fail(i, busy(items[i]!.digest));
      else {
        stored.push(items[i]!.digest);
        if (states.get(i) === "absent") cas.metrics?.bytesUploaded.inc(items[i]!.data.length);
      }
    }
    readable.add(owner, stored);
    return { results };
  });

  app.post(`${PREFIX}/batch-read`, { onRequest }, async (request, reply) => {
    const { reader } = callerOf(request);
    const body = validate(BatchReadRequest, request.body);
    const digests = parseDigestList(body.digests, "digests");
    const missing = new Set(
      (
        await missingFor(
          reader,
          digests.filter((d) => !isEmptyDigest(d)),
          false,
        )
      ).map((d) => d.hash),
    );
    let total = 0;
    // The answer in the order asked; the reads (what fits in the batch) go on at once, a few at a time.
    type Answer =
      | { digest: string; data: string }
      | { digest: string; error: { code: string; message: string } };
    const blobs: Answer[] = [];
    const reads: { at: number; d: Digest }[] = [];
    for (const d of digests) {
      const digest = formatDigest(d);
      const err = (e: DispatchCloudError) =>
        blobs.push({ digest, error: { code: e.code, message: e.message } });
      if (isEmptyDigest(d)) {
        blobs.push({ digest, data: "" });
        continue;
      }
      if (missing.has(d.hash)) {
        err(notFound(d));
        continue;
      }
      if (d.size > MAX_BATCH_BLOB) {
        err(tooLarge(`blobs over ${MAX_BATCH_BLOB} bytes are read with GET ${PREFIX}/blobs/...`));
        continue;
      }
      if (total + d.size > cas.maxBatchBytes) {
        err(tooLarge(`the batch passes cas.maxBatchBytes (${cas.maxBatchBytes}); ask for this blob again`));
        continue;
      }
      total += d.size;
      reads.push({ at: blobs.length, d });
      blobs.push({ digest, data: "" });
    }
    // Binary answer (asked for with Accept: BATCH_BINARY_TYPE): one JSON line listing the blobs in order, each
    // {digest, size} or {digest, error}, then the bytes of those with a size, one after the other. No base64, no
    // bytes inside a JSON string: several times cheaper for both ends than the JSON answer.
    const binary = String(request.headers.accept ?? "").includes(BATCH_BINARY_TYPE);
    const bytes: (Buffer | null)[] = blobs.map(() => null);
    const got = (at: number, d: Digest, data: Buffer | null) => {
      if (data === null) {
        const e = notFound(d);
        blobs[at] = { digest: formatDigest(d), error: { code: e.code, message: e.message } };
        return;
      }
      cas.metrics?.bytesDownloaded.inc(data.length);
      if (binary) bytes[at] = data;
      else blobs[at] = { digest: formatDigest(d), data: data.toString("base64") };
    };
    const readSmallSync = backend.readSmallSync?.bind(backend);
    if (readSmallSync !== undefined) {
      // Local files by synchronous reads, a slice at a time between turns of the event loop.
      await eachInSlices(reads, BATCH_READ_SLICE, ({ at, d }) => got(at, d, readSmallSync(d)));
    } else {
      await eachLimited(reads, BATCH_READ_CONCURRENCY, async ({ at, d }) => {
        const s = await backend.read(d);
        got(at, d, s === null ? null : await readAll(s));
      });
    }
    if (!binary) return { blobs };
    const entries: BatchEntry[] = blobs.map((b, i) =>
      "error" in b ? b : { digest: b.digest, data: bytes[i] ?? Buffer.alloc(0) },
    );
    return reply.type(BATCH_BINARY_TYPE).send(joinBatch(entries));
  });

  const sendBlob = async (request: FastifyRequest, reply: FastifyReply, manifest: boolean) => {
    const { reader } = callerOf(request);
    const d = digestParam(request);
    const type = manifest ? "application/json" : "application/octet-stream";
    if (isEmptyDigest(d) && !manifest)
      return reply.type(type).header("accept-ranges", "bytes").send(Buffer.alloc(0));
    // A blob its user was recently found to read needs no lookup (readable-cache.ts); a manifest always does.
    const known = !manifest && readable.unknown(reader.userUuid, [d]).length === 0;
    if (!known && !(await canRead(db, reader, d, { manifest }))) throw notFound(d);
    const range = parseRange(request.headers.range, d);
    const head = request.method === "HEAD";
    reply.type(type).header("accept-ranges", "bytes");
    if (range !== null) {
      const s = head ? null : await backend.read(d, range);
      if (!head && s === null) throw notFound(d);
      reply
        .code(206)
        .header("content-range", `bytes ${range.start}-${range.end - 1}/${d.size}`)
        .header("content-length", range.end - range.start);
      cas.metrics?.bytesDownloaded.inc(range.end - range.start);
      return reply.send(head ? undefined : s);
    }
    const accepts = /\bgzip\b/.test((request.headers["accept-encoding"] ?? "").toString());
    let s = head ? null : await backend.read(d);
    if (!head && s === null) throw notFound(d);
    if (accepts && d.size > 0 && s !== null) {
      const peeked = await peekStream(s);
      s = peeked.all;
      if (peeked.head !== null && worthGzip(peeked.head)) {
        cas.metrics?.bytesDownloaded.inc(d.size);
        reply.header("content-encoding", "gzip").header("vary", "accept-encoding");
        return reply.send(pipeline(s, createGzip({ level: 1 }), () => {}));
      }
    }
    cas.metrics?.bytesDownloaded.inc(head ? 0 : d.size);
    reply.header("content-length", d.size);
    return reply.send(head ? undefined : s);
  };

  app.get(`${PREFIX}/blobs/:hash/:size`, { onRequest }, (request, reply) => sendBlob(request, reply, false));
  app.get(`${PREFIX}/manifests/:hash/:size`, { onRequest }, (request, reply) =>
    sendBlob(request, reply, true),
  );

  const partialFile = (owner: string, d: Digest) => join(cas.partialDir, owner, `${d.hash}-${d.size}`);

  app.head(`${PREFIX}/uploads/:hash/:size`, { onRequest }, async (request, reply) => {
    const { owner } = callerOf(request);
    const d = digestParam(request);
    let offset = 0;
    try {
      offset = (await stat(partialFile(owner, d))).size;
    } catch {
      // none kept
    }
    return reply.header("upload-offset", String(offset)).code(200).send();
  });

  // Raw bodies (blobs, manifests): in a scope of their own, so they arrive as streams whatever their type.
  app.register(async (scope) => {
    scope.removeAllContentTypeParsers();
    scope.addContentTypeParser("*", (_req, payload, done) => {
      done(null, payload);
    });
    scope.addHook("onSend", async (request, reply) => {
      if (!request.raw.readableEnded) reply.header("connection", "close");
    });

    scope.put(`${PREFIX}/blobs/:hash/:size`, { onRequest }, async (request, reply) => {
      const { owner } = callerOf(request);
      const d = digestParam(request);
      const encoding = contentEncoding(request);
      const offsetHeader = request.headers["upload-offset"];
      const resumeFrom = offsetHeader === undefined ? null : Number(offsetHeader);
      if (resumeFrom !== null && (!Number.isSafeInteger(resumeFrom) || resumeFrom < 0)) {
        throw new DispatchCloudError(
          "request.invalid_param",
          "Upload-Offset: must be a whole number of bytes",
          {
            path: "Upload-Offset",
          },
        );
      }
      if (isEmptyDigest(d)) {
        for await (const _ of inflated(request, encoding, 0)) {
          // a non-empty body for the empty blob is cas.too_large
        }
        return reply.code(201).send({ digest: formatDigest(d) });
      }
      const state = await beginUpload(db, d, now());
      if (state === "deleting") throw busy(d);

      const canonical = partialFile(owner, d);
      const own = !activePartials.has(canonical);
      const file = own ? canonical : `${canonical}.${randomBytes(6).toString("hex")}`;
      if (own) activePartials.add(canonical);
      let keep = false;
      try {
        await mkdir(join(cas.partialDir, owner), { recursive: true, mode: 0o700 });
        const builder = new DigestBuilder();
        let start = 0;
        if (resumeFrom !== null) {
          let have = 0;
          if (own) {
            try {
              have = (await stat(file)).size;
            } catch {
              have = 0;
            }
          }
          if (have !== resumeFrom) {
            keep = own;
            throw new DispatchCloudError(
              "cas.upload_offset",
              `the server holds ${have} bytes of this upload; resume from Upload-Offset ${have}`,
            );
          }
          if (have > 0) for await (const c of createReadStream(file)) builder.update(c as Buffer);
          start = have;
        }
        const fh = await open(file, start > 0 ? "a" : "w", 0o600);
        try {
          try {
            for await (const chunk of inflated(request, encoding, d.size - start)) {
              builder.update(chunk);
              await fh.write(chunk);
              cas.metrics?.bytesUploaded.inc(chunk.length);
            }
          } catch (err) {
            // An interrupted upload keeps its bytes for a resume; a refused one does not.
            if (err instanceof Interrupted) keep = own;
            throw err;
          }
          const got = builder.digest();
          if (!sameDigest(got, d)) {
            throw new DispatchCloudError(
              "cas.digest_mismatch",
              `the body is ${formatDigest(got)}, not ${formatDigest(d)}; nothing was stored`,
            );
          }
          await fh.sync();
        } finally {
          await fh.close();
        }
        // A blob present when the upload began is kept (the touch keeps collection away); the check is cheap
        // insurance against a row whose bytes went missing.
        if (state !== "present" || !(await backend.has(d))) await backend.adoptFile(d, file);
        if (!(await recordUpload(db, d, owner, now()))) throw busy(d);
        readable.add(owner, [d]);
        return reply.code(201).send({ digest: formatDigest(d) });
      } catch (err) {
        if (err instanceof Interrupted) {
          request.log.info(
            { digest: formatDigest(d) },
            "upload interrupted; its bytes are kept for a resume",
          );
          throw new DispatchCloudError("request.invalid_body", "the request body was interrupted");
        }
        throw err;
      } finally {
        if (own) activePartials.delete(canonical);
        if (!keep) await rm(file, { force: true });
      }
    });

    scope.put(`${PREFIX}/manifests/:hash/:size`, { onRequest }, async (request, reply) => {
      const { owner, reader } = callerOf(request);
      const d = digestParam(request);
      const encoding = contentEncoding(request);
      if (d.size > MAX_MANIFEST_BYTES)
        throw tooLarge(`a manifest may hold at most ${MAX_MANIFEST_BYTES} bytes`);
      const parts: Buffer[] = [];
      try {
        for await (const c of inflated(request, encoding, d.size)) parts.push(c);
      } catch (err) {
        if (err instanceof Interrupted) {
          throw new DispatchCloudError("request.invalid_body", "the request body was interrupted");
        }
        throw err;
      }
      const bytes = Buffer.concat(parts);
      const got = digestBytes(bytes);
      if (!sameDigest(got, d)) {
        throw new DispatchCloudError(
          "cas.digest_mismatch",
          `the body is ${formatDigest(got)}, not ${formatDigest(d)}; nothing was stored`,
        );
      }
      const m = parseManifest(bytes);
      const stats = manifestStats(m);
      const named = stats.blobs.filter((b) => !isEmptyDigest(b));
      await db.transaction(async (tx) => {
        const missing = await touchReadable(tx, reader, named, now());
        if (missing.length > 0) {
          const shown = missing.slice(0, 100).map(formatDigest);
          throw new DispatchCloudError(
            "cas.manifest_incomplete",
            `${missing.length} blob(s) the manifest names are not in the store for the caller; upload them first: ${shown.join(", ")}${missing.length > shown.length ? ", ..." : ""}`,
          );
        }
        const state = await beginUpload(tx, d, now());
        if (state === "deleting") throw busy(d);
        if (state === "absent") await backend.writeBytes(d, bytes);
        const ok = await recordUpload(tx, d, owner, now(), { blobs: named.map((b) => b.hash) });
        if (!ok) throw busy(d);
      });
      return reply.code(201).send({ digest: formatDigest(d), files: stats.files, bytes: stats.bytes });
    });
  });
}

/** Files and bytes of a stored manifest, or null when it is not one the reader may read. */
export async function readManifestStats(
  db: Db,
  backend: BlobBackend,
  reader: CasReader,
  d: Digest,
): Promise<{ files: number; bytes: number } | null> {
  const m = await readManifest(db, backend, reader, d);
  if (m === null) return null;
  const { files, bytes } = manifestStats(m);
  return { files, bytes };
}

/** A stored manifest, or null when it is not one the reader may read. */
export async function readManifest(
  db: Db,
  backend: BlobBackend,
  reader: CasReader,
  d: Digest,
): Promise<Manifest | null> {
  if (!(await canRead(db, reader, d, { manifest: true }))) return null;
  const s = await backend.read(d);
  if (s === null) return null;
  return parseManifest(await readAll(s));
}
