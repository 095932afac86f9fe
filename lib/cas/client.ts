/**
 * An HTTP client of the content-addressed store's API (docs/storage.md, "The API"): crunch-run uses it with its
 * runner token, the CLI with a user's token. Small blobs travel in batches (base64 in JSON), large ones stream
 * from and to files: uploads gzipped when they compress and resumed after a broken connection (HEAD, then
 * `Upload-Offset`), downloads hashed while they are written (a mismatch removes the file) and resumed with Range.
 * Network errors and 5xx answers are retried within a time budget; any other answer is an error with its code.
 */
import { createReadStream } from "node:fs";
import { open, rm } from "node:fs/promises";
import http from "node:http";
import https from "node:https";
import { type Readable, Writable } from "node:stream";
import { pipeline } from "node:stream/promises";
import { createGunzip, createGzip, gzipSync, constants as zlibConstants } from "node:zlib";
import { DispatchCloudError, ERROR_CODES, type ErrorCode } from "../errors.ts";
import { retryWithBackoff } from "../retry.ts";
import { BATCH_BINARY_TYPE, type BatchEntry, splitBatch } from "./batch.ts";
import {
  type Digest,
  DigestBuilder,
  digestBytes,
  formatDigest,
  isEmptyDigest,
  parseDigestList,
} from "./digest.ts";
import {
  canonicalManifest,
  type Manifest,
  manifestDigest,
  manifestStats,
  parseManifest,
} from "./manifest.ts";
import { eachLimited, manifestOfTree, type TreeOptions } from "./tree.ts";

/** Blobs up to this size go in batches (batch-upload, batch-read); larger ones stream on their own. */
export const SMALL_BLOB = 64 * 1024;
/** Largest blob batch-read returns. */
const MAX_BATCH_READ_BLOB = 1024 * 1024;
/** Largest batch body (base64 counted) we send or ask for. */
export const MAX_BATCH_BYTES = 4 * 1024 * 1024;
const FIND_MISSING_MAX = 10_000;
const BATCH_READ_MAX = 1_000;

/** A refusal of the CAS API: the HTTP status and the error code of its body. */
export class CasApiError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly what: string,
  ) {
    super(`${what}: ${status} ${code}: ${message}`);
    this.name = "CasApiError";
  }
}

const LOCAL_CODES = new Set([
  "ENOENT",
  "EACCES",
  "EPERM",
  "ENOTDIR",
  "EISDIR",
  "EROFS",
  "ENOSPC",
  "EDQUOT",
  "EMFILE",
]);

/** Network failures and 5xx answers are worth retrying; other answers and local errors are not. */
export function isTransient(err: unknown): boolean {
  if (err instanceof CasApiError) return err.status >= 500;
  if (err instanceof DispatchCloudError || err instanceof SyntaxError) return false;
  if (LOCAL_CODES.has((err as NodeJS.ErrnoException).code ?? "")) return false;
  return err instanceof Error;
}

export interface CasClientOptions {
  /** The server's base URL (`http://host:port`); requests go to `<url>/api/v1/cas/...`. */
  url: string;
  token: string;
  /** How long one call keeps retrying transient failures (default 60 s). */
  retryBudgetMs?: number;
  /** Per-request inactivity timeout (default 60 s). */
  timeoutMs?: number;
  signal?: AbortSignal;
  onRetry?: (what: string, err: unknown, delayMs: number) => void;
  /** Large blobs moved at once by uploadTree (default 4). */
  concurrency?: number;
}

export interface UploadTreeResult {
  digest: Digest;
  files: number;
  bytes: number;
  /** Bytes put on the wire for blobs (after compression; batches counted as their raw bytes). */
  bytesSent: number;
  blobsUploaded: number;
  /** Blobs the store had already. */
  blobsSkipped: number;
}

export interface UploadProgress {
  phase: "hashed" | "checked" | "uploaded";
  blobsDone: number;
  blobsTotal: number;
  bytesSent: number;
}

