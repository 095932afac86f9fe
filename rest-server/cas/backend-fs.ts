/**
 * The filesystem backend of the content-addressed store (docs/storage.md): blob `<hash>` of size `<size>` is
 * the file `<dir>/blobs/<first 2 hex>/<hash>`, mode 0600 in directories of mode 0700 (the data directory is
 * private). Writes go to `<dir>/tmp/`, are fsynced and renamed into place, so a blob is either whole or absent;
 * a read checks the file's size against the digest's.
 */
import { randomBytes } from "node:crypto";
import { constants, createReadStream, readFileSync } from "node:fs";
import { chmod, copyFile, mkdir, open, readdir, rename, rm, stat, unlink } from "node:fs/promises";
import { join } from "node:path";
import { Readable } from "node:stream";
import type { Digest } from "../../lib/cas/digest.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import type { BlobBackend } from "./backend.ts";

const HASH = /^[0-9a-f]{64}$/;

export function createFsBackend(dir: string): BlobBackend {
  const blobsDir = join(dir, "blobs");
  const tmpDir = join(dir, "tmp");
  const made = new Set<string>();
  const ensureDir = async (d: string) => {
    if (made.has(d)) return;
    await mkdir(d, { recursive: true, mode: 0o700 });
    made.add(d);
  };
  const pathOf = (d: Digest) => join(blobsDir, d.hash.slice(0, 2), d.hash);
  const tmpName = () => join(tmpDir, `${Date.now()}-${randomBytes(8).toString("hex")}`);

  /** Moves a complete, fsynced file into place (its directory fsynced too, so the rename survives a crash). */
  const place = async (d: Digest, file: string) => {
    const target = pathOf(d);
    const parent = join(blobsDir, d.hash.slice(0, 2));
    await ensureDir(dir);
    await ensureDir(blobsDir);
    await ensureDir(parent);
    await rename(file, target);
    const h = await open(parent, "r");
    try {
      await h.sync();
    } catch {
      // Some filesystems cannot fsync a directory; the rename itself is atomic.
    } finally {
      await h.close();
    }
  };

  /** Fsyncs a file about to become blob `d`, after checking it is a regular file of the digest's size. */
  const syncFile = async (d: Digest, file: string) => {
    const h = await open(file, constants.O_RDWR | constants.O_NOFOLLOW | constants.O_NONBLOCK);
    try {
      const st = await h.stat();
      if (!st.isFile() || st.size !== d.size) {
        throw new DispatchCloudError(
          "cas.digest_mismatch",
          `the file to store as ${d.hash}/${d.size} is ${st.isFile() ? `${st.size} bytes` : "not a regular file"}`,
        );
      }
      await h.chmod(0o600);
      await h.sync();
    } finally {
      await h.close();
    }
  };

  return {
    kind: "filesystem",

    async adoptFile(d, file) {
      await ensureDir(dir);
      await ensureDir(tmpDir);
      try {
        await syncFile(d, file);
        await place(d, file);
        return;
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== "EXDEV") throw err;
      }
      // Another filesystem: copy into tmp (same filesystem as the blobs), then rename.
      const tmp = tmpName();
      try {
        await copyFile(file, tmp);
        await syncFile(d, tmp);
        await place(d, tmp);
      } catch (err) {
        await rm(tmp, { force: true });
        throw err;
      }
      await rm(file, { force: true });
    },

    async writeBytes(d, data) {
      await ensureDir(dir);
      await ensureDir(tmpDir);
      const tmp = tmpName();
      try {
        const h = await open(tmp, "wx", 0o600);
        try {
          await h.writeFile(data);
          await h.sync();
        } finally {
          await h.close();
        }
        await place(d, tmp);
      } catch (err) {
        await rm(tmp, { force: true });
        throw err;
      }
    },

    async read(d, range) {
      const file = pathOf(d);
      try {
        const st = await stat(file);
        if (st.size !== d.size) return null;
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code === "ENOENT") return null;
        throw err;
      }
      const start = range?.start ?? 0;
      const end = range?.end ?? d.size;
      if (end <= start) {
        return Readable.from([]);
      }
      // Large reads: fewer, bigger chunks to the socket (the default 64 KiB costs a round of calls each).
      return createReadStream(file, { start, end: end - 1, highWaterMark: 1024 * 1024 });
    },

    readSmallSync(d) {
      let data: Buffer;
      try {
        data = readFileSync(pathOf(d));
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code === "ENOENT") return null;
        throw err;
      }
      return data.length === d.size ? data : null;
    },

    async has(d) {
      try {
        return (await stat(pathOf(d))).size === d.size;
      } catch {
        return false;
      }
    },

    async delete(d) {
      await unlink(pathOf(d)).catch((err: NodeJS.ErrnoException) => {
        if (err.code !== "ENOENT") throw err;
      });
    },

    async *list() {
      let prefixes: string[];
      try {
        prefixes = await readdir(blobsDir);
      } catch {
        return;
      }
      for (const p of prefixes) {
        let names: string[];
        try {
          names = await readdir(join(blobsDir, p));
        } catch {
          continue;
        }
        for (const n of names) {
          if (!HASH.test(n)) continue;
          try {
            yield { hash: n, size: (await stat(join(blobsDir, p, n))).size };
          } catch {
            // deleted meanwhile
          }
        }
      }
    },

    async close() {},
  };
}

/** Makes a directory private (0700), creating it; for the partial uploads' directory. */
export async function privateDir(d: string): Promise<void> {
  await mkdir(d, { recursive: true, mode: 0o700 });
  await chmod(d, 0o700);
}
