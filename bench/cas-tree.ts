/**
 * cas-tree — the runner's side of the content-addressed store on many small files: the manifest of a local tree
 * of N files (hashing 1 and 8 files at once), fetching it into an empty VM cache from a store that is a local
 * directory (no network: the cache's own work), and staging it by hard links.
 *
 * Usage: node --import tsx bench/cas-tree.ts [-- --files N] [--size BYTES]   (defaults 10,000 files of 1 KiB)
 */
import { randomBytes } from "node:crypto";
import { mkdirSync, mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { loadavg, tmpdir } from "node:os";
import path from "node:path";
import { CasCache } from "../crunch-run/cas-cache.ts";
import { removeStagedTree, stageTree } from "../crunch-run/cas-stage.ts";
import { digestBytes } from "../lib/cas/digest.ts";
import { canonicalManifest } from "../lib/cas/manifest.ts";
import { manifestOfTree } from "../lib/cas/tree.ts";
import { dirReader } from "../test/cas-cache-worker.ts";
import { benchArgs } from "./args.ts";

const { values } = benchArgs(
  "Usage: node --import tsx bench/cas-tree.ts [-- --files N] [--size BYTES]   (defaults 10,000 files of 1 KiB)",
  {
    options: { files: { type: "string", default: "10000" }, size: { type: "string", default: "1024" } },
  },
);
const files = Number(values.files);
const size = Number(values.size);
const root = mkdtempSync(path.join(tmpdir(), "bench-cas-tree-"));
const src = path.join(root, "src");
for (let d = 0; d < Math.ceil(files / 100); d++) mkdirSync(path.join(src, `d${d}`), { recursive: true });
for (let i = 0; i < files; i++)
  writeFileSync(path.join(src, `d${Math.floor(i / 100)}`, `f${i}`), randomBytes(size));

const time = async <T>(label: string, fn: () => Promise<T>): Promise<T> => {
  const t0 = performance.now();
  const out = await fn();
  const ms = performance.now() - t0;
  console.log(
    `${label.padEnd(34)} ${ms.toFixed(0).padStart(6)} ms  ${((files / ms) * 1000).toFixed(0)} files/s`,
  );
  return out;
};

console.log(
  `${files} files of ${size} bytes; load average ${loadavg()
    .map((x) => x.toFixed(2))
    .join(" ")}`,
);
await time("manifestOfTree, 1 file at once", () => manifestOfTree(src, { concurrency: 1 }));
const { manifest, files: blobs } = await time("manifestOfTree, 8 files at once", () => manifestOfTree(src));
const store = path.join(root, "store");
mkdirSync(store);
for (const [hash, f] of blobs) writeFileSync(path.join(store, hash), readFileSync(f.path));
const bytes = canonicalManifest(manifest);
const digest = digestBytes(bytes);
writeFileSync(path.join(store, digest.hash), bytes);
const cache = new CasCache(path.join(root, "cache"));
await time("fetchManifest into an empty cache", () => cache.fetchManifest(dirReader(store), digest));
await time("fetchManifest, all in the cache", () => cache.fetchManifest(dirReader(store), digest));
await time("stageTree by hard links", () => stageTree(cache, manifest, path.join(root, "staged")));
await removeStagedTree(root);
