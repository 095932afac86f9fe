/**
 * The client's own logic against a small real HTTP server playing the store's part (the CAS routes live in
 * rest-server/cas and are tested there): verification of what is read, Range resume, upload resume.
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
import http from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { gunzipSync, gzipSync } from "node:zlib";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { batches, createCasClient, worthCompressing } from "./client.ts";
import { type Digest, digestBytes, formatDigest } from "./digest.ts";
import { manifestStats, parseManifest } from "./manifest.ts";

const dir = mkdtempSync(join(tmpdir(), "cas-client-"));
const blobs = new Map<string, Buffer>();
/** Served instead of the real bytes (a corrupt store or a man in the middle). */
const corrupt = new Set<string>();
/** Blobs whose next GET is cut after this many bytes. */
const cutAfter = new Map<string, number>();
/** Uploads kept after a broken PUT: hash -> bytes received. */
const partial = new Map<string, Buffer>();
let cutUploadAt: number | undefined;
const log: string[] = [];
let server: http.Server;
let url = "";

beforeAll(async () => {
  server = http.createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => {
      chunks.push(c);
      const got = Buffer.concat(chunks);
      if (cutUploadAt !== undefined && req.method === "PUT" && got.length >= cutUploadAt) {
        const hash = (req.url ?? "").split("/")[5] as string;
        partial.set(hash, got.subarray(0, cutUploadAt));
        cutUploadAt = undefined;
        req.socket.destroy();
      }
    });
    req.on("end", (): unknown => {
      const m =
        /^\/api\/v1\/cas\/(blobs|uploads|batch-read|find-missing|batch-upload|manifests)(?:\/([0-9a-f]{64})\/(\d+))?$/.exec(
          req.url ?? "",
        );
      log.push(`${req.method} ${m?.[1]} ${req.headers["upload-offset"] ?? ""}${req.headers.range ?? ""}`);
      if (req.headers.authorization !== "Bearer tok") return res.writeHead(401).end();
      const hash = m?.[2] ?? "";
      const json = (status: number, v: unknown) =>
        res.writeHead(status, { "content-type": "application/json" }).end(JSON.stringify(v));
      if (m?.[1] === "find-missing") {
        const body = JSON.parse(Buffer.concat(chunks).toString()) as { digests: string[] };
        return json(200, { missing: body.digests.filter((d) => !blobs.has(d.split("/")[0] as string)) });
      }
      if (m?.[1] === "batch-upload") {
        const body = JSON.parse(Buffer.concat(chunks).toString()) as {
          blobs: { digest: string; data: string }[];
        };
        const results = body.blobs.map((b) => {
          const data = Buffer.from(b.data, "base64");
          if (formatDigest(digestBytes(data)) !== b.digest)
            return { digest: b.digest, ok: false, error: { code: "cas.digest_mismatch", message: "bad" } };
          blobs.set(digestBytes(data).hash, data);
          return { digest: b.digest, ok: true };
        });
        return json(200, { results });
      }
      if (m?.[1] === "manifests" && req.method === "PUT") {
        const body = Buffer.concat(chunks);
        const man = parseManifest(body);
        const absent = manifestStats(man).blobs.filter((b) => b.size > 0 && !blobs.has(b.hash));
        if (absent.length > 0) return json(400, { error: { code: "cas.manifest_incomplete", message: "x" } });
        blobs.set(hash, body);
        return json(201, { digest: `${hash}/${body.length}`, ...manifestStats(man), blobs: undefined });
      }
      if (m?.[1] === "manifests" && req.method === "GET") {
        const data = blobs.get(hash);
        return data
          ? res.writeHead(200).end(data)
          : json(404, { error: { code: "cas.not_found", message: "" } });
      }
      if (m?.[1] === "batch-read") {
        const body = JSON.parse(Buffer.concat(chunks).toString()) as { digests: string[] };
        const out = body.digests.map((d) => {
          const h = d.split("/")[0] as string;
          const data = corrupt.has(h) ? Buffer.from("evil") : blobs.get(h);
          return data
            ? { digest: d, data: data.toString("base64") }
            : { digest: d, error: { code: "cas.not_found", message: "no" } };
        });
        return res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify({ blobs: out }));
      }
      if (req.method === "HEAD" && m?.[1] === "uploads") {
        return res.writeHead(200, { "upload-offset": String(partial.get(hash)?.length ?? 0) }).end();
      }
      if (req.method === "PUT" && m?.[1] === "blobs") {
        let body = Buffer.concat(chunks);
        if (req.headers["content-encoding"] === "gzip") body = gunzipSync(body);
        const offset = Number(req.headers["upload-offset"] ?? 0);
        const kept = partial.get(hash) ?? Buffer.alloc(0);
        if (offset !== 0 && offset !== kept.length) return res.writeHead(409).end();
        const all = offset > 0 ? Buffer.concat([kept, body]) : body;
        if (digestBytes(all).hash !== hash) {
          return res
            .writeHead(400)
            .end(JSON.stringify({ error: { code: "cas.digest_mismatch", message: "bad" } }));
        }
        blobs.set(hash, all);
        partial.delete(hash);
        return res.writeHead(201).end(JSON.stringify({ digest: `${hash}/${all.length}` }));
      }
      if (req.method === "GET" && m?.[1] === "blobs") {
        let data = blobs.get(hash);
        if (data === undefined)
          return res.writeHead(404).end(JSON.stringify({ error: { code: "cas.not_found", message: "no" } }));
        if (corrupt.has(hash)) data = Buffer.from(data.map((b) => b ^ 1));
        const range = /^bytes=(\d+)-$/.exec(req.headers.range ?? "");
        if (range) {
          const start = Number(range[1]);
          res.writeHead(206, { "content-range": `bytes ${start}-${data.length - 1}/${data.length}` });
          return res.end(data.subarray(start));
        }
        const cut = cutAfter.get(hash);
        if (cut !== undefined) {
          cutAfter.delete(hash);
          res.writeHead(200, { "content-length": String(data.length) });
          res.write(data.subarray(0, cut));
          setTimeout(() => res.socket?.destroy(), 20);
          return;
        }
        if (req.headers["accept-encoding"] === "gzip") {
          return res.writeHead(200, { "content-encoding": "gzip" }).end(gzipSync(data));
        }
        return res.writeHead(200).end(data);
      }
      res.writeHead(404).end();
      return;
    });
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});
afterAll(() => {
  server.close();
  rmSync(dir, { recursive: true, force: true });
});

