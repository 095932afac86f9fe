/**
 * The CAS client (lib/cas/client.ts) against the real REST server (createRestServer on PGlite, filesystem
 * backend), reached through a TCP proxy that can cut a connection after so many bytes in either direction (a
 * network failure, the one fake here): verified downloads resumed with Range, a corrupt store refused, not found
 * without retries, uploads resumed from the offset the server kept, compression only where it pays, and trees
 * uploaded with only what the store lacks.
 */
import { randomBytes } from "node:crypto";
import {
  existsSync,
  mkdirSync,
  mkdtempSync,
  readFileSync,
  rmSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { gzipSync } from "node:zlib";
import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { batches, createCasClient, worthCompressing } from "../lib/cas/client.ts";
import { type Digest, digestBytes, formatDigest } from "../lib/cas/digest.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createUser } from "../store/queries.ts";
import { openTestDb, type TestDb } from "./db.ts";

const dir = mkdtempSync(join(tmpdir(), "cas-client-"));
const dataDir = join(dir, "server");
const token = newUserToken();
let db: TestDb;
let app: FastifyInstance;
let proxy: net.Server;
let url = "";
/** The next connection through the proxy is cut after this many bytes going up (request) or down (response). */
let cut: { up?: number; down?: number } = {};
let connections = 0;

beforeAll(async () => {
  db = await openTestDb("pglite");
  await createUser(db, {
    uuid: newUserUuid("casct"),
    name: "client",
    isAdmin: false,
    tokenHash: hashToken(token),
  });
  app = await createRestServer({
    db,
    logger: false,
    clusterId: "casct",
    maxRequestBodySize: 8 * 2 ** 20,
    defaultMaxAttempts: 3,
    dataDir,
  });
  const target = new URL(await app.listen({ host: "127.0.0.1", port: 0 }));
  proxy = net.createServer((down) => {
    connections++;
    const limits = cut;
    cut = {};
    const up = net.connect(Number(target.port), target.hostname);
    const pass = (from: net.Socket, to: net.Socket, limit: number | undefined) => {
      let n = 0;
      from.on("data", (chunk: Buffer) => {
        if (limit !== undefined && n + chunk.length >= limit) {
          to.write(chunk.subarray(0, limit - n));
          down.destroy();
          up.destroy();
          return;
        }
        n += chunk.length;
        to.write(chunk);
      });
      from.on("end", () => to.end());
      from.on("error", () => to.destroy());
    };
    pass(down, up, limits.up);
    pass(up, down, limits.down);
  });
  await new Promise<void>((r) => proxy.listen(0, "127.0.0.1", r));
  url = `http://127.0.0.1:${(proxy.address() as net.AddressInfo).port}`;
});

afterAll(async () => {
  proxy?.close();
  await app?.close();
  await db?.close();
  rmSync(dir, { recursive: true, force: true });
});

const client = () => createCasClient({ url, token, retryBudgetMs: 20_000 });

async function stored(data: Buffer): Promise<Digest> {
  const c = client();
  const d = digestBytes(data);
  const file = join(dir, `src-${d.hash}`);
  writeFileSync(file, data);
  await c.uploadFile(d, file);
  c.close();
  return d;
}

describe("CAS client against the REST server", () => {
  it("downloads verified bytes, and resumes a transfer cut midway with a Range", async () => {
    const data = Buffer.concat([randomBytes(600_000), Buffer.alloc(600_000, 7)]);
    const d = await stored(data);
    const c = client();
    await c.download(d, join(dir, "a"));
    expect(readFileSync(join(dir, "a")).equals(data)).toBe(true);
    c.close();
    // A fresh client's first connection is cut 300 KB into the answer; it connects again and asks for the rest.
    const before = connections;
    cut = { down: 300_000 };
    const fresh = client();
    await fresh.download(d, join(dir, "b"));
    expect(readFileSync(join(dir, "b")).equals(data)).toBe(true);
    expect(connections).toBeGreaterThanOrEqual(before + 2);
    fresh.close();
  });

  it("refuses bytes from a corrupt store that do not match the digest, and keeps no file", async () => {
    const data = randomBytes(5000);
    const d = await stored(data);
    const blob = join(dataDir, "cas", "blobs", d.hash.slice(0, 2), d.hash);
    const flipped = Buffer.from(data);
    flipped[10] = (flipped[10] ?? 0) ^ 0xff;
    writeFileSync(blob, flipped);
    const c = client();
    await expect(c.download(d, join(dir, "bad"))).rejects.toMatchObject({ code: "cas.digest_mismatch" });
    expect(existsSync(join(dir, "bad"))).toBe(false);
    await expect(c.batchRead([d])).rejects.toMatchObject({ code: "cas.digest_mismatch" });
    writeFileSync(blob, data);
    expect((await c.batchRead([d])).get(d.hash)?.equals(data)).toBe(true);
    c.close();
  });

  it("says not found with the store's code at once, without retrying", async () => {
    const c = client();
    const before = connections;
    const d = digestBytes(Buffer.from("never stored"));
    await expect(c.download(d, join(dir, "nf"))).rejects.toMatchObject({
      status: 404,
      code: "cas.not_found",
    });
    expect(existsSync(join(dir, "nf"))).toBe(false);
    expect(connections - before).toBeLessThanOrEqual(1);
    c.close();
  });

  it("resumes an upload cut midway from the offset the server kept", async () => {
    const data = randomBytes(3_000_000); // incompressible: sent as it is
    const file = join(dir, "up");
    writeFileSync(file, data);
    const d = digestBytes(data);
    const before = connections;
    cut = { up: 1_500_000 };
    const c = client();
    const { bytesSent } = await c.uploadFile(d, file);
    // Cut, then connected again; less than the whole blob twice: the rest went from the kept offset.
    expect(connections).toBeGreaterThanOrEqual(before + 2);
    expect(bytesSent).toBeLessThan(2 * data.length);
    expect(await c.findMissing([d])).toEqual([]);
    await c.download(d, join(dir, "up-back"));
    expect(readFileSync(join(dir, "up-back")).equals(data)).toBe(true);
    c.close();
  });

  it("gzips what compresses and not what is compressed already", async () => {
    expect(worthCompressing(Buffer.alloc(100_000, "a"))).toBe(true);
    expect(worthCompressing(randomBytes(100_000))).toBe(false);
    expect(worthCompressing(gzipSync(Buffer.alloc(100_000, "a")).subarray(0, 600))).toBe(false);
    const text = Buffer.from("line of text\n".repeat(50_000));
    writeFileSync(join(dir, "txt"), text);
    const c = client();
    const { bytesSent } = await c.uploadFile(digestBytes(text), join(dir, "txt"));
    expect(bytesSent).toBeLessThan(text.length / 10);
    await c.download(digestBytes(text), join(dir, "txt-back"));
    expect(readFileSync(join(dir, "txt-back")).equals(text)).toBe(true);
    c.close();
  });

  it("counts every byte of large files uploaded at once", async () => {
    const tree = join(dir, "many-large");
    mkdirSync(tree);
    let total = 0;
    for (let i = 0; i < 12; i++) {
      const data = randomBytes(100_000 + i * 1000);
      total += data.length;
      writeFileSync(join(tree, `f${i}`), data);
    }
    const r = await client().uploadTree(tree); // 4 at once (the default)
    // Random bytes are sent as they are (no gzip), so what was sent is exactly what the files hold.
    expect(r.bytesSent).toBe(total);
  });

  it("uploads a tree: only what the store lacks, then the manifest, which reads back", async () => {
    const tree = join(dir, "tree");
    mkdirSync(join(tree, "sub/empty"), { recursive: true });
    const big = randomBytes(300_000);
    writeFileSync(join(tree, "big"), big);
    writeFileSync(join(tree, "sub/small"), "small bytes");
    writeFileSync(join(tree, "known"), "already stored");
    writeFileSync(join(tree, "empty"), "");
    symlinkSync("sub/small", join(tree, "l"));
    await stored(Buffer.from("already stored"));
    const c = client();
    const phases: string[] = [];
    const r = await c.uploadTree(tree, { onProgress: (p) => phases.push(p.phase) });
    expect(r).toMatchObject({ files: 4, bytes: 300_000 + 11 + 14, blobsUploaded: 2, blobsSkipped: 1 });
    expect(r.bytesSent).toBeGreaterThanOrEqual(300_000);
    expect(phases[0]).toBe("hashed");
    expect(phases.at(-1)).toBe("uploaded");
    const back = await c.getManifest(r.digest);
    expect(back.manifest.entries.map((e) => e.path)).toEqual([
      "big",
      "empty",
      "known",
      "l",
      "sub",
      "sub/empty",
      "sub/small",
    ]);
    await c.download(digestBytes(big), join(dir, "big-back"));
    expect(readFileSync(join(dir, "big-back")).equals(big)).toBe(true);
    expect(await c.uploadTree(tree)).toMatchObject({ digest: r.digest, blobsUploaded: 0, blobsSkipped: 3 });
    c.close();
  });

  it("groups batches by count and weight", () => {
    expect(batches([1, 2, 3, 4, 5], 2, 100, () => 1)).toEqual([[1, 2], [3, 4], [5]]);
    expect(batches([3, 3, 3, 9], 10, 6, (x) => x)).toEqual([[3, 3], [3], [9]]);
    expect(formatDigest(digestBytes(Buffer.alloc(0)))).toMatch(/^e3b0.*\/0$/);
  });
});
