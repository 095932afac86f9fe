/**
 * The binary answer of `POST /cas/batch-read` (docs/storage.md, "The API"), asked for with
 * `Accept: application/vnd.dispatch-cloud.cas-batch`: one line of JSON, `{"blobs": [...]}`, one entry per digest
 * asked, in order, each `{digest, size}` (its bytes follow) or `{digest, error: {code, message}}`; then the bytes
 * of the entries with a size, one after the other. No base64 and no bytes inside a JSON string, so neither end
 * encodes, escapes or parses the data.
 */

export const BATCH_BINARY_TYPE = "application/vnd.dispatch-cloud.cas-batch";

export type BatchEntry =
  | { digest: string; data: Buffer }
  | { digest: string; error: { code?: string; message?: string } };

/** The answer's bytes from its entries (an entry with data contributes its size and its bytes). */
export function joinBatch(entries: readonly BatchEntry[]): Buffer {
  const head = entries.map((e) => ("error" in e ? e : { digest: e.digest, size: e.data.length }));
  const parts: Buffer[] = [Buffer.from(`${JSON.stringify({ blobs: head })}\n`)];
  for (const e of entries) if (!("error" in e)) parts.push(e.data);
  return Buffer.concat(parts);
}

/** Reads an answer made by joinBatch; throws on one that is cut short, too long, or not of this form. */
export function splitBatch(body: Buffer): BatchEntry[] {
  const nl = body.indexOf(0x0a);
  if (nl < 0) throw new Error("batch-read: the answer has no header line");
  const head = JSON.parse(body.subarray(0, nl).toString("utf8")) as { blobs?: unknown };
  if (!Array.isArray(head.blobs)) throw new Error("batch-read: the answer's header has no blobs");
  let at = nl + 1;
  const out: BatchEntry[] = [];
  for (const raw of head.blobs as Record<string, unknown>[]) {
    const digest = String(raw?.["digest"] ?? "");
    if (raw?.["error"] !== undefined) {
      out.push({ digest, error: raw["error"] as { code?: string; message?: string } });
      continue;
    }
    const size = raw?.["size"];
    if (typeof size !== "number" || !Number.isSafeInteger(size) || size < 0 || at + size > body.length) {
      throw new Error(`batch-read: the answer is cut short or malformed at ${digest}`);
    }
    out.push({ digest, data: body.subarray(at, at + size) });
    at += size;
  }
  if (at !== body.length) throw new Error("batch-read: the answer has bytes after its last blob");
  return out;
}
