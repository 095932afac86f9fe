/**
 * bench:staging — moving a bundle's inputs onto an instance through the content-addressed store (docs/storage.md),
 * against the plain copy the same machine does, in one run. For a tree the bench makes (default 10,000 files,
 * 2 GB: 9,000 small files and 1,000 of about 1.8 MB, random bytes), a REST server on loopback (PGlite, or
 * PostgreSQL with --db pg) and an empty VM cache in a fresh directory:
 *   1. `tar -c | tar -x` of the tree (the baseline of a cold copy);
 *   2. cold staging: the tree uploaded once (not timed), then fetched into the empty cache and staged by hard links
 *      (crunch-run's path: fetchManifest + stageTree); the ratio to 1 (target <= 2x);
 *   3. warm staging: the same again with every blob cached (target <= 0.5 s), and a bare loop of mkdir + link over
 *      the same tree from the same cache (target: warm <= 3x that loop);
 *   4. find-missing of 10,000 digests (median of 5; target <= 50 ms);
 *   5. an output upload where 90 % of the blobs are already stored: bytes sent, blobs skipped.
 *
 * Usage: npm run bench:staging [-- --files N] [--bytes SIZE] [--db pglite|pg] [--keep-tree]
 * The tree is kept in $TMPDIR/dc-bench-staging-<files>-<bytes> between runs (delete it to make a fresh one).
 */
import { execFileSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { link, mkdir } from "node:fs/promises";
import { loadavg, tmpdir } from "node:os";
import path from "node:path";
import { CasCache } from "../crunch-run/cas-cache.ts";
import { removeStagedTree, stageTree } from "../crunch-run/cas-stage.ts";
import { createCasClient } from "../lib/cas/client.ts";
import { formatDigest } from "../lib/cas/digest.ts";
import { formatSize, parseSize } from "../lib/units.ts";
import { benchArgs } from "./args.ts";
import { forkBenchServer, startBenchServer } from "./rest-server.ts";

const { values, positionals } = benchArgs(
  "Usage: npm run bench:staging [-- --files N] [--bytes SIZE] [--db pglite|pg] [--keep-tree]",
  {
    allowPositionals: true,
    options: {
      serve: { type: "boolean", default: false },
      files: { type: "string", default: "10000" },
      bytes: { type: "string", default: "2GB" },
      db: { type: "string", default: "pglite" },
    },
  },
);
if (values.serve) {
  // The server process (forkBenchServer): PGlite or PostgreSQL, data in the given directory.
  const { db, app, url, token } = await startBenchServer({
    db: values.db === "pg" ? "pg" : "pglite",
    dataDir: positionals[0] ?? "",
    maxRequestBodySize: 8 * 2 ** 20,
  });
  process.on("message", async (m: string) => {
    if (m !== "stop") return;
    await app.close();
    await db.close();
    process.exit(0);
  });
  process.send?.({ ready: { url, token } });
  await new Promise(() => {});
}
const files = Number(values.files);
const totalBytes = parseSize(values.bytes);
const line = (label: string, text: string) => console.log(`${label.padEnd(44)} ${text}`);
const ms = (t0: number) => performance.now() - t0;

/** The tree: 90 % small files (4-64 KiB), 10 % large ones taking the rest of the bytes; random bytes. */
function makeTree(dir: string): void {
  if (existsSync(path.join(dir, ".complete"))) return;
  rmSync(dir, { recursive: true, force: true });
  const large = Math.max(1, Math.floor(files / 10));
  const small = files - large;
  const smallSize = (i: number) => 4096 + ((i * 7919) % 61440);
  let smallTotal = 0;
  for (let i = 0; i < small; i++) smallTotal += smallSize(i);
  const largeSize = Math.max(1, Math.floor((totalBytes - smallTotal) / large));
  console.log(`making the tree: ${small} files of 4-64 KiB and ${large} of ${formatSize(largeSize)} ...`);
  for (let i = 0; i < files; i++) {
    const sub = path.join(dir, "tree", `d${Math.floor(i / 100)}`);
    if (i % 100 === 0) mkdirSync(sub, { recursive: true });
    writeFileSync(path.join(sub, `f${i}`), randomBytes(i % 10 === 0 ? largeSize : smallSize(i)));
  }
  writeFileSync(path.join(dir, ".complete"), "");
}

const treeHome = path.join(tmpdir(), `dc-bench-staging-${files}-${totalBytes}`);
makeTree(treeHome);
const tree = path.join(treeHome, "tree");
const work = mkdtempSync(path.join(tmpdir(), "dc-bench-staging-run-"));
console.log(
  `bench:staging: ${files} files, ${formatSize(totalBytes)}; database ${values.db}; load average ${loadavg()
    .map((x) => x.toFixed(2))
    .join(" ")}`,
);

// The server in a process of its own, as it is on a real cluster (the VM's crunch-run is another machine).
const server = await forkBenchServer(import.meta.filename, [
  "--serve",
  "--db",
  values.db,
  path.join(work, "server"),
]);
const { url, token } = server;
/** The server process's CPU time so far (utime + stime from /proc, in ms). */
const serverCpuMs = (): number => {
  const fields = readFileSync(`/proc/${server.child.pid}/stat`, "utf8").split(") ")[1]?.split(" ") ?? [];
  return ((Number(fields[11]) + Number(fields[12])) * 1000) / 100;
};
const client = createCasClient({ url, token });

try {
  // 1. The baseline: a plain copy of the tree through a pipe.
  let t0 = performance.now();
  mkdirSync(path.join(work, "tar"));
  execFileSync("sh", ["-c", `tar -C "${tree}" -cf - . | tar -C "${path.join(work, "tar")}" -xf -`]);
  const tarMs = ms(t0);
  line("tar -c | tar -x", `${tarMs.toFixed(0)} ms`);
  rmSync(path.join(work, "tar"), { recursive: true, force: true });

  // The tree into the store (set-up, shown but not a target).
  t0 = performance.now();
  const up = await client.uploadTree(tree);
  line("upload into an empty store (set-up)", `${ms(t0).toFixed(0)} ms, ${formatSize(up.bytesSent)} sent`);

  // 2. Cold staging.
  const cache = new CasCache(path.join(work, "vm-cache"));
  t0 = performance.now();
  const cpu0 = { bench: process.cpuUsage(), server: serverCpuMs() };
  const cold = await cache.fetchManifest(client, up.digest);
  const coldFetchMs = ms(t0);
  const coldTarget = path.join(work, "cold");
  await stageTree(cache, cold.manifest, coldTarget);
  const coldMs = ms(t0);
  const coldCpu = {
    bench: (process.cpuUsage(cpu0.bench).user + process.cpuUsage(cpu0.bench).system) / 1000,
    server: serverCpuMs() - cpu0.server,
  };
  line(
    "cold staging (fetch + hard links)",
    `${coldMs.toFixed(0)} ms = ${(coldMs / tarMs).toFixed(2)}x tar (target <= 2x) (fetch ${coldFetchMs.toFixed(0)} ms, links ${(coldMs - coldFetchMs).toFixed(0)} ms; CPU: this process ${coldCpu.bench.toFixed(0)} ms, the server ${coldCpu.server.toFixed(0)} ms); ${cold.blobsFetched} blobs, ${formatSize(cold.bytesFetched)} fetched`,
  );

  // 3. Warm staging, and a bare hard-link loop over the same tree.
  t0 = performance.now();
  const warm = await cache.fetchManifest(client, up.digest);
  const warmFetchMs = ms(t0);
  await stageTree(cache, warm.manifest, path.join(work, "warm"));
  const warmMs = ms(t0);
  t0 = performance.now();
  const bare = path.join(work, "bare");
  for (const e of warm.manifest.entries) {
    const p = path.join(bare, e.path);
    if (e.type === "dir") await mkdir(p, { recursive: true });
    else if (e.type === "file") await link(cache.blobPath(e.digest), p);
  }
  const bareMs = ms(t0);
  line(
    "warm staging (all cached)",
    `${warmMs.toFixed(0)} ms (target <= 500 ms; cache check ${warmFetchMs.toFixed(0)} ms, links ${(warmMs - warmFetchMs).toFixed(0)} ms) = ${(warmMs / bareMs).toFixed(2)}x a bare mkdir+link loop of ${bareMs.toFixed(0)} ms (target <= 3x); ${warm.blobsHit} hits, ${warm.blobsFetched} fetched`,
  );

  // 4. find-missing of 10,000 digests (those of the tree: all present).
  const digests = warm.manifest.entries
    .flatMap((e) => (e.type === "file" ? [e.digest] : []))
    .slice(0, 10_000);
  const rounds: number[] = [];
  for (let i = 0; i < 5; i++) {
    t0 = performance.now();
    await client.findMissing(digests);
    rounds.push(ms(t0));
  }
  rounds.sort((a, b) => a - b);
  line(
    `find-missing of ${digests.length} digests`,
    `median ${rounds[2]!.toFixed(1)} ms (target <= 50 ms); rounds ${rounds.map((r) => r.toFixed(0)).join(", ")} ms`,
  );

  // 5. An output where 90 % of the blobs are stored already.
  const out = path.join(work, "output");
  let fresh = 0;
  let freshBytes = 0;
  for (const e of warm.manifest.entries) {
    const p = path.join(out, e.path);
    if (e.type === "dir") mkdirSync(p, { recursive: true });
    else if (e.type === "file") {
      if (Number(/f(\d+)$/.exec(e.path)?.[1] ?? 0) % 10 === 5) {
        const data = randomBytes(e.digest.size);
        writeFileSync(p, data);
        fresh++;
        freshBytes += data.length;
      } else await link(cache.blobPath(e.digest), p);
    }
  }
  t0 = performance.now();
  const again = await client.uploadTree(out);
  line(
    "output upload, 90 % of the blobs stored",
    `${ms(t0).toFixed(0)} ms; sent ${formatSize(again.bytesSent)} of ${formatSize(again.bytes)} (${fresh} new files, ${formatSize(freshBytes)}); ${again.blobsSkipped} blobs skipped, ${again.blobsUploaded} uploaded; manifest ${formatDigest(again.digest).slice(0, 16)}...`,
  );
  await removeStagedTree(path.join(work, "cold")).catch(() => {});
  await removeStagedTree(path.join(work, "warm")).catch(() => {});
} finally {
  client.close();
  await server.stop();
  rmSync(work, { recursive: true, force: true });
}
