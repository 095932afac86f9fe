/**
 * The S3 backend (rest-server/cas/backend-s3.ts) against moto's S3 server on loopback (test/s3-server.ts): the
 * conformance suite every backend passes, then what is S3's own (keys, prefixes, paging, stray keys, errors, the
 * headers of a PUT).
 */
import { writeFile } from "node:fs/promises";
import http from "node:http";
import { join } from "node:path";
import { PutObjectCommand, S3Client } from "@aws-sdk/client-s3";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type Digest, digestBytes, formatDigest } from "../lib/cas/digest.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import type { BlobBackend } from "../rest-server/cas/backend.ts";
import { createS3Backend, type S3BackendOptions } from "../rest-server/cas/backend-s3.ts";
import { describeBlobBackend, feedHalf, makeFifo, tempDir, testBytes } from "./cas-backend-conformance.ts";
import { startS3Server, type TestS3Server } from "./s3-server.ts";

let server: TestS3Server;
let buckets = 0;
beforeAll(async () => {
  server = await startS3Server();
}, 60_000);
afterAll(async () => {
  await server?.close();
});

async function freshBucket(): Promise<string> {
  const name = `cas-test-${++buckets}`;
  await server.createBucket(name);
  return name;
}

function backendOn(bucket: string, extra: Partial<S3BackendOptions> = {}): BlobBackend {
  return createS3Backend({
    bucket,
    endpoint: server.endpoint,
    region: server.region,
    forcePathStyle: true,
    credentials: server.credentials,
    ...extra,
  });
}

function adminClient(): S3Client {
  const { endpoint, region, credentials } = server;
  return new S3Client({ endpoint, region, credentials, forcePathStyle: true });
}

async function listed(be: BlobBackend): Promise<string[]> {
  const out: string[] = [];
  for await (const d of be.list()) out.push(formatDigest(d));
  return out.sort();
}

describeBlobBackend("s3", async () => {
  // moto answers some concurrent PUTs of one key with a 500 (S3 does not): more attempts than the default ride
  // that out in the concurrent-writes test.
  const backend = backendOn(await freshBucket(), { prefix: "store/", maxAttempts: 6 });
  const tmp = await tempDir("cas-s3-");
  let fifos = 0;
  return {
    backend,
    tmpDir: tmp.dir,
    // adoptFile streams the file: a FIFO that ends halfway makes the backend cut its PUT off mid-body.
    async interruptWrite(digest: Digest, data: Uint8Array) {
      const fifo = join(tmp.dir, `fifo-${++fifos}`);
      makeFifo(fifo);
      const adopting = backend.adoptFile(digest, fifo);
      await feedHalf(fifo, data);
      await expect(adopting).rejects.toMatchObject({ code: "cas.digest_mismatch" });
    },
    async close() {
      await backend.close();
      await tmp.remove();
    },
  };
});