const put = (data: Buffer): Digest => {
  const d = digestBytes(data);
  blobs.set(d.hash, data);
  return d;
};
const client = () => createCasClient({ url, token: "tok", retryBudgetMs: 5000 });

describe("download", () => {
  it("writes the verified bytes (gzip on the wire) and resumes a cut transfer with Range", async () => {
    const data = Buffer.concat([randomBytes(300_000), Buffer.alloc(300_000, 7)]);
    const d = put(data);
    const c = client();
    await c.download(d, join(dir, "a"));
    expect(readFileSync(join(dir, "a")).equals(data)).toBe(true);
    cutAfter.set(d.hash, 100_000);
    log.length = 0;
    await c.download(d, join(dir, "b"));
    expect(readFileSync(join(dir, "b")).equals(data)).toBe(true);
    expect(log.some((l) => /^GET blobs bytes=\d+-$/.test(l))).toBe(true);
    c.close();
  });

  it("refuses bytes that do not match the digest and removes the file", async () => {
    const d = put(randomBytes(5000));
    corrupt.add(d.hash);
    const c = client();
    await expect(c.download(d, join(dir, "bad"))).rejects.toMatchObject({ code: "cas.digest_mismatch" });
    expect(existsSync(join(dir, "bad"))).toBe(false);
    await expect(c.batchRead([d])).rejects.toMatchObject({ code: "cas.digest_mismatch" });
    corrupt.delete(d.hash);
    expect((await c.batchRead([d])).get(d.hash)?.length).toBe(5000);
    c.close();
  });

  it("says not found with the store's code, without retrying", async () => {
    const c = client();
    const d = digestBytes(Buffer.from("never stored"));
    await expect(c.download(d, join(dir, "nf"))).rejects.toMatchObject({
      status: 404,
      code: "cas.not_found",
    });
    expect(existsSync(join(dir, "nf"))).toBe(false);
    c.close();
  });
});

describe("upload", () => {
  it("resumes a broken upload from the offset the server kept", async () => {
    const data = randomBytes(2_000_000); // incompressible: sent raw
    const file = join(dir, "up");
    writeFileSync(file, data);
    const d = digestBytes(data);
    cutUploadAt = 700_000;
    log.length = 0;
    const c = client();
    await c.uploadFile(d, file);
    expect(blobs.get(d.hash)?.equals(data)).toBe(true);
    expect(log).toContain("HEAD uploads ");
    expect(log.some((l) => /^PUT blobs [1-9]\d*$/.test(l))).toBe(true);
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
    expect(blobs.get(digestBytes(text).hash)?.equals(text)).toBe(true);
    c.close();
  });
});

describe("uploadTree", () => {
  it("uploads only what the store lacks, then the manifest, which reads back", async () => {
    const tree = join(dir, "tree");
    mkdirSync(join(tree, "sub/empty"), { recursive: true });
    const big = randomBytes(300_000);
    writeFileSync(join(tree, "big"), big);
    writeFileSync(join(tree, "sub/small"), "small bytes");
    writeFileSync(join(tree, "known"), "already stored");
    writeFileSync(join(tree, "empty"), "");
    symlinkSync("sub/small", join(tree, "l"));
    put(Buffer.from("already stored"));
    const c = client();
    const phases: string[] = [];
    const r = await c.uploadTree(tree, { onProgress: (p) => phases.push(p.phase) });
    expect(r).toMatchObject({ files: 4, bytes: 300_000 + 11 + 14, blobsUploaded: 2, blobsSkipped: 1 });
    expect(r.bytesSent).toBeGreaterThanOrEqual(300_000);
    expect(phases[0]).toBe("hashed");
    expect(phases.at(-1)).toBe("uploaded");
    expect(blobs.get(digestBytes(big).hash)?.equals(big)).toBe(true);
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
    // Again: nothing to upload.
    expect(await c.uploadTree(tree)).toMatchObject({ digest: r.digest, blobsUploaded: 0, blobsSkipped: 3 });
    c.close();
  });
});

describe("batches", () => {
  it("groups by count and weight", () => {
    expect(batches([1, 2, 3, 4, 5], 2, 100, () => 1)).toEqual([[1, 2], [3, 4], [5]]);
    expect(batches([3, 3, 3, 9], 10, 6, (x) => x)).toEqual([[3, 3], [3], [9]]);
    expect(formatDigest(digestBytes(Buffer.alloc(0)))).toMatch(/^e3b0.*\/0$/);
  });
});
