/**
 * The conformance suite every BlobBackend passes (rest-server/cas/backend.ts): the same tests, run against each
 * backend by its own test file (`describeBlobBackend("s3", ...)` in test/cas-backend-s3.test.ts). It lives under
 * test/ because it imports vitest; production code never imports it.
 */
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { mkdtemp, open, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { Readable } from "node:stream";
import { buffer } from "node:stream/consumers";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { type Digest, digestBytes, formatDigest } from "../lib/cas/digest.ts";
import type { BlobBackend } from "../rest-server/cas/backend.ts";

export interface BackendUnderTest {
  /** A backend with nothing stored yet. */
  backend: BlobBackend;
  /** Where the suite puts the files it hands to adoptFile (the same filesystem as the backend's, if it has one). */
  tmpDir: string;
  /**
   * Starts storing `data` under `digest` and breaks the write off midway, the way this backend's writes fail in
   * life (S3: the PUT's connection is cut mid-body; filesystem: the writer dies before the rename). Resolves once
   * the write has been broken off; the suite then checks that nothing is visible under the digest.
   */
  interruptWrite(digest: Digest, data: Uint8Array): Promise<void>;
  close(): Promise<void>;
}

/** Bytes that differ from one call to the next (a seed) and within the blob. */
export function testBytes(size: number, seed: number): Buffer {
  const b = Buffer.alloc(size);
  let x = (seed * 2654435761 + 1) >>> 0;
  for (let i = 0; i < size; i++) {
    x = (x * 1664525 + 1013904223) >>> 0;
    b[i] = x >>> 24;
  }
  return b;
}

/** The stream's bytes are `want` (compared by digest: deep equality of large buffers is slow). */
async function expectBytes(stream: Readable | null, want: Uint8Array): Promise<void> {
  const got = await readAll(stream);
  expect(got, "the backend has the blob").not.toBeNull();
  expect(digestBytes(got as Buffer)).toEqual(digestBytes(want));
}

async function readAll(stream: Readable | null): Promise<Buffer | null> {
  return stream === null ? null : buffer(stream);
}

/** A FIFO at `path` (for backends that read the file they adopt: half the bytes, then the end). */
export function makeFifo(path: string): void {
  const r = spawnSync("mkfifo", [path]);
  if (r.status !== 0) throw new Error(`mkfifo ${path}: ${r.stderr}`);
}

/**
 * Feeds the first half of `data` into the FIFO at `path` and closes it: a backend reading it sees the file end
 * early. Resolves once the bytes are in and the FIFO is closed.
 */
export async function feedHalf(path: string, data: Uint8Array): Promise<void> {
  const fh = await open(path, "w");
  try {
    await fh.write(data.subarray(0, Math.floor(data.byteLength / 2)));
  } finally {
    await fh.close();
  }
}

export function describeBlobBackend(name: string, factory: () => Promise<BackendUnderTest>): void {
  describe(`BlobBackend conformance: ${name}`, () => {
    let t: BackendUnderTest;
    let be: BlobBackend;
    let seed = 0;
    const blob = (size: number) => {
      const data = testBytes(size, ++seed);
      return { data, digest: digestBytes(data) };
    };
    const fileOf = async (data: Uint8Array) => {
      const f = join(t.tmpDir, `upload-${++seed}`);
      await writeFile(f, data);
      return f;
    };

    beforeEach(async () => {
      t = await factory();
      be = t.backend;
    });
    afterEach(async () => {
      await t.close();
    });

    it("reads back what writeBytes and adoptFile stored, and adoptFile takes the file away", async () => {
      const a = blob(1000);
      const b = blob(70_000);
      await be.writeBytes(a.digest, a.data);
      const f = await fileOf(b.data);
      await be.adoptFile(b.digest, f);
      expect(existsSync(f)).toBe(false);
      await expectBytes(await be.read(a.digest), a.data);
      await expectBytes(await be.read(b.digest), b.data);
      expect(await be.has(a.digest)).toBe(true);
      expect(await be.has(b.digest)).toBe(true);
    });

    it("readSmallSync, where the backend has it, reads what read reads, and null for what it does not have", async () => {
      const a = blob(3000);
      const absent = blob(40);
      await be.writeBytes(a.digest, a.data);
      if (be.readSmallSync === undefined) {
        expect(be.kind).not.toBe("filesystem"); // the filesystem backend must have it
        return;
      }
      expect(be.readSmallSync(a.digest)?.equals(a.data)).toBe(true);
      expect(be.readSmallSync(absent.digest)).toBeNull();
      // Stored under another size: not this blob.
      expect(be.readSmallSync({ hash: a.digest.hash, size: a.digest.size + 1 })).toBeNull();
    });

    it("reads ranges [start, end) and [start, size)", async () => {
      const a = blob(10_000);
      await be.writeBytes(a.digest, a.data);
      await expectBytes(await be.read(a.digest, { start: 100, end: 350 }), a.data.subarray(100, 350));
      await expectBytes(await be.read(a.digest, { start: 9_000 }), a.data.subarray(9_000));
      await expectBytes(await be.read(a.digest, { start: 0, end: 1 }), a.data.subarray(0, 1));
      await expectBytes(await be.read(a.digest, { start: 9_999, end: 10_000 }), a.data.subarray(9_999));
      expect((await readAll(await be.read(a.digest, { start: 10_000 })))?.byteLength).toBe(0);
    });

    it("answers null and false for a blob it does not have, and deleting it is not an error", async () => {
      const a = blob(10);
      expect(await be.read(a.digest)).toBeNull();
      expect(await be.read(a.digest, { start: 2, end: 5 })).toBeNull();
      expect(await be.has(a.digest)).toBe(false);
      await be.delete(a.digest);
      expect(await be.has(a.digest)).toBe(false);
    });

    it("stores a blob written twice once (writes are idempotent)", async () => {
      const a = blob(5_000);
      await be.writeBytes(a.digest, a.data);
      await be.writeBytes(a.digest, a.data);
      await be.adoptFile(a.digest, await fileOf(a.data));
      await expectBytes(await be.read(a.digest), a.data);
      const listed: string[] = [];
      for await (const d of be.list()) listed.push(formatDigest(d));
      expect(listed).toEqual([formatDigest(a.digest)]);
    });

    it("takes concurrent writes of the same blob, and the blob is whole afterwards", async () => {
      const a = blob(300_000);
      const writes: Promise<void>[] = [];
      for (let i = 0; i < 8; i++) {
        writes.push(
          i % 2 === 0
            ? be.writeBytes(a.digest, a.data)
            : fileOf(a.data).then((f) => be.adoptFile(a.digest, f)),
        );
      }
      await Promise.all(writes);
      await expectBytes(await be.read(a.digest), a.data);
    });

    it("deletes a blob: gone from has, read and list; others stay", async () => {
      const a = blob(100);
      const b = blob(200);
      await be.writeBytes(a.digest, a.data);
      await be.writeBytes(b.digest, b.data);
      await be.delete(a.digest);
      expect(await be.has(a.digest)).toBe(false);
      expect(await be.read(a.digest)).toBeNull();
      await expectBytes(await be.read(b.digest), b.data);
      const listed: string[] = [];
      for await (const d of be.list()) listed.push(formatDigest(d));
      expect(listed).toEqual([formatDigest(b.digest)]);
    });

    it("lists every stored blob with its size", async () => {
      const blobs = [blob(1), blob(17), blob(4096), blob(100_001)];
      for (const b of blobs) await be.writeBytes(b.digest, b.data);
      const listed: string[] = [];
      for await (const d of be.list()) listed.push(formatDigest(d));
      expect(listed.sort()).toEqual(blobs.map((b) => formatDigest(b.digest)).sort());
    });

    it("writes and reads back a large blob held in memory", async () => {
      const a = blob(24 * 1024 * 1024 + 7);
      await be.writeBytes(a.digest, a.data);
      const back = await readAll(await be.read(a.digest));
      expect(back?.byteLength).toBe(a.data.byteLength);
      expect(digestBytes(back as Buffer)).toEqual(a.digest);
      const tail = await readAll(await be.read(a.digest, { start: a.data.byteLength - 100 }));
      expect(tail).toEqual(a.data.subarray(a.data.byteLength - 100));
    });

    it("shows nothing under a digest whose write was broken off midway", async () => {
      const a = blob(2 * 1024 * 1024);
      await t.interruptWrite(a.digest, a.data);
      await be.has(a.digest);
      expect(await be.has(a.digest)).toBe(false);
      expect(await be.read(a.digest)).toBeNull();
      const listed: string[] = [];
      for await (const d of be.list()) listed.push(formatDigest(d));
      expect(listed).toEqual([]);
      // A whole write afterwards succeeds and is read back.
      await be.writeBytes(a.digest, a.data);
      await expectBytes(await be.read(a.digest), a.data);
    });
  });
}

/** A fresh temporary directory (removed by the returned function). */
export async function tempDir(prefix: string): Promise<{ dir: string; remove: () => Promise<void> }> {
  const dir = await mkdtemp(join(tmpdir(), prefix));
  return { dir, remove: () => rm(dir, { recursive: true, force: true }) };
}
