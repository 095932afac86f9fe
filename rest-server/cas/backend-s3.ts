/**
 * The S3-compatible backend of the store (docs/storage.md "Backends"): every blob is one object
 * `<prefix>blobs/<sha256 hex>`, written with its length and its sha256 (x-amz-checksum-sha256), which the storage
 * checks before it keeps the object: a PUT either stores the whole verified blob or nothing (a PUT cut off
 * mid-body is discarded by the storage). Reads use Range; the key holds the hash, the size comes from the object.
 *
 * Errors from the storage become `cas.storage_unavailable` errors naming the operation, the key and the storage's
 * error code; the credentials never appear in them (nor is the SDK's error, which carries the raw response, kept).
 */
import { createReadStream } from "node:fs";
import { rm } from "node:fs/promises";
import { Readable, Transform, type TransformCallback } from "node:stream";
import { setTimeout as sleep } from "node:timers/promises";
import {
  DeleteObjectCommand,
  GetObjectCommand,
  HeadObjectCommand,
  ListObjectsV2Command,
  type ListObjectsV2CommandOutput,
  PutObjectCommand,
  S3Client,
  type S3ClientConfig,
} from "@aws-sdk/client-s3";
import type { Digest } from "../../lib/cas/digest.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import type { BlobBackend } from "./backend.ts";

export interface S3BackendOptions {
  bucket: string;
  /** Prepended to every key (`dispatch-cloud/` keeps the store in a folder of a shared bucket); default "". */
  prefix?: string;
  /** An S3-compatible server's URL (MinIO, Ceph, ...); default AWS's endpoint for the region. */
  endpoint?: string;
  region: string;
  /** Bucket in the path (`<endpoint>/<bucket>/<key>`) rather than the host name: most S3-compatible servers want it. */
  forcePathStyle?: boolean;
  /** Static keys; default the SDK's usual chain (environment, shared files, instance role). */
  credentials?: { accessKeyId: string; secretAccessKey: string; sessionToken?: string };
  /** Connecting, and silence on an open connection, before a request fails (ms); default 10 s and 60 s. */
  connectionTimeoutMs?: number;
  requestTimeoutMs?: number;
  /** Attempts of a request that fails for a reason worth retrying (throttling, 5xx, network); default 3. */
  maxAttempts?: number;
  /** Keys per ListObjectsV2 page; default 1000 (S3's most). */
  listPageSize?: number;
}

const HASH = /^[0-9a-f]{64}$/;

export function createS3Backend(opts: S3BackendOptions): BlobBackend {
  return new S3Backend(opts);
}

class S3Backend implements BlobBackend {
  readonly kind = "s3";
  private readonly client: S3Client;
  /** Streams cannot be sent twice: adoptFile retries itself (reopening the file) with a client that does not. */
  private readonly streamClient: S3Client;
  private readonly bucket: string;
  private readonly prefix: string;
  private readonly maxAttempts: number;
  private readonly listPageSize: number;
  private readonly secrets: string[];

  constructor(opts: S3BackendOptions) {
    if (typeof opts.bucket !== "string" || opts.bucket === "") {
      throw new DispatchCloudError("config.missing_key", "cas.s3.bucket: must name a bucket", {
        path: "cas.s3.bucket",
      });
    }
    this.bucket = opts.bucket;
    this.prefix = opts.prefix ?? "";
    this.maxAttempts = opts.maxAttempts ?? 3;
    this.listPageSize = opts.listPageSize ?? 1000;
    const config = (maxAttempts: number): S3ClientConfig => {
      const c: S3ClientConfig = {
        region: opts.region,
        maxAttempts,
        retryMode: "standard",
        forcePathStyle: opts.forcePathStyle ?? false,
        // The sha256 is sent where it matters (PutObject); no CRC32 of every request besides.
        requestChecksumCalculation: "WHEN_REQUIRED",
        responseChecksumValidation: "WHEN_REQUIRED",
        requestHandler: {
          connectionTimeout: opts.connectionTimeoutMs ?? 10_000,
          requestTimeout: opts.requestTimeoutMs ?? 60_000,
          throwOnRequestTimeout: true,
        },
      };
      if (opts.endpoint !== undefined) c.endpoint = opts.endpoint;
      if (opts.credentials !== undefined) c.credentials = { ...opts.credentials };
      return c;
    };
    this.client = new S3Client(config(this.maxAttempts));
    // The SDK warns on the console when a streamed request fails; adoptFile reports (and retries) those itself.
    const quiet = () => {};
    this.streamClient = new S3Client({
      ...config(1),
      logger: { debug: quiet, info: quiet, warn: quiet, error: quiet },
    });
    const c = opts.credentials;
    this.secrets = c === undefined ? [] : [c.secretAccessKey, c.accessKeyId, c.sessionToken ?? ""];
  }

