/**
 * Where the REST server keeps the store's blobs (docs/storage.md): the filesystem under the data directory (the
 * embedded default) or S3-compatible object storage (REST servers on several machines share it). A backend only
 * keeps bytes under digests: checking what is written (decompression, size guard, hash) happens before, in the
 * routes, and who may read what is in the database. Every backend passes the same conformance tests.
 */
import type { Readable } from "node:stream";
import type { Digest } from "../../lib/cas/digest.ts";

export interface BlobBackend {
  /** "filesystem" or "s3", for logs, metrics and the health check. */
  readonly kind: string;
  /**
   * Stores the blob from a file on this machine whose bytes were already verified against `digest` (the routes
   * write uploads to a temporary file first). The file is moved when the backend can (same filesystem) and read
   * otherwise; either way it is gone afterwards. Storing a blob that is already there is not an error. Nothing
   * is visible under the digest until the whole blob is (temp -> fsync -> rename; S3 PutObject with the sha256).
   */
  adoptFile(digest: Digest, file: string): Promise<void>;
  /** Stores verified bytes held in memory (small blobs of a batch upload); the same guarantees as adoptFile. */
  writeBytes(digest: Digest, data: Uint8Array): Promise<void>;
  /** The bytes [start, end) of the blob (default all of it), or null when the backend does not have it. */
  read(digest: Digest, range?: { start: number; end?: number }): Promise<Readable | null>;
  /**
   * A small blob's bytes read at once by a synchronous call (null when absent), for backends where that is
   * cheap (local files: a batch read of 1,000 small blobs costs no 4,000 trips through the thread pool).
   * Backends without it are read by `read`.
   */
  readSmallSync?(digest: Digest): Buffer | null;
  /** Whether the blob is stored (the database is the index; this is for checks and repairs). */
  has(digest: Digest): Promise<boolean>;
  /** Removes the blob; removing one that is absent is not an error. */
  delete(digest: Digest): Promise<void>;
  /** Every stored blob, in no particular order (for checks and repairs, never on a request's path). */
  list(): AsyncIterable<Digest>;
  /** Ends connections and timers. */
  close(): Promise<void>;
}
