/**
 * The filesystem backend (rest-server/cas/backend-fs.ts) passes the conformance suite every backend passes
 * (test/cas-backend-conformance.ts), and keeps what it stores private to the service's user.
 */
import { stat, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { type Digest, digestBytes } from "../lib/cas/digest.ts";
import { createFsBackend } from "../rest-server/cas/backend-fs.ts";
import { describeBlobBackend, tempDir, testBytes } from "./cas-backend-conformance.ts";

describeBlobBackend("filesystem", async () => {
  const tmp = await tempDir("cas-fs-");
  const backend = createFsBackend(join(tmp.dir, "cas"));
  let n = 0;
  return {
    backend,
    tmpDir: tmp.dir,
    // A writer that died midway left a file with half the bytes: adopting it must not publish anything.
    async interruptWrite(digest: Digest, data: Uint8Array) {
      const half = join(tmp.dir, `half-${++n}`);
      await writeFile(half, data.subarray(0, Math.floor(data.length / 2)));
      await expect(backend.adoptFile(digest, half)).rejects.toMatchObject({ code: "cas.digest_mismatch" });
    },
    async close() {
      await backend.close();
      await tmp.remove();
    },
  };
});

describe("filesystem backend", () => {
  it("keeps blobs in directories and files only the service's user can read (0700, 0600)", async () => {
    const tmp = await tempDir("cas-fs-modes-");
    try {
      const be = createFsBackend(join(tmp.dir, "cas"));
      const data = testBytes(1000, 7);
      const d = digestBytes(data);
      await be.writeBytes(d, data);
      const src = join(tmp.dir, "adopted");
      const other = testBytes(2000, 8);
      await writeFile(src, other, { mode: 0o644 });
      await be.adoptFile(digestBytes(other), src);
      for (const h of [d.hash, digestBytes(other).hash]) {
        expect((await stat(join(tmp.dir, "cas", "blobs", h.slice(0, 2), h))).mode & 0o777).toBe(0o600);
        expect((await stat(join(tmp.dir, "cas", "blobs", h.slice(0, 2)))).mode & 0o777).toBe(0o700);
      }
      await be.close();
    } finally {
      await tmp.remove();
    }
  });
});
