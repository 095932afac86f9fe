import { randomBytes } from "node:crypto";
import {
  existsSync,
  lstatSync,
  mkdirSync,
  mkdtempSync,
  readFileSync,
  readlinkSync,
  statSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { digestBytes } from "../lib/cas/digest.ts";
import { canonicalManifest, type Manifest } from "../lib/cas/manifest.ts";
import { manifestOfTree } from "../lib/cas/tree.ts";
import { dirReader } from "../test/cas-cache-worker.ts";
import { CasCache } from "./cas-cache.ts";
import { removeStagedTree, stageTree } from "./cas-stage.ts";

const root = mkdtempSync(join(tmpdir(), "cas-stage-"));
const shm = existsSync("/dev/shm") ? mkdtempSync("/dev/shm/cas-stage-") : undefined;
afterAll(async () => {
  for (const d of [root, shm]) if (d !== undefined) await removeStagedTree(d);
});

/** A source tree, its manifest, and a "store" holding its blobs. */
async function source() {
  const src = join(root, `src-${randomBytes(3).toString("hex")}`);
  mkdirSync(join(src, "d/empty"), { recursive: true });
  writeFileSync(join(src, "d/data"), randomBytes(100_000));
  writeFileSync(join(src, "small"), "hello");
  writeFileSync(join(src, "run.sh"), "#!/bin/sh\necho hi\n", { mode: 0o755 });
  writeFileSync(join(src, "nothing"), "");
  symlinkSync("d/data", join(src, "l"));
  const { manifest, files } = await manifestOfTree(src);
  const store = join(root, `store-${randomBytes(3).toString("hex")}`);
  mkdirSync(store);
  for (const [hash, f] of files) writeFileSync(join(store, hash), readFileSync(f.path));
  const bytes = canonicalManifest(manifest);
  const digest = digestBytes(bytes);
  writeFileSync(join(store, digest.hash), bytes);
  return { src, manifest, digest, store };
}

async function stagedFrom(cacheDir: string) {
  const s = await source();
  const cache = new CasCache(cacheDir);
  await cache.fetchManifest(dirReader(s.store), s.digest);
  const target = join(root, `t-${randomBytes(3).toString("hex")}`);
  const r = await stageTree(cache, s.manifest, target);
  return { ...s, cache, target, r };
}

const blobOf = (m: Manifest, p: string) => {
  const e = m.entries.find((x) => x.path === p);
  if (e?.type !== "file") throw new Error(p);
  return e.digest;
};

describe("stageTree", () => {
  it("links files to the cache (same inode, read-only), copies executables 0555, read-only dirs", async () => {
    const { manifest, cache, target, r } = await stagedFrom(join(root, "cache"));
    const data = statSync(join(target, "d/data"));
    const cached = statSync(cache.blobPath(blobOf(manifest, "d/data")));
    expect(data.ino).toBe(cached.ino);
    expect(data.mode & 0o777).toBe(0o444);
    const run = statSync(join(target, "run.sh"));
    expect(run.mode & 0o777).toBe(0o555);
    expect(run.ino).not.toBe(statSync(cache.blobPath(blobOf(manifest, "run.sh"))).ino);
    expect(statSync(cache.blobPath(blobOf(manifest, "run.sh"))).mode & 0o777).toBe(0o444);
    expect(readlinkSync(join(target, "l"))).toBe("d/data");
    expect(lstatSync(join(target, "d/empty")).isDirectory()).toBe(true);
    expect(statSync(join(target, "nothing")).size).toBe(0);
    expect(statSync(join(target, "d")).mode & 0o777).toBe(0o555);
    expect(statSync(target).mode & 0o777).toBe(0o555);
    expect(r).toMatchObject({ files: 4, linked: 2, copied: 1 });
    // The staged tree is the source tree again.
    expect((await manifestOfTree(target)).manifest).toEqual(manifest);
    // Nothing can be added to it by its user without chmod; removal restores writability first.
    if (process.getuid?.() !== 0) expect(() => writeFileSync(join(target, "d/new"), "x")).toThrow(/EACCES/);
    await removeStagedTree(target);
    expect(existsSync(target)).toBe(false);
    expect(existsSync(cache.blobPath(blobOf(manifest, "d/data")))).toBe(true);
  });

  it("copies (read-only) when the cache is on another filesystem", async () => {
    if (shm === undefined || statSync(shm).dev === statSync(root).dev) {
      throw new Error(
        "this test needs /dev/shm on another filesystem than the temporary directory (a tmpfs)",
      );
    }
    {
      const { manifest, cache, target, r } = await stagedFrom(join(shm as string, "cache"));
      expect(r).toMatchObject({ files: 4, linked: 0, copied: 3 });
      const data = statSync(join(target, "d/data"));
      expect(data.ino).not.toBe(statSync(cache.blobPath(blobOf(manifest, "d/data"))).ino);
      expect(data.mode & 0o777).toBe(0o444);
      expect((await manifestOfTree(target)).manifest).toEqual(manifest);
    }
  });
});
