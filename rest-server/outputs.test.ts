import { lstat, mkdtemp, readdir, readFile, readlink, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Readable } from "node:stream";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { DispatchCloudError } from "../lib/errors.ts";
import { extractTar } from "../lib/tar.ts";
import { createOutputStore, type OutputStore, parseOutputPath } from "./outputs.ts";

/** A one-file ustar archive. */
function tarOf(name: string, content: string): Buffer {
  const data = Buffer.from(content);
  const h = Buffer.alloc(512);
  h.write(name, 0);
  h.write("0000644\0", 100);
  h.write("0000000\0", 108);
  h.write("0000000\0", 116);
  h.write(`${data.length.toString(8).padStart(11, "0")}\0`, 124);
  h.write("00000000000\0", 136);
  h.write("        ", 148);
  h.write("0", 156);
  h.write("ustar\0", 257);
  h.write("00", 263);
  let sum = 0;
  for (const b of h) sum += b;
  h.write(`${sum.toString(8).padStart(6, "0")}\0 `, 148);
  return Buffer.concat([h, data, Buffer.alloc((512 - (data.length % 512)) % 512), Buffer.alloc(1024)]);
}

/** A one-file archive whose name travels in a pax header (so it may be longer than ustar's 255 bytes). */
function paxTarOf(name: string, content: string): Buffer {
  const record = (len: number) => `${len} path=${name}\n`;
  let len = Buffer.byteLength(record(0));
  while (Buffer.byteLength(record(len)) !== len) len = Buffer.byteLength(record(len));
  const pax = Buffer.from(record(len));
  const header = tarOf("PaxHeader", "x".repeat(pax.length)).subarray(0, 512);
  header.write("x", 156);
  header.write("        ", 148);
  let sum = 0;
  for (const b of header) sum += b;
  header.write(`${sum.toString(8).padStart(6, "0")}\0 `, 148);
  const padded = Buffer.concat([pax, Buffer.alloc((512 - (pax.length % 512)) % 512)]);
  return Buffer.concat([header, padded, tarOf("placeholder", content)]);
}

describe("parseOutputPath", () => {
  it("normalises a trailing slash and keeps names as they are", () => {
    expect(parseOutputPath("")).toBe("");
    expect(parseOutputPath("a/b/")).toBe("a/b");
    expect(parseOutputPath("a b/..c/c..")).toBe("a b/..c/c..");
  });

  it("refuses a name over 255 bytes (counted in UTF-8) and a path over 4096 bytes; takes 255-byte names", () => {
    const name255 = "n".repeat(255);
    expect(parseOutputPath(`${name255}/${name255}`)).toBe(`${name255}/${name255}`);
    for (const bad of [
      "x".repeat(256),
      `a/${"x".repeat(256)}/b`,
      "é".repeat(128),
      Array.from({ length: 18 }, () => "y".repeat(240)).join("/"),
    ]) {
      expect(() => parseOutputPath(bad), bad.slice(0, 20)).toThrow(
        expect.objectContaining({ code: "request.invalid_param", path: "path" }),
      );
    }
    expect(() => parseOutputPath("x".repeat(256), "subpath")).toThrow(
      expect.objectContaining({ code: "request.invalid_param", path: "subpath" }),
    );
  });

  it("refuses ., .., absolute paths, empty names and NUL", () => {
    for (const bad of [".", "..", "a/../b", "./a", "/a", "a//b", "a\u0000b", "x".repeat(5000)]) {
      expect(() => parseOutputPath(bad), bad).toThrow(
        expect.objectContaining({ code: "request.invalid_param", path: "path" }),
      );
    }
  });
});

describe("output store", () => {
  let dir: string;
  let store: OutputStore;
  const uuid = "zzzzz-bndl-000000000000001";
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "dc-outputs-"));
    store = createOutputStore(join(dir, "outputs"));
  });
  afterAll(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  it("has empty outputs before any upload: an empty listing and an empty archive", async () => {
    expect(await store.get(uuid, "")).toEqual({ kind: "dir", files: [] });
    await expect(store.get(uuid, "x")).rejects.toMatchObject({ code: "output.not_found" });
    const tar = await store.pack(uuid, "");
    const into = await mkdtemp(join(dir, "x-"));
    expect(await extractTar(tar!, into)).toEqual({ files: 0, bytes: 0 });
    expect(await store.pack(uuid, "x")).toBeNull();
  });

  it("swaps a symlink to the new directory and removes the old one", async () => {
    await store.replace(uuid, Readable.from([tarOf("a.txt", "first")]), { maxBytes: 100 });
    const first = await readlink(join(dir, "outputs", uuid));
    await store.replace(uuid, Readable.from([tarOf("b.txt", "second")]), { maxBytes: 100 });
    const second = await readlink(join(dir, "outputs", uuid));
    expect(second).not.toBe(first);
    expect(first).not.toContain("/");
    await expect(lstat(join(dir, "outputs", first))).rejects.toMatchObject({ code: "ENOENT" });
    expect(await store.get(uuid, "")).toEqual({ kind: "dir", files: [{ path: "b.txt", size: 6 }] });
    const file = await store.get(uuid, "b.txt");
    expect(file.kind).toBe("file");
    if (file.kind === "file") {
      const parts: Buffer[] = [];
      for await (const c of file.open()) parts.push(c as Buffer);
      expect(Buffer.concat(parts).toString()).toBe("second");
    }
    expect(await readFile(join(dir, "outputs", uuid, "b.txt"), "utf8")).toBe("second");
  });

  it("discards an upload whose commit check fails, and one over the size limit", async () => {
    const refuse = new DispatchCloudError("runner.not_current", "no longer current");
    await expect(
      store.replace(uuid, Readable.from([tarOf("c.txt", "third")]), {
        maxBytes: 100,
        beforeCommit: async () => {
          throw refuse;
        },
      }),
    ).rejects.toBe(refuse);
    await expect(
      store.replace(uuid, Readable.from([tarOf("d.txt", "x".repeat(101))]), { maxBytes: 100 }),
    ).rejects.toMatchObject({ code: "runner.output_too_large" });
    expect(await store.get(uuid, "")).toEqual({ kind: "dir", files: [{ path: "b.txt", size: 6 }] });
    const names = await readdir(join(dir, "outputs"));
    expect(names.filter((n) => n.includes(uuid))).toHaveLength(2);
  });

  it("refuses archive entries with a name over 255 bytes or too long a path, and finds no such output", async () => {
    const before = await store.get(uuid, "");
    for (const name of [
      `dir/${"x".repeat(256)}`,
      Array.from({ length: 16 }, () => "z".repeat(255)).join("/"),
    ]) {
      await expect(
        store.replace(uuid, Readable.from([paxTarOf(name, "data")]), { maxBytes: 100 }),
      ).rejects.toMatchObject({ code: "runner.bad_archive" });
    }
    expect(await store.get(uuid, "")).toEqual(before);
    // A path within the limits that, below the outputs directory, no filesystem can hold: not found.
    const deep = Array.from({ length: 16 }, () => "z".repeat(255)).join("/");
    await expect(store.get(uuid, deep)).rejects.toMatchObject({ code: "output.not_found" });
    expect(await store.pack(uuid, deep)).toBeNull();
  });
});