  private key(hash: string): string {
    return `${this.prefix}blobs/${hash}`;
  }

  async adoptFile(digest: Digest, file: string): Promise<void> {
    const key = this.key(digest.hash);
    for (let attempt = 1; ; attempt++) {
      const abort = new AbortController();
      // The file is counted as it is sent: one that is shorter or longer than the digest says breaks the PUT
      // off mid-body (the storage keeps nothing) rather than leaving the request waiting for bytes.
      const source = createReadStream(file);
      // A file that cannot be read ends the PUT too (pipe does not pass errors on).
      source.on("error", (err) => abort.abort(err));
      const body = source.pipe(new LengthGuard(digest.size, file, abort));
      // Its errors reach the caller through the abort (the SDK pipes the body without listening for them).
      body.on("error", () => {});
      try {
        await this.streamClient.send(
          new PutObjectCommand({
            Bucket: this.bucket,
            Key: key,
            Body: body,
            ContentLength: digest.size,
            ChecksumSHA256: sha256Base64(digest),
          }),
          { abortSignal: abort.signal },
        );
        break;
      } catch (err) {
        source.destroy();
        body.destroy();
        if (abort.signal.aborted && abort.signal.reason instanceof Error) throw abort.signal.reason;
        if (attempt >= this.maxAttempts || !retryable(err)) throw this.wrap("PutObject", key, err);
        // Full jitter, as the SDK's own retries: up to 100 ms, 200 ms, ... 5 s.
        await sleep(Math.random() * Math.min(5_000, 100 * 2 ** (attempt - 1)));
      }
    }
    await rm(file, { force: true });
  }

  async writeBytes(digest: Digest, data: Uint8Array): Promise<void> {
    const key = this.key(digest.hash);
    if (data.byteLength !== digest.size) {
      throw new DispatchCloudError(
        "cas.digest_mismatch",
        `${data.byteLength} bytes given for a blob of ${digest.size} bytes`,
      );
    }
    try {
      await this.client.send(
        new PutObjectCommand({
          Bucket: this.bucket,
          Key: key,
          Body: data,
          ContentLength: data.byteLength,
          ChecksumSHA256: sha256Base64(digest),
        }),
      );
    } catch (err) {
      throw this.wrap("PutObject", key, err);
    }
  }

  async read(digest: Digest, range?: { start: number; end?: number }): Promise<Readable | null> {
    const key = this.key(digest.hash);
    const start = range?.start ?? 0;
    const end = Math.min(range?.end ?? digest.size, digest.size);
    // S3 has no empty range: answer it here once the blob is known to be there.
    if (start >= end) return (await this.has(digest)) ? Readable.from([]) : null;
    const whole = start === 0 && end === digest.size;
    try {
      const out = await this.client.send(
        new GetObjectCommand({
          Bucket: this.bucket,
          Key: key,
          ...(whole ? {} : { Range: `bytes=${start}-${end - 1}` }),
        }),
      );
      return out.Body as Readable;
    } catch (err) {
      if (notFound(err)) return null;
      throw this.wrap("GetObject", key, err);
    }
  }

  async has(digest: Digest): Promise<boolean> {
    const key = this.key(digest.hash);
    try {
      await this.client.send(new HeadObjectCommand({ Bucket: this.bucket, Key: key }));
      return true;
    } catch (err) {
      if (notFound(err)) return false;
      throw this.wrap("HeadObject", key, err);
    }
  }

