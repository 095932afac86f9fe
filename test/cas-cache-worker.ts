/**
 * A second process using the same cache (crunch-run/cas-cache.test.ts): fetches manifests from a "store" that
 * is a directory of blob files, as `node --import tsx test/cas-cache-worker.ts <cacheDir> <storeDir> <digest>...`.
 */
import { copyFile, readFile } from "node:fs/promises";
import path from "node:path";
import { CasCache, type CasReader } from "../crunch-run/cas-cache.ts";
import { parseDigest } from "../lib/cas/digest.ts";
import { parseManifest } from "../lib/cas/manifest.ts";

export function dirReader(store: string): CasReader {
  return {
    async getManifest(d) {
      const bytes = await readFile(path.join(store, d.hash));
      return { manifest: parseManifest(bytes), bytes };
    },
    async batchRead(ds) {
      const out = new Map<string, Buffer>();
      for (const d of ds) out.set(d.hash, await readFile(path.join(store, d.hash)));
      return out;
    },
    async download(d, file) {
      await copyFile(path.join(store, d.hash), file);
    },
  };
}

if (process.argv[1]?.endsWith("cas-cache-worker.ts")) {
  const [cacheDir, store, ...digests] = process.argv.slice(2) as [string, string, ...string[]];
  const cache = new CasCache(cacheDir, { maxItems: 1_000_000 });
  for (const d of digests) await cache.fetchManifest(dirReader(store), parseDigest(d));
}
