/**
 * Digests of the content-addressed store (docs/storage.md): the sha256 of a blob's uncompressed bytes, in lower-case
 * hex, with its size in bytes. Written `<hash>/<size>` wherever a digest travels as text (URLs, manifests, JSON
 * bodies). The empty blob is always present.
 */
import { createHash } from "node:crypto";
import { DispatchCloudError } from "../errors.ts";

export interface Digest {
  /** 64 lower-case hex characters: sha256 of the uncompressed bytes. */
  hash: string;
  /** Bytes of the uncompressed blob (a safe integer, >= 0). */
  size: number;
}

/** Largest blob the store accepts (1 TiB); a digest above it is refused as malformed. */
export const MAX_BLOB_SIZE = 2 ** 40;

const HASH = /^[0-9a-f]{64}$/;
/** A well-formed `<hash>/<size>` (the size still to be checked against MAX_BLOB_SIZE). */
const DIGEST_TEXT = /^([0-9a-f]{64})\/(0|[1-9][0-9]{0,15})$/;

export const EMPTY_DIGEST: Digest = {
  hash: "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
  size: 0,
};

export function formatDigest(d: Digest): string {
  return `${d.hash}/${d.size}`;
}

export const sameDigest = (a: Digest, b: Digest): boolean => a.hash === b.hash && a.size === b.size;

export const isEmptyDigest = (d: Digest): boolean => sameDigest(d, EMPTY_DIGEST);

/** Checks a hash and a size that came apart (URL parameters); `field` names them in the error. */
export function digestOf(hash: string, size: string | number, field = "digest"): Digest {
  const bad = (why: string) =>
    new DispatchCloudError("cas.invalid_digest", `${field}: ${why}`, { path: field });
  if (typeof hash !== "string" || !HASH.test(hash))
    throw bad("the hash must be 64 lower-case hex characters (sha256)");
  const n = typeof size === "number" ? size : /^(0|[1-9][0-9]{0,15})$/.test(size) ? Number(size) : Number.NaN;
  if (!Number.isSafeInteger(n) || n < 0) throw bad("the size must be a whole number of bytes");
  if (n > MAX_BLOB_SIZE) throw bad(`the size must be at most ${MAX_BLOB_SIZE} bytes`);
  return { hash, size: n };
}

/** Parses `<hash>/<size>`; `field` is the path of the value in the request, for the error. */
export function parseDigest(text: unknown, field = "digest"): Digest {
  if (typeof text !== "string") {
    throw new DispatchCloudError("cas.invalid_digest", `${field}: must be a string "<sha256 hex>/<size>"`, {
      path: field,
    });
  }
  // The common case in one test (find-missing parses 10,000 of them per request); a mismatch is explained below.
  const m = DIGEST_TEXT.exec(text);
  if (m !== null) {
    const size = Number(m[2]);
    if (size <= MAX_BLOB_SIZE) return { hash: m[1]!, size };
  }
  const slash = text.indexOf("/");
  if (slash < 0 || text.length > 64 + 1 + 16) {
    throw new DispatchCloudError("cas.invalid_digest", `${field}: must be "<sha256 hex>/<size>"`, {
      path: field,
    });
  }
  return digestOf(text.slice(0, slash), text.slice(slash + 1), field);
}

/** The digest of bytes held in memory. */
export function digestBytes(data: Uint8Array): Digest {
  return { hash: createHash("sha256").update(data).digest("hex"), size: data.byteLength };
}

/** Hashes a stream of chunks as it passes: `update` each chunk, then `digest()`. */
export class DigestBuilder {
  private readonly h = createHash("sha256");
  private n = 0;
  update(chunk: Uint8Array): void {
    this.h.update(chunk);
    this.n += chunk.byteLength;
  }
  get size(): number {
    return this.n;
  }
  digest(): Digest {
    return { hash: this.h.digest("hex"), size: this.n };
  }
}

/** The digest of everything an iterable of chunks yields. */
export async function digestStream(source: AsyncIterable<Uint8Array>): Promise<Digest> {
  const b = new DigestBuilder();
  for await (const chunk of source) b.update(chunk);
  return b.digest();
}