  async delete(digest: Digest): Promise<void> {
    const key = this.key(digest.hash);
    try {
      await this.client.send(new DeleteObjectCommand({ Bucket: this.bucket, Key: key }));
    } catch (err) {
      if (notFound(err)) return;
      throw this.wrap("DeleteObject", key, err);
    }
  }

  async *list(): AsyncIterable<Digest> {
    const prefix = `${this.prefix}blobs/`;
    let token: string | undefined;
    do {
      let page: ListObjectsV2CommandOutput;
      try {
        page = await this.client.send(
          new ListObjectsV2Command({
            Bucket: this.bucket,
            Prefix: prefix,
            MaxKeys: this.listPageSize,
            ...(token === undefined ? {} : { ContinuationToken: token }),
          }),
        );
      } catch (err) {
        throw this.wrap("ListObjectsV2", prefix, err);
      }
      for (const o of page.Contents ?? []) {
        const hash = o.Key?.slice(prefix.length);
        // Anything else under the prefix (a stray upload, a folder marker) is not a blob: passed over.
        if (hash === undefined || !HASH.test(hash) || typeof o.Size !== "number") continue;
        yield { hash, size: o.Size };
      }
      token = page.IsTruncated ? page.NextContinuationToken : undefined;
    } while (token !== undefined);
  }

  async close(): Promise<void> {
    this.client.destroy();
    this.streamClient.destroy();
  }

  /** A storage failure as a `cas.storage_unavailable` error: operation, key, the storage's code and status. */
  private wrap(operation: string, key: string, err: unknown): DispatchCloudError {
    const e = err as {
      name?: unknown;
      message?: unknown;
      $metadata?: { httpStatusCode?: number; requestId?: string };
    };
    const name = typeof e?.name === "string" ? e.name : "Error";
    const message = typeof e?.message === "string" ? e.message : String(err);
    const status = e?.$metadata?.httpStatusCode;
    const requestId = e?.$metadata?.requestId;
    let text = `S3 ${operation} s3://${this.bucket}/${key} failed: ${name}: ${message}`;
    if (status !== undefined) text += ` (HTTP ${status}${requestId ? `, request ${requestId}` : ""})`;
    for (const s of this.secrets) if (s.length >= 4) text = text.split(s).join("***");
    return new DispatchCloudError("cas.storage_unavailable", text);
  }
}

function sha256Base64(d: Digest): string {
  return Buffer.from(d.hash, "hex").toString("base64");
}

function status(err: unknown): number | undefined {
  return (err as { $metadata?: { httpStatusCode?: number } })?.$metadata?.httpStatusCode;
}

/** The object is absent (a missing bucket is an error, not an absent blob; HEAD answers cannot tell them apart). */
function notFound(err: unknown): boolean {
  const name = (err as { name?: unknown })?.name;
  if (name === "NoSuchBucket") return false;
  return name === "NoSuchKey" || name === "NotFound" || status(err) === 404;
}

/** Worth another attempt: throttling, the storage's 5xx, a connection that failed or went silent. */
function retryable(err: unknown): boolean {
  const s = status(err);
  if (s !== undefined) return s >= 500 || s === 429 || s === 408;
  const name = (err as { name?: unknown; code?: unknown })?.name;
  return name !== "AbortError";
}

/** Passes a file's bytes through, failing (and aborting the request) when they are not exactly `size`. */
class LengthGuard extends Transform {
  private seen = 0;
  constructor(
    private readonly size: number,
    private readonly file: string,
    private readonly abort: AbortController,
  ) {
    super();
  }
  override _transform(chunk: Buffer, _enc: BufferEncoding, done: TransformCallback): void {
    this.seen += chunk.byteLength;
    if (this.seen > this.size) this.fail(`${this.file} is longer than the blob's ${this.size} bytes`, done);
    else done(null, chunk);
  }
  override _flush(done: TransformCallback): void {
    if (this.seen < this.size) {
      this.fail(`${this.file} ended after ${this.seen} of the blob's ${this.size} bytes`, done);
    } else done();
  }
  private fail(message: string, done: TransformCallback): void {
    const err = new DispatchCloudError("cas.digest_mismatch", message);
    this.abort.abort(err);
    done(err);
  }
}