export interface UploadTreeOptions extends TreeOptions {
  onProgress?: (p: UploadProgress) => void;
  /** Refuse (runner.output_too_large) a tree whose files hold more bytes, before anything is sent. */
  maxBytes?: number;
}

export interface CasClient {
  findMissing(digests: readonly Digest[]): Promise<Digest[]>;
  /** Uploads blobs held in memory (any size up to 1 MiB), in batches; any refusal is thrown. */
  batchUpload(blobs: readonly { digest: Digest; data: Buffer }[]): Promise<{ bytesSent: number }>;
  /** Streams a file as the blob `digest`, gzipped when it compresses, resuming after broken connections. */
  uploadFile(digest: Digest, file: string): Promise<{ bytesSent: number }>;
  /** Small blobs by value, verified, keyed by hash. */
  batchRead(digests: readonly Digest[]): Promise<Map<string, Buffer>>;
  /** Writes the blob to `file` (created or replaced), verified; on a mismatch the file is removed. */
  download(digest: Digest, file: string): Promise<void>;
  putManifest(m: Manifest): Promise<{ digest: Digest; files: number; bytes: number }>;
  /** The manifest and its canonical bytes, verified against `digest`. */
  getManifest(digest: Digest): Promise<{ manifest: Manifest; bytes: Buffer }>;
  uploadTree(dir: string, opts?: UploadTreeOptions): Promise<UploadTreeResult>;
  close(): void;
}

const mismatch = (what: string) => new DispatchCloudError("cas.digest_mismatch", what);

/** Magic bytes of formats already compressed: sending them gzipped would only cost CPU. */
const COMPRESSED_MAGIC = [
  [0x1f, 0x8b], // gzip (and BGZF: BAM, .vcf.gz)
  [0x50, 0x4b, 0x03, 0x04], // zip, jar, docx
  [0xfd, 0x37, 0x7a, 0x58, 0x5a, 0x00], // xz
  [0x28, 0xb5, 0x2f, 0xfd], // zstd
  [0x42, 0x5a, 0x68], // bzip2
  [0x37, 0x7a, 0xbc, 0xaf, 0x27, 0x1c], // 7z
  [0x89, 0x50, 0x4e, 0x47], // png
  [0xff, 0xd8, 0xff], // jpeg
  [0x43, 0x52, 0x41, 0x4d], // CRAM
  [0x04, 0x22, 0x4d, 0x18], // lz4
];

/** Whether bytes that start a blob are worth gzipping: not a compressed format, and a trial shrinks them by 10 %. */
export function worthCompressing(head: Buffer): boolean {
  if (head.length < 512) return false;
  if (COMPRESSED_MAGIC.some((m) => m.every((b, i) => head[i] === b))) return false;
  const trial = gzipSync(head.subarray(0, 64 * 1024), { level: 1 });
  return trial.length < 0.9 * Math.min(head.length, 64 * 1024);
}

function readAll(res: Readable): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    res.on("data", (c: Buffer) => chunks.push(c));
    res.on("end", () => resolve(Buffer.concat(chunks)));
    res.on("error", reject);
  });
}

/** Splits items into groups of at most `maxItems` whose `weight` adds up to at most `maxWeight`. */
export function batches<T>(
  items: readonly T[],
  maxItems: number,
  maxWeight: number,
  weight: (t: T) => number,
): T[][] {
  const out: T[][] = [];
  let cur: T[] = [];
  let w = 0;
  for (const it of items) {
    const iw = weight(it);
    if (cur.length > 0 && (cur.length >= maxItems || w + iw > maxWeight)) {
      out.push(cur);
      cur = [];
      w = 0;
    }
    cur.push(it);
    w += iw;
  }
  if (cur.length > 0) out.push(cur);
  return out;
}

const base64Len = (n: number) => 4 * Math.ceil(n / 3) + 200;

