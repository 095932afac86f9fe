/**
 * A bundle's input manifests (bundles.input_manifests, store/migrations/006_locality.sql): the digest of each
 * input tree's manifest and the bytes of the tree's files, which the scheduler weighs against what each
 * instance's cache holds (docs/storage.md "Locality"). The column is JSON, so what is read is checked here and
 * never trusted: bad contents are no inputs, with the reason, never an exception.
 */
import { parseDigest } from "../lib/cas/digest.ts";
import type { InputManifest } from "./types.ts";

/** Most entries a bundle's list may have; a longer list is ignored as bad contents. */
export const MAX_INPUT_MANIFESTS = 1000;

const NONE: readonly InputManifest[] = Object.freeze([]);

/**
 * The checked list of a bundle's `input_manifests` value: `{manifests}` (repeated digests kept once), or, when
 * anything in it is not an `{digest, bytes}` object with a valid digest and a whole number of bytes >= 0, an
 * empty list and `problem` saying what (the caller warns). A missing value (undefined, null) is no inputs.
 */
export function readInputManifests(raw: unknown): {
  manifests: readonly InputManifest[];
  problem: string | null;
} {
  if (raw === undefined || raw === null) return { manifests: NONE, problem: null };
  const bad = (why: string) => ({ manifests: NONE, problem: `input_manifests ignored: ${why}` });
  if (!Array.isArray(raw)) return bad("not a JSON array");
  if (raw.length === 0) return { manifests: NONE, problem: null };
  if (raw.length > MAX_INPUT_MANIFESTS)
    return bad(`more than ${MAX_INPUT_MANIFESTS} entries (${raw.length})`);
  const out: InputManifest[] = [];
  const seen = new Set<string>();
  for (let i = 0; i < raw.length; i++) {
    const e: unknown = raw[i];
    if (typeof e !== "object" || e === null || Array.isArray(e)) return bad(`[${i}] is not an object`);
    const { digest, bytes } = e as { digest?: unknown; bytes?: unknown };
    try {
      parseDigest(digest, `[${i}].digest`);
    } catch (err) {
      return bad((err as Error).message);
    }
    if (typeof bytes !== "number" || !Number.isSafeInteger(bytes) || bytes < 0) {
      return bad(`[${i}].bytes: must be a whole number of bytes`);
    }
    const d = digest as string;
    if (seen.has(d)) continue;
    seen.add(d);
    out.push({ digest: d, bytes });
  }
  return { manifests: out, problem: null };
}