describe("S3 backend", () => {
  it("keeps blobs at <prefix>blobs/<hash>, and backends with other prefixes do not see them", async () => {
    const bucket = await freshBucket();
    const a = backendOn(bucket, { prefix: "one/" });
    const b = backendOn(bucket, { prefix: "two/" });
    const data = testBytes(100, 1);
    const d = digestBytes(data);
    await a.writeBytes(d, data);
    const raw = backendOn(bucket, { prefix: "one/blobs/" });
    expect(await listed(a)).toEqual([formatDigest(d)]);
    expect(await listed(b)).toEqual([]);
    expect(await b.has(d)).toBe(false);
    // The object's key is exactly one/blobs/<hash>: a backend whose prefix is one/blobs/ finds it one level up.
    expect(await listed(raw)).toEqual([]);
    const s3 = adminClient();
    try {
      await s3.send(new PutObjectCommand({ Bucket: bucket, Key: `one/blobs/${d.hash}x`, Body: "no" }));
    } finally {
      s3.destroy();
    }
    expect(await listed(a)).toEqual([formatDigest(d)]);
    await Promise.all([a.close(), b.close(), raw.close()]);
  });

  it("lists across pages and passes over keys that are not digests", async () => {
    const bucket = await freshBucket();
    const be = backendOn(bucket, { listPageSize: 3 });
    const want: string[] = [];
    for (let i = 0; i < 8; i++) {
      const data = testBytes(10 + i, 100 + i);
      const d = digestBytes(data);
      await be.writeBytes(d, data);
      want.push(formatDigest(d));
    }
    const s3 = adminClient();
    try {
      for (const key of [
        "blobs/README",
        "blobs/",
        `blobs/${"A".repeat(64)}`,
        `blobs/${"a".repeat(63)}`,
        "other",
      ]) {
        await s3.send(new PutObjectCommand({ Bucket: bucket, Key: key, Body: "x" }));
      }
    } finally {
      s3.destroy();
    }
    expect(await listed(be)).toEqual(want.sort());
    await be.close();
  });

  it("refuses to adopt a missing file, or one longer than its digest, and stores nothing", async () => {
    const be = backendOn(await freshBucket());
    const tmp = await tempDir("cas-s3-adopt-");
    try {
      const data = testBytes(1000, 11);
      const d = digestBytes(data);
      await expect(be.adoptFile(d, join(tmp.dir, "absent"))).rejects.toMatchObject({ code: "ENOENT" });
      const long = join(tmp.dir, "long");
      await writeFile(long, Buffer.concat([data, Buffer.from("more")]));
      await expect(be.adoptFile(d, long)).rejects.toMatchObject({ code: "cas.digest_mismatch" });
      expect(await be.has(d)).toBe(false);
      expect(await listed(be)).toEqual([]);
    } finally {
      await be.close();
      await tmp.remove();
    }
  });

  it("turns storage errors into cas.storage_unavailable naming the operation and key, without credentials", async () => {
    const secret = "very-secret-key-do-not-show-0123";
    const accessKeyId = "AKIDNOTSHOWN0001";
    const be = createS3Backend({
      bucket: "no-such-bucket",
      endpoint: server.endpoint,
      region: server.region,
      forcePathStyle: true,
      credentials: { accessKeyId, secretAccessKey: secret },
    });
    const data = testBytes(10, 7);
    const d = digestBytes(data);
    for (const op of [
      () => be.writeBytes(d, data),
      () => be.read(d),
      () => be.delete(d),
      async () => listed(be),
    ]) {
      const err = await op().then(
        () => undefined,
        (e: unknown) => e,
      );
      expect(err).toBeInstanceOf(DispatchCloudError);
      const e = err as DispatchCloudError;
      expect(e.code).toBe("cas.storage_unavailable");
      expect(e.message).toMatch(/no-such-bucket/);
      expect(e.message).toMatch(/NoSuchBucket|404/);
      expect(e.message).not.toContain(secret);
      expect(e.message).not.toContain(accessKeyId);
      expect(e.cause).toBeUndefined();
    }
    await be.close();
  });

  it("fails, without a secret in the message, when the storage does not answer", async () => {
    // A port where nothing listens: the connection is refused, the SDK retries, then the error is clear.
    const probe = http.createServer();
    await new Promise<void>((r) => probe.listen(0, "127.0.0.1", r));
    const port = (probe.address() as { port: number }).port;
    await new Promise((r) => probe.close(r));
    const secret = "another-secret-0123456789";
    const be = createS3Backend({
      bucket: "b-unreachable",
      endpoint: `http://127.0.0.1:${port}`,
      region: "us-east-1",
      forcePathStyle: true,
      credentials: { accessKeyId: "AKIDX", secretAccessKey: secret },
      maxAttempts: 2,
    });
    const d = digestBytes(Buffer.from("x"));
    const err = (await be.has(d).catch((e: unknown) => e)) as DispatchCloudError;
    expect(err.code).toBe("cas.storage_unavailable");
    expect(err.message).toMatch(/HeadObject s3:\/\/b-unreachable\/blobs\//);
    expect(err.message).not.toContain(secret);
    await be.close();
  });

  it("sends every PUT with its length and the blob's sha256 (x-amz-checksum-sha256), signed with SigV4", async () => {
    // moto does not check x-amz-checksum-sha256 (S3 does): the headers are recorded here instead.
    const seen: http.IncomingHttpHeaders[] = [];
    const recorder = http.createServer((req, res) => {
      seen.push(req.headers);
      req.resume();
      req.on("end", () => res.writeHead(200).end());
    });
    await new Promise<void>((r) => recorder.listen(0, "127.0.0.1", r));
    const port = (recorder.address() as { port: number }).port;
    const be = createS3Backend({
      bucket: "rec",
      endpoint: `http://127.0.0.1:${port}`,
      region: "us-east-1",
      forcePathStyle: true,
      credentials: { accessKeyId: "AKIDREC", secretAccessKey: "secret-rec-0123" },
    });
    const tmp = await tempDir("cas-s3-rec-");
    try {
      const data = testBytes(5000, 9);
      const d = digestBytes(data);
      await be.writeBytes(d, data);
      const f = join(tmp.dir, "f");
      await writeFile(f, data);
      await be.adoptFile(d, f);
      expect(seen).toHaveLength(2);
      for (const h of seen) {
        expect(h["content-length"]).toBe("5000");
        expect(h["x-amz-checksum-sha256"]).toBe(Buffer.from(d.hash, "hex").toString("base64"));
        expect(h.authorization).toMatch(
          /^AWS4-HMAC-SHA256 Credential=AKIDREC\/.*SignedHeaders=[^ ]*x-amz-checksum-sha256/,
        );
      }
    } finally {
      await be.close();
      await tmp.remove();
      await new Promise((r) => recorder.close(r));
    }
  });
});
