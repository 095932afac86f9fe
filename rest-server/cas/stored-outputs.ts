/**
 * Outputs kept in the content-addressed store: a bundle whose runner finished with an `outputManifest` is read
 * through its manifest (outputs-view.ts), the listing, the files and the archives of dependencies alike. Parsed
 * manifests are kept for the last few bundles asked about, so paging through a large listing parses it once.
 */
import type { Readable } from "node:stream";
import { digestBytes, parseDigest, sameDigest } from "../../lib/cas/digest.ts";
import { type Manifest, parseManifest } from "../../lib/cas/manifest.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import type { BlobBackend } from "./backend.ts";
import { type ManifestOutputs, manifestOutputs } from "./outputs-view.ts";

/** Parsed manifests kept at once (a manifest of 50,000 files is some 10 MB parsed). */
const KEPT = 8;

export interface StoredOutputs {
  /** The outputs of a bundle whose outputs are the manifest `digestText`. */
  of(uuid: string, digestText: string): Promise<ManifestOutputs>;
}

async function readAll(stream: Readable): Promise<Buffer> {
  const chunks: Buffer[] = [];
  for await (const c of stream) chunks.push(Buffer.from(c as Uint8Array));
  return Buffer.concat(chunks);
}

export function createStoredOutputs(backend: () => BlobBackend | null): StoredOutputs {
  const kept = new Map<string, Manifest>();
  const lost = (what: string) => new DispatchCloudError("cas.not_found", `the store has lost ${what}`);

  async function load(digestText: string): Promise<Manifest> {
    const hit = kept.get(digestText);
    if (hit !== undefined) {
      kept.delete(digestText);
      kept.set(digestText, hit);
      return hit;
    }
    const be = backend();
    if (be === null) throw lost("the outputs' manifest (no store is configured)");
    const d = parseDigest(digestText, "outputManifest");
    const stream = await be.read(d);
    if (stream === null) throw lost(`the outputs' manifest ${digestText}`);
    const bytes = await readAll(stream);
    if (!sameDigest(digestBytes(bytes), d))
      throw lost(`the outputs' manifest ${digestText} (its bytes changed)`);
    const m = parseManifest(bytes);
    kept.set(digestText, m);
    while (kept.size > KEPT) kept.delete(kept.keys().next().value as string);
    return m;
  }

  return {
    async of(uuid, digestText) {
      const m = await load(digestText);
      return manifestOutputs(uuid, m, async (d) => {
        const be = backend();
        return be === null ? null : be.read(d);
      });
    },
  };
}