export function createCasClient(opts: CasClientOptions): CasClient {
  const base = new URL(opts.url);
  const lib = base.protocol === "https:" ? https : http;
  const agent = new lib.Agent({ keepAlive: true, maxSockets: 16 });
  const basePath = `${base.pathname.replace(/\/+$/, "")}/api/v1/cas`;
  const auth = `Bearer ${opts.token}`;
  const budgetMs = opts.retryBudgetMs ?? 60_000;
  const timeoutMs = opts.timeoutMs ?? 60_000;
  const concurrency = opts.concurrency ?? 4;

  /** One request; 2xx resolves with the response (to be consumed), anything else rejects with CasApiError. */
  function send(
    method: string,
    path: string,
    what: string,
    headers: Record<string, string>,
    body?: Buffer | Readable,
  ): Promise<http.IncomingMessage> {
    return new Promise((resolve, reject) => {
      const req = lib.request({
        protocol: base.protocol,
        hostname: base.hostname,
        port: base.port,
        method,
        path: `${basePath}${path}`,
        headers: { authorization: auth, ...headers },
        agent,
        timeout: timeoutMs,
        signal: opts.signal,
      });
      let bodyError: unknown = null;
      req.on("timeout", () => req.destroy(new Error(`${what}: timed out`)));
      req.on("error", (err) => {
        if (bodyError !== null) return reject(bodyError);
        const e = new Error(`${what}: ${err.message}`) as NodeJS.ErrnoException;
        e.code = (err as NodeJS.ErrnoException).code ?? "ENETWORK";
        reject(e);
      });
      req.on("response", async (res) => {
        const status = res.statusCode ?? 0;
        if (status >= 200 && status < 300) return resolve(res);
        const text = method === "HEAD" ? "" : (await readAll(res).catch(() => Buffer.alloc(0))).toString();
        let code = "http.error";
        let message = text.slice(0, 500);
        try {
          const parsed = JSON.parse(text) as { error?: { code?: string; message?: string } };
          if (parsed.error?.code) code = parsed.error.code;
          if (parsed.error?.message) message = parsed.error.message;
        } catch {
          // not JSON
        }
        reject(new CasApiError(status, code, message, what));
      });
      if (body === undefined) req.end();
      else if (Buffer.isBuffer(body)) req.end(body);
      else {
        body.on("error", (err) => {
          bodyError = err;
          req.destroy(err);
        });
        body.pipe(req);
      }
    });
  }

  function retrying<T>(what: string, fn: (attempt: number) => Promise<T>): Promise<T> {
    return retryWithBackoff(fn, {
      budgetMs,
      isTransient,
      ...(opts.signal === undefined ? {} : { signal: opts.signal }),
      onRetry: (err, delay) => opts.onRetry?.(what, err, delay),
    });
  }

  async function json<T>(method: string, path: string, what: string, body?: unknown): Promise<T> {
    const data = body === undefined ? undefined : Buffer.from(JSON.stringify(body));
    return retrying(what, async () => {
      const headers: Record<string, string> = { accept: "application/json" };
      if (data !== undefined) {
        headers["content-type"] = "application/json";
        headers["content-length"] = String(data.length);
      }
      const res = await send(method, path, what, headers, data);
      return JSON.parse((await readAll(res)).toString()) as T;
    });
  }

  const apiError = (what: string, e: { code?: string; message?: string } | undefined) => {
    const code = e?.code ?? "http.error";
    if (Object.hasOwn(ERROR_CODES, code))
      return new DispatchCloudError(code as ErrorCode, `${what}: ${e?.message ?? ""}`);
    return new CasApiError(400, code, e?.message ?? "", what);
  };

  async function findMissing(digests: readonly Digest[]): Promise<Digest[]> {
    const out: Digest[] = [];
    for (let i = 0; i < digests.length; i += FIND_MISSING_MAX) {
      const chunk = digests.slice(i, i + FIND_MISSING_MAX).map(formatDigest);
      const r = await json<{ missing: string[] }>("POST", "/find-missing", "find-missing", {
        digests: chunk,
      });
      // A malformed answer fails as an invalid digest at its path (missing/0), like a malformed element.
      out.push(...parseDigestList(Array.isArray(r.missing) ? r.missing : [r.missing], "missing"));
    }
    return out;
  }

  async function batchUpload(blobs: readonly { digest: Digest; data: Buffer }[]) {
    let bytesSent = 0;
    for (const group of batches(blobs, Number.POSITIVE_INFINITY, MAX_BATCH_BYTES, (b) =>
      base64Len(b.data.length),
    )) {
      const r = await json<{
        results: { digest: string; ok: boolean; error?: { code?: string; message?: string } }[];
      }>("POST", "/batch-upload", "batch-upload", {
        blobs: group.map((b) => ({ digest: formatDigest(b.digest), data: b.data.toString("base64") })),
      });
      const bad = r.results.find((x) => !x.ok);
      if (bad !== undefined) throw apiError(`batch-upload of ${bad.digest}`, bad.error);
      for (const b of group) bytesSent += b.data.length;
    }
    return { bytesSent };
  }

  async function uploadFile(digest: Digest, file: string): Promise<{ bytesSent: number }> {
    const what = `upload of ${formatDigest(digest)}`;
    const fh = await open(file, "r");
    let gzip: boolean;
    try {
      const head = Buffer.alloc(Math.min(digest.size, 64 * 1024));
      await fh.read(head, 0, head.length, 0);
      gzip = worthCompressing(head);
    } finally {
      await fh.close();
    }
    const url = `/blobs/${digest.hash}/${digest.size}`;
    let bytesSent = 0;
    await retrying(what, async (attempt) => {
      let offset = 0;
      if (attempt > 0) {
        const head = await send("HEAD", `/uploads/${digest.hash}/${digest.size}`, what, {});
        head.resume();
        offset = Number(head.headers["upload-offset"] ?? 0);
        if (!Number.isSafeInteger(offset) || offset < 0 || offset > digest.size) offset = 0;
      }
      const headers: Record<string, string> = { "content-type": "application/octet-stream" };
      if (offset > 0) headers["upload-offset"] = String(offset);
      const source = createReadStream(file, { start: offset, highWaterMark: 256 * 1024 });
      let body: Readable = source;
      if (gzip) {
        const z = createGzip({ level: 1, flush: zlibConstants.Z_NO_FLUSH });
        source.on("error", (err) => z.destroy(err));
        body = source.pipe(z);
        headers["content-encoding"] = "gzip";
      } else headers["content-length"] = String(digest.size - offset);
      body.on("data", (c: Buffer) => {
        bytesSent += c.length;
      });
      try {
        const res = await send("PUT", url, what, headers, body);
        res.resume();
      } catch (err) {
        // The server kept another offset than it said: ask again (a retry starts with HEAD).
        if (err instanceof CasApiError && err.code === "cas.upload_offset") {
          throw new CasApiError(503, err.code, err.message, what);
        }
        throw err;
      }
    });
    return { bytesSent };
  }

  async function batchRead(digests: readonly Digest[]): Promise<Map<string, Buffer>> {
    const out = new Map<string, Buffer>();
    for (const d of digests) {
      if (d.size > MAX_BATCH_READ_BLOB)
        throw new Error(`batch-read: ${formatDigest(d)} is too large for a batch`);
    }
    // The binary answer (lib/cas/batch.ts) carries the bytes as they are: batches are counted in raw bytes.
    for (const group of batches(digests, BATCH_READ_MAX, MAX_BATCH_BYTES, (d) => d.size)) {
      const body = Buffer.from(JSON.stringify({ digests: group.map(formatDigest) }));
      const entries = await retrying("batch-read", async () => {
        const res = await send(
          "POST",
          "/batch-read",
          "batch-read",
          {
            accept: `${BATCH_BINARY_TYPE}, application/json`,
            "content-type": "application/json",
            "content-length": String(body.length),
          },
          body,
        );
        const bytes = await readAll(res);
        if (String(res.headers["content-type"] ?? "").startsWith(BATCH_BINARY_TYPE)) return splitBatch(bytes);
        // A server without the binary answer: base64 inside JSON.
        const r = JSON.parse(bytes.toString()) as {
          blobs: { digest: string; data?: string; error?: { code?: string; message?: string } }[];
        };
        return r.blobs.map(
          (b): BatchEntry =>
            b.data === undefined
              ? { digest: b.digest, error: b.error ?? {} }
              : { digest: b.digest, data: Buffer.from(b.data, "base64") },
        );
      });
      for (const [i, d] of group.entries()) {
        const b = entries[i];
        if (b === undefined || b.digest !== formatDigest(d))
          throw new Error("batch-read: answers out of order");
        if ("error" in b) throw apiError(`batch-read of ${b.digest}`, b.error);
        const got = digestBytes(b.data);
        if (got.hash !== d.hash || got.size !== d.size) {
          throw mismatch(
            `batch-read: the bytes received for ${formatDigest(d)} hash to ${formatDigest(got)}`,
          );
        }
        out.set(d.hash, b.data);
      }
    }
    return out;
  }

  async function download(digest: Digest, file: string): Promise<void> {
    const what = `download of ${formatDigest(digest)}`;
    const fh = await open(file, "w", 0o600);
    const b = new DigestBuilder();
    let ok = false;
    try {
      await retrying(what, async () => {
        const offset = b.size;
        const headers: Record<string, string> =
          offset > 0 ? { range: `bytes=${offset}-` } : { "accept-encoding": "gzip" };
        const res = await send("GET", `/blobs/${digest.hash}/${digest.size}`, what, headers);
        if (offset > 0) {
          const start = /^bytes (\d+)-/.exec(String(res.headers["content-range"] ?? ""))?.[1];
          if (res.statusCode !== 206 || Number(start) !== offset) {
            res.resume();
            throw new Error(`${what}: the server did not resume at byte ${offset}`);
          }
        }
        const enc = String(res.headers["content-encoding"] ?? "identity");
        let body: Readable = res;
        if (enc === "gzip") body = res.pipe(createGunzip());
        else if (enc !== "identity") throw new Error(`${what}: unexpected Content-Encoding ${enc}`);
        res.on("error", (err) => body.destroy(err));
        // Written, then hashed, at the offset reached: chunks that arrive while a write is under way go in the
        // next write together (writev), so the socket is paused only when the disk falls behind. What was hashed
        // was written, so a resume from b.size leaves no hole.
        const sink = new Writable({
          highWaterMark: 1024 * 1024,
          writev(chunks, done) {
            // One system call for all of them, without copying them into one buffer first.
            const bufs: Buffer[] = chunks.map((c) => c.chunk as Buffer);
            let n = 0;
            for (const c of bufs) n += c.length;
            if (b.size + n > digest.size) {
              done(mismatch(`${what}: more bytes than the digest's size`));
              return;
            }
            fh.writev(bufs, b.size).then(
              ({ bytesWritten }) => {
                if (bytesWritten !== n) {
                  done(new Error(`${what}: a short write (${bytesWritten} of ${n} bytes)`));
                  return;
                }
                for (const c of bufs) b.update(c);
                done();
              },
              (err: Error) => done(err),
            );
          },
        });
        await pipeline(body, sink);
      });
      const got = b.digest();
      if (got.hash !== digest.hash || got.size !== digest.size) {
        throw mismatch(`${what}: the bytes received hash to ${formatDigest(got)}`);
      }
      ok = true;
    } finally {
      await fh.close();
      if (!ok) await rm(file, { force: true });
    }
  }

  async function putManifest(m: Manifest) {
    const bytes = canonicalManifest(m);
    const d = manifestDigest(m);
    const r = await retrying("manifest upload", async () => {
      const res = await send(
        "PUT",
        `/manifests/${d.hash}/${d.size}`,
        "manifest upload",
        {
          "content-type": "application/json",
          "content-length": String(bytes.length),
          accept: "application/json",
        },
        bytes,
      );
      return JSON.parse((await readAll(res)).toString()) as { files: number; bytes: number };
    });
    return { digest: d, files: r.files, bytes: r.bytes };
  }

  async function getManifest(digest: Digest) {
    const what = `manifest ${formatDigest(digest)}`;
    const bytes = await retrying(what, async () => {
      const res = await send("GET", `/manifests/${digest.hash}/${digest.size}`, what, {
        accept: "application/json",
      });
      return readAll(res);
    });
    const got = digestBytes(bytes);
    if (got.hash !== digest.hash || got.size !== digest.size) {
      throw mismatch(`${what}: the bytes received hash to ${formatDigest(got)}`);
    }
    return { manifest: parseManifest(bytes), bytes };
  }

  async function uploadTree(dir: string, o: UploadTreeOptions = {}) {
    const { manifest, files } = await manifestOfTree(dir, o);
    if (o.maxBytes !== undefined) {
      const total = manifestStats(manifest).bytes;
      if (total > o.maxBytes) {
        throw new DispatchCloudError(
          "runner.output_too_large",
          `the tree holds ${total} bytes, more than the ${o.maxBytes} allowed`,
        );
      }
    }
    const all = [...files.entries()]
      .map(([hash, f]) => ({ digest: { hash, size: f.size }, path: f.path }))
      .filter((b) => !isEmptyDigest(b.digest));
    let bytesSent = 0;
    let done = 0;
    const progress = (phase: UploadProgress["phase"]) =>
      o.onProgress?.({ phase, blobsDone: done, blobsTotal: all.length, bytesSent });
    progress("hashed");
    const missing = new Set((await findMissing(all.map((b) => b.digest))).map((d) => d.hash));
    const todo = all.filter((b) => missing.has(b.digest.hash));
    done = all.length - todo.length;
    progress("checked");
    const small = todo.filter((b) => b.digest.size <= SMALL_BLOB);
    const large = todo.filter((b) => b.digest.size > SMALL_BLOB);
    for (const group of batches(small, Number.POSITIVE_INFINITY, MAX_BATCH_BYTES, (b) =>
      base64Len(b.digest.size),
    )) {
      const blobs = await Promise.all(
        group.map(async (b) => {
          const fh = await open(b.path, "r");
          try {
            const data = Buffer.alloc(b.digest.size);
            const { bytesRead } = await fh.read(data, 0, data.length, 0);
            if (bytesRead !== data.length) throw mismatch(`${b.path} changed while it was being uploaded`);
            return { digest: b.digest, data };
          } finally {
            await fh.close();
          }
        }),
      );
      bytesSent += (await batchUpload(blobs)).bytesSent;
      done += group.length;
      progress("uploaded");
    }
    await eachLimited(large, concurrency, async (b) => {
      // Read after the await: `bytesSent += await ...` would add to the value read before it, losing what
      // the uploads running meanwhile added.
      const sent = (await uploadFile(b.digest, b.path)).bytesSent;
      bytesSent += sent;
      done++;
      progress("uploaded");
    });
    const put = await putManifest(manifest);
    return {
      digest: put.digest,
      files: put.files,
      bytes: put.bytes,
      bytesSent,
      blobsUploaded: todo.length,
      blobsSkipped: all.length - todo.length,
    };
  }

  return {
    findMissing,
    batchUpload,
    uploadFile,
    batchRead,
    download,
    putManifest,
    getManifest,
    uploadTree,
    close: () => agent.destroy(),
  };
}
