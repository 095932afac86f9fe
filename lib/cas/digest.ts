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

/** 1 for the character codes of lower-case hex digits. */
const HEX_CODE = new Uint8Array(128);
for (const c of "0123456789abcdef") HEX_CODE[c.charCodeAt(0)] = 1;

/**
 * The digest of a well-formed `<hash>/<size>` (64 lower-case hex, a slash, a size without leading zeros, at most
 * MAX_BLOB_SIZE), or null. A loop over character codes: find-missing parses 10,000 digests per request, and
 * this is several times cheaper than a regular expression with captures.
 */
function wellFormedDigest(text: string): Digest | null {
  const n = text.length;
  if (n < 66 || n > 81 || text.charCodeAt(64) !== 47) return null;
  for (let i = 0; i < 64; i++) {
    const c = text.charCodeAt(i);
    if (c > 127 || HEX_CODE[c] === 0) return null;
  }
  if (n > 66 && text.charCodeAt(65) === 48) return null;
  for (let i = 65; i < n; i++) {
    const c = text.charCodeAt(i);
    if (c < 48 || c > 57) return null;
  }
  const size = Number(text.slice(65));
  return size <= MAX_BLOB_SIZE ? { hash: text.slice(0, 64), size } : null;
}

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
  // The common case in one pass; a mismatch is explained below.
  const d = wellFormedDigest(text);
  if (d !== null) return d;
  const slash = text.indexOf("/");
  if (slash < 0 || text.length > 64 + 1 + 16) {
    throw new DispatchCloudError("cas.invalid_digest", `${field}: must be "<sha256 hex>/<size>"`, {
      path: field,
    });
  }
  return digestOf(text.slice(0, slash), text.slice(slash + 1), field);
}

/**
 * Parses a list of `<hash>/<size>` texts; an error names the bad one's index under `field` (`digests/3`). The
 * path of each element is only built for the error (lists of 10,000 are common).
 */
export function parseDigestList(texts: readonly unknown[], field: string): Digest[] {
  const out: Digest[] = new Array(texts.length);
  for (let i = 0; i < texts.length; i++) {
    const t = texts[i];
    out[i] = (typeof t === "string" ? wellFormedDigest(t) : null) ?? parseDigest(t, `${field}/${i}`);
  }
  return out;
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
