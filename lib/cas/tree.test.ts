import { chmodSync, mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { digestBytes, formatDigest } from "./digest.ts";
import { canonicalManifest, parseManifest } from "./manifest.ts";
import { eachLimited, manifestOfTree } from "./tree.ts";

const root = mkdtempSync(join(tmpdir(), "cas-tree-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));
let n = 0;
const fresh = () => {
  const d = join(root, `t${++n}`);
  mkdirSync(d);
  return d;
};

describe("manifestOfTree", () => {
  it("lists dirs, files, links inside and empty dirs in canonical order, with executable bits", async () => {
    const d = fresh();
    mkdirSync(join(d, "a/empty"), { recursive: true });
    writeFileSync(join(d, "a/x"), "hello");
    writeFileSync(join(d, "a-b"), "hello"); // same bytes: one blob
    writeFileSync(join(d, "run.sh"), "#!/bin/sh\n");
    chmodSync(join(d, "run.sh"), 0o700);
    symlinkSync("a/x", join(d, "l"));
    symlinkSync(join(d, "a"), join(d, "a/abs")); // absolute, but not under an absoluteRoot: refused below
    await expect(manifestOfTree(d, { shownAs: "/out" })).rejects.toMatchObject({
      code: "output.bad_entry",
      message: expect.stringContaining("/out/a/abs is a symbolic link"),
    });
    rmSync(join(d, "a/abs"));
    symlinkSync("../a-b", join(d, "a/up"));
    const { manifest, files } = await manifestOfTree(d);
    const h = digestBytes(Buffer.from("hello"));
    expect(manifest.entries).toEqual([
      { path: "a", type: "dir" },
      { path: "a-b", type: "file", digest: h, executable: false },
      { path: "a/empty", type: "dir" },
      { path: "a/up", type: "link", target: "../a-b" },
      { path: "a/x", type: "file", digest: h, executable: false },
      { path: "l", type: "link", target: "a/x" },
      { path: "run.sh", type: "file", digest: digestBytes(Buffer.from("#!/bin/sh\n")), executable: true },
    ]);
    // The canonical bytes parse back (sorted by UTF-8 bytes, parents first).
    expect(parseManifest(canonicalManifest(manifest))).toEqual(manifest);
    expect(files.size).toBe(2);
    expect(files.get(h.hash)?.size).toBe(5);
    expect(formatDigest(h)).toMatch(/\/5$/);
  });

  it("refuses a link leaving the tree, naming it as the container saw it", async () => {
    const d = fresh();
    mkdirSync(join(d, "sub"));
    symlinkSync("../../etc/passwd", join(d, "sub/p"));
    await expect(manifestOfTree(d, { shownAs: "/out" })).rejects.toMatchObject({
      code: "output.bad_entry",
      message: expect.stringContaining("/out/sub/p is a symbolic link"),
    });
  });

  it("keeps absolute links under the container's root as relative ones", async () => {
    const d = fresh();
    writeFileSync(join(d, "f"), "x");
    mkdirSync(join(d, "s"));
    symlinkSync("/out/f", join(d, "s/l"));
    const { manifest } = await manifestOfTree(d, { shownAs: "/out" });
    expect(manifest.entries).toContainEqual({ path: "s/l", type: "link", target: "../f" });
  });

  it("refuses more entries than maxEntries", async () => {
    const d = fresh();
    for (let i = 0; i < 5; i++) writeFileSync(join(d, `f${i}`), String(i));
    await expect(manifestOfTree(d, { maxEntries: 4 })).rejects.toMatchObject({
      code: "runner.output_too_many_files",
    });
    expect((await manifestOfTree(d, { maxEntries: 5 })).manifest.entries).toHaveLength(5);
  });

  it("hashes many small files, the empty file included", async () => {
    const d = fresh();
    for (let i = 0; i < 300; i++) writeFileSync(join(d, `f${String(i).padStart(3, "0")}`), `file ${i}`);
    writeFileSync(join(d, "zero"), "");
    const { manifest, files } = await manifestOfTree(d, { concurrency: 4 });
    expect(manifest.entries).toHaveLength(301);
    expect(files.size).toBe(301);
    const e = manifest.entries[7];
    expect(e).toEqual({
      path: "f007",
      type: "file",
      digest: digestBytes(Buffer.from("file 7")),
      executable: false,
    });
    expect(manifest.entries.at(-1)).toMatchObject({ path: "zero", digest: { size: 0 } });
  });
});

describe("eachLimited", () => {
  it("never runs more than the limit at once and throws the first failure", async () => {
    let running = 0;
    let most = 0;
    const seen: number[] = [];
    await eachLimited([...Array(20).keys()], 3, async (i) => {
      running++;
      most = Math.max(most, running);
      await new Promise((r) => setImmediate(r));
      seen.push(i);
      running--;
    });
    expect(most).toBe(3);
    expect(seen.sort((a, b) => a - b)).toEqual([...Array(20).keys()]);
    await expect(
      eachLimited([1, 2, 3], 2, async (i) => {
        if (i === 2) throw new Error("two");
      }),
    ).rejects.toThrow("two");
  });
});
