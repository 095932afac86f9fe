import { spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import {
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  statSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { type Digest, digestBytes, formatDigest } from "../lib/cas/digest.ts";
import { canonicalManifest, type Manifest, manifestDigest } from "../lib/cas/manifest.ts";
import { dirReader } from "../test/cas-cache-worker.ts";
import { CasCache, type CasCacheOptions } from "./cas-cache.ts";
import { procStartTime } from "./lock.ts";

const root = mkdtempSync(join(tmpdir(), "cas-cache-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));
let n = 0;
const fresh = (name: string) => {
  const d = join(root, `${name}-${++n}`);
  mkdirSync(d, { recursive: true });
  return d;
};

/** A "store": a directory of blob files named by hash. */
const store = fresh("store");
function storeBlob(data: Buffer): Digest {
  const d = digestBytes(data);
  writeFileSync(join(store, d.hash), data);
  return d;
}
/** A manifest of files `name -> bytes`, stored with its blobs. */
function storeTree(files: Record<string, Buffer>): Digest {
  const m: Manifest = {
    version: 1,
    entries: Object.keys(files)
      .sort()
      .map((p) => ({
        path: p,
        type: "file" as const,
        digest: storeBlob(files[p] as Buffer),
        executable: false,
      })),
  };
  storeBlob(canonicalManifest(m));
  return manifestDigest(m);
}
const reader = dirReader(store);

function cacheWith(opts: CasCacheOptions & { clock?: { t: number } } = {}) {
  const clock = opts.clock ?? { t: 1000 };
  return new CasCache(fresh("cache"), {
    now: () => clock.t,
    fsStats: async () => ({ total: 1e15, free: 1e15 }),
    ...opts,
  });
}
const sizeOf = (f: Record<string, Buffer>) => Object.values(f)[0] as Buffer;

describe("fetchManifest", () => {
  it("fetches what is missing (small by batch, large by download), read-only, then hits", async () => {
    const small = randomBytes(1000);
    const large = randomBytes(200_000);
    const d = storeTree({ a: small, b: large, c: small, e: Buffer.alloc(0) });
    const cache = cacheWith();
    const r1 = await cache.fetchManifest(reader, d);
    expect(r1).toMatchObject({ blobsHit: 0, blobsFetched: 3 });
    expect(r1.bytesFetched).toBe(201_000 + d.size);
    const p = cache.blobPath(digestBytes(large));
    expect(readFileSync(p).equals(large)).toBe(true);
    expect(statSync(p).mode & 0o777).toBe(0o444);
    const ps = cache.blobPath(digestBytes(small));
    expect(readFileSync(ps).equals(small)).toBe(true);
    expect(statSync(ps).mode & 0o777).toBe(0o444);
    expect(p).toMatch(new RegExp(`/blobs/${digestBytes(large).hash.slice(0, 2)}/[0-9a-f]{64}$`));
    const r2 = await cache.fetchManifest(reader, d);
    expect(r2).toMatchObject({ blobsHit: 2, blobsFetched: 0, bytesFetched: 0 });
    expect(await cache.heldManifests()).toEqual([d]);
    expect(readdirSync(join(cache.dir, "tmp"))).toEqual([]);
  });

  it("with a subpath fetches only that part's blobs, and does not count the tree as held", async () => {
    const inside = randomBytes(900);
    const outside = randomBytes(300_000);
    const file = (p: string, data: Buffer) => ({
      path: p,
      type: "file" as const,
      digest: storeBlob(data),
      executable: false,
    });
    const m: Manifest = {
      version: 1,
      entries: [
        { path: "keep", type: "dir" },
        file("keep/x", inside),
        { path: "skip", type: "dir" },
        file("skip/y", outside),
      ],
    };
    storeBlob(canonicalManifest(m));
    const d = manifestDigest(m);
    const cache = cacheWith();
    const r = await cache.fetchManifest(reader, d, { subpath: "keep" });
    expect(r).toMatchObject({ blobsHit: 0, blobsFetched: 2 });
    expect(r.part?.entries.map((e) => e.path)).toEqual(["x"]);
    expect(existsSync(cache.blobPath(digestBytes(inside)))).toBe(true);
    expect(existsSync(cache.blobPath(digestBytes(outside)))).toBe(false);
    expect(await cache.heldManifests()).toEqual([]);
    const none = await cache.fetchManifest(reader, d, { subpath: "nowhere" });
    expect(none.part).toBeNull();
    expect(none.blobsFetched).toBe(0);
    // The whole tree afterwards: only what is left is fetched, and the tree is held.
    const whole = await cache.fetchManifest(reader, d);
    expect(whole).toMatchObject({ blobsHit: 1, blobsFetched: 1 });
    expect(await cache.heldManifests()).toEqual([d]);
  });

  it("refuses corrupt bytes: nothing is cached", async () => {
    const data = randomBytes(500);
    const d = storeTree({ x: data });
    const cache = cacheWith();
    const evil = {
      ...reader,
      batchRead: async (ds: Digest[]) => new Map(ds.map((x) => [x.hash, randomBytes(x.size)])),
    };
    await expect(cache.fetchManifest(evil, d)).rejects.toMatchObject({ code: "cas.digest_mismatch" });
    expect(await cache.has(digestBytes(data))).toBe(false);
    await expect(cache.putBytes(digestBytes(data), Buffer.from("other"))).rejects.toMatchObject({
      code: "cas.digest_mismatch",
    });
    expect(await cache.heldManifests()).toEqual([]);
  });
});

/** Three trees of one 10,000-byte file each, fetched at t = 0, 600, 1200 (A oldest). */
async function threeTrees(cache: CasCache, clock: { t: number }, before3?: () => void) {
  const files = [0, 1, 2].map(() => ({ f: randomBytes(10_000) }));
  const ds = files.map(storeTree);
  for (const [i, d] of ds.entries()) {
    clock.t = i * 600;
    if (i === 2) before3?.();
    await cache.fetchManifest(reader, d);
  }
  const blob = (i: number) => cache.has(digestBytes(sizeOf(files[i] as Record<string, Buffer>)));
  return { ds, held: [await blob(0), await blob(1), await blob(2)] };
}

describe("eviction, least recently used first", () => {
  it("under maxBytes", async () => {
    const clock = { t: 0 };
    const cache = cacheWith({ clock, maxBytes: 25_000 });
    const { ds, held } = await threeTrees(cache, clock);
    expect(held).toEqual([false, true, true]);
    expect(await cache.heldManifests()).toEqual([ds[2], ds[1]]);
  });

  it("under maxItems", async () => {
    const clock = { t: 0 };
    const cache = cacheWith({ clock, maxItems: 4 });
    const { held } = await threeTrees(cache, clock);
    expect(held).toEqual([false, true, true]);
    expect((await cache.usage()).items).toBe(4);
  });

  it("under maxFraction of the filesystem", async () => {
    const clock = { t: 0 };
    const cache = cacheWith({ clock, fsStats: async () => ({ total: 30_000, free: 1e9 }), minFreeBytes: 0 });
    const { held } = await threeTrees(cache, clock);
    expect(held).toEqual([false, true, true]);
  });

  it("to keep minFreeBytes free", async () => {
    const clock = { t: 0 };
    let free = 1e9;
    const cache = cacheWith({ clock, fsStats: async () => ({ total: 1e12, free }), minFreeBytes: 10_000 });
    const { held } = await threeTrees(cache, clock, () => {
      free = 5_000;
    });
    expect(held).toEqual([false, true, true]);
  });

  it("after maxAgeMs unused", async () => {
    const clock = { t: 0 };
    const cache = cacheWith({ clock, maxAgeMs: 1000 });
    const { held } = await threeTrees(cache, clock);
    expect(held).toEqual([false, true, true]);
  });

  it("never a pinned blob while its attempt's lock names the pinning process", async () => {
    const clock = { t: 0 };
    const cache = cacheWith({ clock, maxItems: 4 });
    const lock = join(cache.dir, "..", `lock-${n}`);
    writeFileSync(
      lock,
      JSON.stringify({ uuid: "u", pid: process.pid, startTime: procStartTime(process.pid) }),
    );
    const a = { f: randomBytes(10_000) };
    const da = storeTree(a);
    await cache.fetchManifest(reader, da, { pin: { id: "zzzzz-bndl-000000000000001-1", lockFile: lock } });
    clock.t = 600;
    const b = { f: randomBytes(10_000) };
    await cache.fetchManifest(reader, storeTree(b));
    clock.t = 1200;
    const c = { f: randomBytes(10_000) };
    await cache.fetchManifest(reader, storeTree(c));
    expect(await cache.has(digestBytes(a.f))).toBe(true); // pinned, though oldest
    expect(await cache.has(digestBytes(b.f))).toBe(false);
    // The attempt ends (its lock is gone): the pin no longer counts.
    await expect(cache.pin("../escape", lock, [])).rejects.toThrow(/pin id/);
    rmSync(lock);
    clock.t = 1800;
    const d = { f: randomBytes(10_000) };
    await cache.fetchManifest(reader, storeTree(d));
    expect(await cache.has(digestBytes(a.f))).toBe(false);
    expect(await cache.has(digestBytes(c.f))).toBe(true);
    expect((await cache.evict()).evicted).toBe(0);
    expect(readdirSync(join(cache.dir, "pins"))).toEqual([]);
  });
});

describe("the index", () => {
  it("is rebuilt from a scan of blobs/ when corrupt, keeping every blob", async () => {
    const cache = cacheWith();
    const files = { a: randomBytes(3000), b: randomBytes(70_000) };
    const d = storeTree(files);
    await cache.fetchManifest(reader, d);
    writeFileSync(join(cache.dir, "index.json"), "{not json");
    expect(await cache.usage()).toEqual({ items: 3, bytes: 73_000 + d.size });
    for (const f of Object.values(files)) expect(await cache.has(digestBytes(f))).toBe(true);
    rmSync(join(cache.dir, "index.json"));
    expect((await cache.usage()).items).toBe(3);
    // A fetch after the rebuild finds everything there.
    expect(await cache.fetchManifest(reader, d)).toMatchObject({ blobsFetched: 0, blobsHit: 2 });
  });

  it("keeps a blob's mtime (its last use after a rebuild) to within an hour, so a warm fetch writes none", async () => {
    const clock = { t: Math.round(Date.now()) };
    const cache = cacheWith({ clock });
    const data = randomBytes(3000);
    const d = storeTree({ a: data });
    const p = cache.blobPath(digestBytes(data));
    await cache.fetchManifest(reader, d);
    const first = statSync(p).mtimeMs;
    expect(Math.abs(first - clock.t)).toBeLessThan(60_000);
    clock.t += 59 * 60_000; // used again within the hour: the index says so, the mtime is left
    await cache.fetchManifest(reader, d);
    expect(statSync(p).mtimeMs).toBe(first);
    clock.t += 2 * 60_000; // more than an hour after the mtime's use: rewritten
    await cache.fetchManifest(reader, d);
    expect(Math.round(statSync(p).mtimeMs)).toBe(clock.t);
  });

  it("breaks a lock left by a dead process", async () => {
    const cache = cacheWith();
    await cache.init();
    writeFileSync(
      join(cache.dir, "index.lock"),
      JSON.stringify({ uuid: "cas-cache", pid: 2 ** 22 + 7, startTime: "1" }),
    );
    expect(await cache.usage()).toEqual({ items: 0, bytes: 0 });
    expect(existsSync(join(cache.dir, "index.lock"))).toBe(false);
  });

  it("removes temporary files of processes that are gone when opened", async () => {
    const dir = fresh("tmpclean");
    mkdirSync(join(dir, "tmp"), { recursive: true });
    writeFileSync(join(dir, "tmp", `${2 ** 22 + 9}-abc`), "partial download");
    writeFileSync(join(dir, "tmp", `${process.pid}-def`), "ours, in progress");
    await new CasCache(dir).init();
    expect(readdirSync(join(dir, "tmp"))).toEqual([`${process.pid}-def`]);
  });

  it("stays whole when two processes fetch into the cache at once", async () => {
    const dir = fresh("shared");
    const shared = randomBytes(100_000);
    const ds: string[][] = [[], []];
    for (let i = 0; i < 12; i++) {
      const d = storeTree({ s: shared, u: randomBytes(2000 + i), v: randomBytes(80_000 + i) });
      ds[i % 2]?.push(formatDigest(d));
    }
    const run = (list: string[]) =>
      new Promise<number>((resolve) => {
        const child = spawn(
          process.execPath,
          ["--import", "tsx", "test/cas-cache-worker.ts", dir, store, ...list],
          {
            stdio: ["ignore", "ignore", "inherit"],
          },
        );
        child.on("exit", (code) => resolve(code ?? -1));
      });
    const both = [
      run([...(ds[0] as string[]), ...(ds[1] as string[])]),
      run([...(ds[1] as string[]), ...(ds[0] as string[])]),
    ];
    expect(await Promise.all(both)).toEqual([0, 0]);
    const cache = new CasCache(dir);
    const index = JSON.parse(readFileSync(join(dir, "index.json"), "utf8")) as {
      blobs: Record<string, [number, number]>;
    };
    // 12 manifests, 12 × 2 own blobs, 1 shared.
    expect(Object.keys(index.blobs)).toHaveLength(12 + 24 + 1);
    for (const [hash, [size]] of Object.entries(index.blobs)) {
      const bytes = readFileSync(cache.blobPath(hash));
      expect(digestBytes(bytes)).toEqual({ hash, size });
    }
    expect((await cache.heldManifests()).length).toBe(12);
    expect(existsSync(join(dir, "index.lock"))).toBe(false);
    expect(readdirSync(join(dir, "tmp"))).toEqual([]);
  });
});
