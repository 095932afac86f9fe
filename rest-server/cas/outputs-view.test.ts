import { mkdir, mkdtemp, readFile, rm, symlink, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Readable } from "node:stream";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { digestBytes } from "../../lib/cas/digest.ts";
import { type Manifest, type ManifestEntry, validateManifest } from "../../lib/cas/manifest.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import { packTar, scanTree } from "../../lib/tar.ts";
import { createOutputStore, type OutputEntry, type OutputStore } from "../outputs.ts";
import { type ManifestOutputs, manifestOutputs } from "./outputs-view.ts";

async function text(entry: OutputEntry): Promise<string> {
  if (entry.kind !== "file") throw new Error("not a file");
  const chunks: Buffer[] = [];
  for await (const c of entry.open()) chunks.push(Buffer.from(c as Uint8Array));
  return Buffer.concat(chunks).toString();
}

/** The same tree on disk (the old outputs store) and as a manifest with its blobs in a map. */
describe("outputs kept as a manifest read like outputs on disk", () => {
  let dir: string;
  let tree: string;
  let disk: OutputStore;
  let view: ManifestOutputs;
  const blobs = new Map<string, Buffer>();
  const reads: string[] = [];

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "dc-outputs-view-"));
    tree = join(dir, "tree");
    await mkdir(join(tree, "a/b"), { recursive: true });
    await mkdir(join(tree, "empty"));
    await writeFile(join(tree, "a.txt"), "dot before slash");
    await writeFile(join(tree, "a/x"), "x in a");
    await writeFile(join(tree, "a/b/deep"), "deep");
    await writeFile(join(tree, "zero"), "");
    await writeFile(join(tree, "run.sh"), "#!/bin/sh\n", { mode: 0o755 });
    await symlink("a/b", join(tree, "to-b"));
    await symlink("../a.txt", join(tree, "a/up"));
    await symlink("loop", join(tree, "loop"));
    await symlink("nowhere", join(tree, "dangling"));
    disk = createOutputStore(join(dir, "outputs"));
    await disk.replace("B", packTar(tree), { maxBytes: 1e9 });

    const entries: ManifestEntry[] = [];
    for (const e of await scanTree(tree)) {
      if (e.kind === "dir") entries.push({ path: e.rel, type: "dir" });
      else if (e.kind === "link") entries.push({ path: e.rel, type: "link", target: e.target });
      else {
        const data = await readFile(join(tree, e.rel));
        const digest = digestBytes(data);
        blobs.set(digest.hash, data);
        entries.push({ path: e.rel, type: "file", digest, executable: (e.mode & 0o111) !== 0 });
      }
    }
    entries.sort((x, y) => Buffer.compare(Buffer.from(x.path), Buffer.from(y.path)));
    const manifest: Manifest = validateManifest({
      version: 1,
      entries: JSON.parse(JSON.stringify(entries, (k, v) => (k === "digest" ? `${v.hash}/${v.size}` : v))),
    });
    view = manifestOutputs("B", manifest, async (d) => {
      reads.push(d.hash);
      const b = blobs.get(d.hash);
      return b === undefined ? null : Readable.from([b]);
    });
  });

  afterAll(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  it("lists every file and link in the same order, page by page, as the disk store", async () => {
    for (const rel of ["", "a", "to-b", "a/b"]) {
      const want = await disk.get("B", rel);
      expect(view.get(rel)).toEqual(want);
    }
    let after: string | null = null;
    const paged: string[] = [];
    for (;;) {
      const page = view.get("", { after, limit: 2 });
      if (page.kind !== "dir" || page.files.length === 0) break;
      paged.push(...page.files.map((f) => f.path));
      after = page.files.at(-1)?.path ?? null;
    }
    const all = await disk.get("B", "");
    expect(paged).toEqual(all.kind === "dir" ? all.files.map((f) => f.path) : []);
    expect(paged.indexOf("a.txt")).toBeLessThan(paged.indexOf("a/x"));
  });

  it("reads files directly and through links, and an empty file without touching the store", async () => {
    expect(await text(view.get("a/x"))).toBe("x in a");
    expect(await text(view.get("to-b/deep"))).toBe("deep");
    expect(await text(view.get("a/up"))).toBe("dot before slash");
    const before = reads.length;
    expect(await text(view.get("zero"))).toBe("");
    expect(reads.length).toBe(before);
  });

  it("answers output.not_found for missing paths, loops, dangling links and paths below a file", async () => {
    for (const rel of ["nope", "loop", "loop/x", "dangling", "a/x/y", "a.txt/z"]) {
      await expect(disk.get("B", rel)).rejects.toBeInstanceOf(DispatchCloudError);
      let code: string | undefined;
      try {
        view.get(rel);
      } catch (err) {
        code = (err as DispatchCloudError).code;
      }
      expect(code, rel).toBe("output.not_found");
    }
  });

  it("packs a directory, a file and the whole tree into archives the disk store extracts to the same tree", async () => {
    for (const rel of ["", "a", "to-b", "run.sh"]) {
      const packed = view.pack(rel);
      expect(packed, rel).not.toBeNull();
      const target = `V${rel.replace(/\W/g, "_")}`;
      await disk.replace(target, packed as Readable, { maxBytes: 1e9 });
      const fromDisk = await disk.pack("B", rel);
      await disk.replace(`D${target}`, fromDisk as Readable, { maxBytes: 1e9 });
      expect(await disk.get(target, "")).toEqual(await disk.get(`D${target}`, ""));
    }
    expect(view.pack("nope")).toBeNull();
    expect(view.pack("loop")).toBeNull();
  });
});
