/**
 * The content-addressed store's API (rest-server/cas/routes.ts) on PostgreSQL and PGlite, for every blob
 * backend in BACKENDS (the S3 backend joins the list): uploads verified and stored once, who may read what,
 * compressed and resumed transfers, manifests, the runner's fields, and garbage collection.
 */
import { createHash, randomBytes } from "node:crypto";
import { mkdir, mkdtemp, rm, stat, utimes, writeFile } from "node:fs/promises";
import http from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { PassThrough } from "node:stream";
import { gunzipSync, gzipSync } from "node:zlib";
import type { FastifyInstance } from "fastify";
import { Registry } from "prom-client";
import { afterAll, beforeAll, expect, it } from "vitest";
import { type Digest, EMPTY_DIGEST, formatDigest } from "../lib/cas/digest.ts";
import { canonicalManifest, type Manifest } from "../lib/cas/manifest.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { type BundleManager, createBundleManager } from "../rest-server/bundle-manager.ts";
import type { BlobBackend } from "../rest-server/cas/backend.ts";
import { createFsBackend } from "../rest-server/cas/backend-fs.ts";
import { createS3Backend } from "../rest-server/cas/backend-s3.ts";
import { createRestServer } from "../rest-server/server.ts";
import { beginUpload, findMissing } from "../store/cas-queries.ts";
import { createUser } from "../store/queries.ts";
import { describeEachDb, startWithRunnerToken } from "./db.ts";
import { silentLogger as silent } from "./fixtures.ts";
import { expectApiError, injectClient, type Json } from "./rest-client.ts";
import { startS3Server, type TestS3Server } from "./s3-server.ts";

const CLUSTER = "zzzzz";
const DAY = 86_400_000;

/** The backends every test runs on: a name and a factory given a fresh scratch directory. */
export const BACKENDS: { name: string; make: (dir: string) => Promise<BlobBackend> | BlobBackend }[] = [
  { name: "filesystem", make: (dir) => createFsBackend(join(dir, "cas")) },
  {
    name: "s3",
    // moto's S3 server on loopback (test/s3-server.ts), started once for the file; a fresh bucket per backend.
    make: async () => {
      s3Server ??= startS3Server();
      const server = await s3Server;
      const bucket = `rest-cas-${++s3Buckets}`;
      await server.createBucket(bucket);
      return createS3Backend({
        bucket,
        endpoint: server.endpoint,
        region: server.region,
        forcePathStyle: true,
        credentials: server.credentials,
        // moto (not S3) answers some concurrent PUTs of one key with a 500: more attempts ride it out.
        maxAttempts: 6,
      });
    },
  },
];
let s3Server: Promise<TestS3Server> | undefined;
let s3Buckets = 0;
afterAll(async () => {
  if (s3Server !== undefined) await (await s3Server).close();
});

const digestOf = (data: Buffer): Digest => ({
  hash: createHash("sha256").update(data).digest("hex"),
  size: data.length,
});
const url = (kind: "blobs" | "manifests" | "uploads", d: Digest) => `/api/v1/cas/${kind}/${d.hash}/${d.size}`;
const BIN = { "content-type": "application/octet-stream" };

async function listAll(b: BlobBackend): Promise<string[]> {
  const out: string[] = [];
  for await (const d of b.list()) out.push(formatDigest(d));
  return out.sort();
}

for (const backendKind of BACKENDS) {
  describeEachDb(`CAS API (${backendKind.name})`, (getDb) => {
    let app: FastifyInstance;
    let api: ReturnType<typeof injectClient>;
    let manager: BundleManager;
    let dataDir: string;
    let backend: BlobBackend;
    let nowMs = Date.UTC(2026, 5, 1);
    let alice: string;
    let bob: string;
    let aliceUuid: string;
    const registry = new Registry();
    const metric = async (name: string): Promise<number> => {
      const m = registry.getSingleMetric(name);
      if (m === undefined) throw new Error(`no metric ${name}`);
      return (await m.get()).values[0]?.value ?? 0;
    };

    const newUser = async (name: string): Promise<{ token: string; uuid: string }> => {
      const token = newUserToken();
      const uuid = newUserUuid(CLUSTER);
      await createUser(getDb(), {
        uuid,
        name: `${name}-${Math.random().toString(36).slice(2)}`,
        isAdmin: false,
        tokenHash: hashToken(token),
      });
      return { token, uuid };
    };
    const put = (token: string, data: Buffer, d = digestOf(data), headers: Record<string, string> = BIN) =>
      api("PUT", url("blobs", d), token, data, headers);
    const missing = async (token: string, ds: Digest[]): Promise<string[]> => {
      const res = await api("POST", "/api/v1/cas/find-missing", token, { digests: ds.map(formatDigest) });
      expect(res.status, JSON.stringify(res.body)).toBe(200);
      return res.body.missing;
    };
    const running = async (token: string, body: object = {}): Promise<{ uuid: string; token: string }> => {
      const res = await api("POST", "/api/v1/bundles", token, {
        command: ["true"],
        image: "busybox",
        ...body,
      });
      expect(res.status, JSON.stringify(res.body)).toBe(201);
      await manager.runOnce();
      const r = await startWithRunnerToken(getDb(), res.body.uuid);
      expect((await api("POST", "/api/v1/runner/start", r.token, {})).status).toBe(200);
      return { uuid: res.body.uuid, token: r.token };
    };
    const manifestOf = (files: Record<string, Buffer>): Buffer => {
      const m: Manifest = {
        version: 1,
        entries: Object.keys(files)
          .sort()
          .map((path) => ({
            path,
            type: "file" as const,
            digest: digestOf(files[path]!),
            executable: false,
          })),
      };
      return canonicalManifest(m);
    };

    beforeAll(async () => {
      dataDir = await mkdtemp(join(tmpdir(), "dc-cas-"));
      backend = await backendKind.make(dataDir);
      app = await createRestServer({
        db: getDb(),
        logger: false,
        clusterId: CLUSTER,
        maxRequestBodySize: 64 * 1024,
        defaultMaxAttempts: 3,
        dataDir,
        clock: { now: () => nowMs },
        cas: { backend, retention: 7 * DAY, maxBatchBytes: 4 * 2 ** 20, metricsRegistry: registry },
      });
      api = injectClient(app);
      manager = createBundleManager({ db: getDb(), logger: silent });
      const a = await newUser("alice");
      alice = a.token;
      aliceUuid = a.uuid;
      bob = (await newUser("bob")).token;
    });
    afterAll(async () => {
      await app?.close();
      if (dataDir) await rm(dataDir, { recursive: true, force: true });
    });

    it("stores a verified upload once and serves it back; refuses a mismatch, storing nothing", async () => {
      const data = randomBytes(5000);
      const d = digestOf(data);
      const bad = Buffer.from(data);
      bad[0] = (bad[0]! + 1) % 256;
      expectApiError(await put(alice, bad, d), 400, "cas.digest_mismatch");
      expect(await listAll(backend)).not.toContain(formatDigest(d));
      expect(await missing(alice, [d])).toEqual([formatDigest(d)]);
      const short = await put(alice, data.subarray(0, 10), d);
      expectApiError(short, 400, "cas.digest_mismatch");

      const ok = await put(alice, data);
      expect(ok.status, JSON.stringify(ok.body)).toBe(201);
      expect(ok.body).toEqual({ digest: formatDigest(d) });
      expect(await missing(alice, [d, EMPTY_DIGEST])).toEqual([]);
      const got = await api("GET", url("blobs", d), alice);
      expect(got.status).toBe(200);
      expect(got.raw.equals(data)).toBe(true);
      if (backend.kind === "filesystem") {
        const st = await stat(join(dataDir, "cas", "blobs", d.hash.slice(0, 2), d.hash));
        expect(st.mode & 0o777).toBe(0o600);
        expect((await stat(join(dataDir, "cas", "blobs"))).mode & 0o777).toBe(0o700);
      }
    });

    it("two uploads of one blob at once both succeed and store one copy", async () => {
      const data = randomBytes(200_000);
      const d = digestOf(data);
      const [a, b] = await Promise.all([put(alice, data), put(alice, data)]);
      expect([a.status, b.status]).toEqual([201, 201]);
      expect((await listAll(backend)).filter((x) => x === formatDigest(d))).toHaveLength(1);
      const { rows } = await getDb().query("SELECT count(*)::int AS n FROM cas_blobs WHERE hash = $1", [
        d.hash,
      ]);
      expect(rows[0]).toEqual({ n: 1 });
    });

    it("metrics: blobs and bytes stored, dedup, bytes uploaded, skipped and downloaded", async () => {
      const data = randomBytes(4096);
      const d = digestOf(data);
      const up = await metric("dispatchcloud_cas_uploaded_bytes_total");
      expect((await put(alice, data)).status).toBe(201);
      expect((await metric("dispatchcloud_cas_uploaded_bytes_total")) - up).toBe(4096);
      const skipped = await metric("dispatchcloud_cas_skipped_bytes_total");
      expect(await missing(alice, [d])).toEqual([]);
      expect((await metric("dispatchcloud_cas_skipped_bytes_total")) - skipped).toBe(4096);
      const down = await metric("dispatchcloud_cas_downloaded_bytes_total");
      expect((await api("GET", url("blobs", d), alice)).status).toBe(200);
      expect((await metric("dispatchcloud_cas_downloaded_bytes_total")) - down).toBe(4096);
      const { rows } = await getDb().query<Json>(
        "SELECT count(*)::int AS n, sum(size)::int AS b FROM cas_blobs WHERE state = 'present'",
      );
      expect(await metric("dispatchcloud_cas_stored_blobs")).toBe(rows[0].n);
      expect(await metric("dispatchcloud_cas_stored_bytes")).toBe(rows[0].b);
      // Two manifests naming the same blob: twice its bytes referenced.
      for (const name of ["x", "y"]) {
        const body = manifestOf({ [name]: data });
        expect((await api("PUT", url("manifests", digestOf(body)), alice, body, BIN)).status).toBe(201);
      }
      expect(await metric("dispatchcloud_cas_dedup_ratio")).toBeGreaterThan(0);
    });

    it("find-missing answers missing for a blob others hold, until the caller uploads it too", async () => {
      const data = randomBytes(1000);
      const d = digestOf(data);
      expect((await put(alice, data)).status).toBe(201);
      expect(await missing(bob, [d])).toEqual([formatDigest(d)]);
      expectApiError(await api("GET", url("blobs", d), bob), 404, "cas.not_found");
      expect((await put(bob, data)).status).toBe(201);
      expect(await missing(bob, [d])).toEqual([]);
      expect((await api("GET", url("blobs", d), bob)).raw.equals(data)).toBe(true);
    });

    it("find-missing remembers per user what it found readable, and forgets it when garbage collection removes blobs", async () => {
      const carol = await newUser("carol");
      const dave = await newUser("dave");
      const kept = randomBytes(500);
      const asked = randomBytes(600);
      const runnerUpload = randomBytes(700);
      expect((await put(carol.token, kept)).status).toBe(201);
      // Another user's upload of `asked`; carol uploads it too, and asks about both.
      expect((await put(dave.token, asked)).status).toBe(201);
      expect((await put(carol.token, asked)).status).toBe(201);
      expect(await missing(carol.token, [digestOf(kept), digestOf(asked)])).toEqual([]);
      // With carol's rights gone from the database, the answer comes from what this server remembers...
      await getDb().query("DELETE FROM cas_access WHERE user_uuid = $1", [carol.uuid]);
      expect(await missing(carol.token, [digestOf(kept), digestOf(asked)])).toEqual([]);
      // ... for carol only: dave never uploaded `kept`.
      expect(await missing(dave.token, [digestOf(kept), digestOf(asked)])).toEqual([
        formatDigest(digestOf(kept)),
      ]);
      // A runner's upload is remembered for its bundle's owner.
      const r = await running(carol.token);
      expect((await put(r.token, runnerUpload)).status).toBe(201);
      await getDb().query("DELETE FROM cas_access WHERE user_uuid = $1", [carol.uuid]);
      expect(await missing(carol.token, [digestOf(runnerUpload)])).toEqual([]);
      // A collection that removes a blob drops everything remembered: the database answers again.
      const old = randomBytes(50);
      expect((await put(bob, old)).status).toBe(201);
      await getDb().query("UPDATE cas_blobs SET touched_at = $1 WHERE hash = $2", [
        new Date(nowMs - 30 * DAY),
        digestOf(old).hash,
      ]);
      const collected = await app.casGc.gcOnce();
      expect(collected.blobs).toBeGreaterThanOrEqual(1);
      expect(await missing(carol.token, [digestOf(kept), digestOf(asked), digestOf(runnerUpload)])).toEqual(
        [digestOf(kept), digestOf(asked), digestOf(runnerUpload)].map(formatDigest),
      );
    });

    it("a finish's VM cache figures are counted once, by the finish that ended the attempt", async () => {
      const hits = await metric("dispatchcloud_cas_vm_cache_hits_total");
      const r = await running(alice);
      const usage = { stagingSeconds: 1.5, casBlobsHit: 7, casBlobsFetched: 2, casBytesFetched: 100 };
      const first = await api("POST", "/api/v1/runner/finish", r.token, {
        exitCode: 0,
        resourceUsage: usage,
      });
      expect(first.status, JSON.stringify(first.body)).toBe(200);
      expect(await metric("dispatchcloud_cas_vm_cache_hits_total")).toBe(hits + 7);
      const again = await api("POST", "/api/v1/runner/finish", r.token, {
        exitCode: 0,
        resourceUsage: usage,
      });
      expect(again.status).toBeGreaterThanOrEqual(400);
      expect(await metric("dispatchcloud_cas_vm_cache_hits_total")).toBe(hits + 7);
      // A finish the store refuses (this attempt never started) counts nothing either.
      const res = await api("POST", "/api/v1/bundles", alice, { command: ["true"], image: "busybox" });
      await manager.runOnce();
      const starting = await startWithRunnerToken(getDb(), res.body.uuid);
      expectApiError(
        await api("POST", "/api/v1/runner/finish", starting.token, { exitCode: 0, resourceUsage: usage }),
        409,
        "runner.not_current",
      );
      expect(await metric("dispatchcloud_cas_vm_cache_hits_total")).toBe(hits + 7);
    });

    it("find-missing of 10,000 digests is one query (timing printed, not asserted)", async () => {
      const present = randomBytes(100);
      expect((await put(alice, present)).status).toBe(201);
      const ds = Array.from({ length: 9_999 }, () => digestOf(randomBytes(16)));
      ds.push(digestOf(present));
      const t0 = performance.now();
      const miss = await findMissing(getDb(), { userUuid: aliceUuid, manifests: [] }, ds, new Date(nowMs));
      const ms = performance.now() - t0;
      console.log(`find-missing of 10,000 digests on ${getDb().kind}: ${ms.toFixed(1)} ms`);
      expect(miss).toHaveLength(9_999);
    });

    it("refuses a decompression bomb as it inflates (413 cas.too_large), storing nothing", async () => {
      const bomb = gzipSync(Buffer.alloc(100 * 2 ** 20));
      const claimed = digestOf(Buffer.alloc(2 ** 20));
      const before = await metric("dispatchcloud_cas_uploaded_bytes_total");
      const res = await put(alice, bomb, claimed, { ...BIN, "content-encoding": "gzip" });
      expectApiError(res, 413, "cas.too_large");
      // Cut off at the digest's size: no more than 1 MiB of the 100 MiB was written.
      expect((await metric("dispatchcloud_cas_uploaded_bytes_total")) - before).toBeLessThanOrEqual(2 ** 20);
      expect(await missing(alice, [claimed])).toEqual([formatDigest(claimed)]);
      const head = await app.inject({
        method: "HEAD",
        url: url("uploads", claimed),
        headers: { authorization: `Bearer ${alice}` },
      });
      expect(head.headers["upload-offset"]).toBe("0");
    });

    it("accepts gzip, deflate and br bodies; refuses other encodings", async () => {
      const data = Buffer.from("hello ".repeat(10_000));
      const d = digestOf(data);
      const { brotliCompressSync, deflateSync } = await import("node:zlib");
      expect((await put(alice, gzipSync(data), d, { ...BIN, "content-encoding": "gzip" })).status).toBe(201);
      expect((await put(bob, deflateSync(data), d, { ...BIN, "content-encoding": "deflate" })).status).toBe(
        201,
      );
      expect(
        (await put(alice, brotliCompressSync(data), d, { ...BIN, "content-encoding": "br" })).status,
      ).toBe(201);
      expectApiError(
        await put(alice, data, d, { ...BIN, "content-encoding": "zstd" }),
        415,
        "cas.unsupported_encoding",
      );
    });

    it("serves ranges (206) and gzip when asked, but not for data already compressed", async () => {
      const data = Buffer.from("abcdefghij".repeat(1000));
      const d = digestOf(data);
      expect((await put(alice, data)).status).toBe(201);
      const r = await api("GET", url("blobs", d), alice, undefined, { range: "bytes=5-14" });
      expect(r.status).toBe(206);
      expect(r.headers["content-range"]).toBe(`bytes 5-14/${data.length}`);
      expect(r.raw.toString()).toBe(data.subarray(5, 15).toString());
      const tail = await api("GET", url("blobs", d), alice, undefined, { range: "bytes=9990-" });
      expect(tail.raw.toString()).toBe("abcdefghij");
      expectApiError(
        await api("GET", url("blobs", d), alice, undefined, { range: `bytes=${data.length}-` }),
        416,
        "cas.range_not_satisfiable",
      );
      const z = await api("GET", url("blobs", d), alice, undefined, { "accept-encoding": "gzip" });
      expect(z.headers["content-encoding"]).toBe("gzip");
      expect(z.raw.length).toBeLessThan(data.length);
      expect(gunzipSync(z.raw).equals(data)).toBe(true);
      const gz = gzipSync(randomBytes(3000));
      expect((await put(alice, gz)).status).toBe(201);
      const plain = await api("GET", url("blobs", digestOf(gz)), alice, undefined, {
        "accept-encoding": "gzip",
      });
      expect(plain.headers["content-encoding"]).toBeUndefined();
      expect(plain.raw.equals(gz)).toBe(true);
      // Random bytes do not compress: sent as they are, without a gzip trip on either side.
      const noise = randomBytes(100_000);
      expect((await put(alice, noise)).status).toBe(201);
      const raw = await api("GET", url("blobs", digestOf(noise)), alice, undefined, {
        "accept-encoding": "gzip",
      });
      expect(raw.headers["content-encoding"]).toBeUndefined();
      expect(raw.raw.equals(noise)).toBe(true);
    });

    it("batch upload and read: verified per blob, in order", async () => {
      const a = randomBytes(100);
      const b = randomBytes(200);
      const up = await api("POST", "/api/v1/cas/batch-upload", alice, {
        blobs: [
          { digest: formatDigest(digestOf(a)), data: a.toString("base64") },
          { digest: formatDigest(digestOf(b)), data: a.toString("base64") },
        ],
      });
      expect(up.status, JSON.stringify(up.body)).toBe(200);
      expect(up.body.results[0]).toEqual({ digest: formatDigest(digestOf(a)), ok: true });
      expect(up.body.results[1].error.code).toBe("cas.digest_mismatch");
      const read = await api("POST", "/api/v1/cas/batch-read", alice, {
        digests: [formatDigest(digestOf(a)), formatDigest(digestOf(b))],
      });
      expect(read.status).toBe(200);
      expect(Buffer.from(read.body.blobs[0].data, "base64").equals(a)).toBe(true);
      expect(read.body.blobs[1].error.code).toBe("cas.not_found");
    });

    it("manifests: validated with paths, complete for the caller, readable as JSON", async () => {
      const f1 = randomBytes(300);
      const f2 = randomBytes(400);
      const body = manifestOf({ "a.txt": f1, "b.bin": f2 });
      const md = digestOf(body);
      expect((await put(alice, f1)).status).toBe(201);
      const incomplete = await api("PUT", url("manifests", md), alice, body, BIN);
      expectApiError(incomplete, 400, "cas.manifest_incomplete");
      expect(incomplete.body.error.message).toContain(formatDigest(digestOf(f2)));
      expect((await put(alice, f2)).status).toBe(201);
      const ok = await api("PUT", url("manifests", md), alice, body, { "content-type": "application/json" });
      expect(ok.status, JSON.stringify(ok.body)).toBe(201);
      expect(ok.body).toEqual({ digest: formatDigest(md), files: 2, bytes: 700 });
      const got = await api("GET", url("manifests", md), alice);
      expect(got.raw.equals(body)).toBe(true);

      const unsorted = Buffer.from(
        `{"version":1,"entries":[{"path":"z","type":"dir"},{"path":"a/../b","type":"dir"}]}`,
      );
      const bad = await api("PUT", url("manifests", digestOf(unsorted)), alice, unsorted, BIN);
      expectApiError(bad, 400, "cas.invalid_manifest");
      expect(bad.body.error.path).toContain("entries[1]");
      // Bob holds neither blob: he may not store a manifest naming them.
      expectApiError(await api("PUT", url("manifests", md), bob, body, BIN), 400, "cas.manifest_incomplete");
    });

    it("a runner writes for its bundle's owner and cannot read another user's blob; finish records outputManifest", async () => {
      const secret = randomBytes(500);
      expect((await put(bob, secret)).status).toBe(201);
      const r = await running(alice);
      expectApiError(await api("GET", url("blobs", digestOf(secret)), r.token), 404, "cas.not_found");
      expect(await missing(r.token, [digestOf(secret)])).toEqual([formatDigest(digestOf(secret))]);

      const out = randomBytes(1234);
      expect((await put(r.token, out)).status).toBe(201);
      const body = manifestOf({ "result.bin": out });
      const md = digestOf(body);
      expect((await api("PUT", url("manifests", md), r.token, body, BIN)).status).toBe(201);
      expect((await api("GET", url("blobs", digestOf(out)), alice)).raw.equals(out)).toBe(true);

      const bogus = digestOf(randomBytes(10));
      expectApiError(
        await api("POST", "/api/v1/runner/finish", r.token, {
          exitCode: 0,
          outputManifest: formatDigest(bogus),
        }),
        400,
        "cas.unknown_manifest",
        "outputManifest",
      );
      const fin = await api("POST", "/api/v1/runner/finish", r.token, {
        exitCode: 0,
        outputManifest: formatDigest(md),
      });
      expect(fin.status, JSON.stringify(fin.body)).toBe(200);
      const { rows } = await getDb().query<Json>(
        "SELECT output_manifest, output_bytes::int AS b FROM bundles WHERE uuid = $1",
        [r.uuid],
      );
      expect(rows[0]).toEqual({ output_manifest: formatDigest(md), b: 1234 });

      // A dependent bundle: its runner gets the manifest in the spec and may read its blobs.
      const dep = await running(alice, { dependencies: [{ bundle: r.uuid, name: "in" }] });
      const spec = await api("GET", "/api/v1/runner/spec", dep.token);
      expect(spec.body.dependencies[0].manifest).toBe(formatDigest(md));
      expect((await api("GET", url("blobs", digestOf(out)), dep.token)).raw.equals(out)).toBe(true);
      expect((await api("GET", url("manifests", md), dep.token)).status).toBe(200);
    });

    it("garbage collection deletes only old unreferenced blobs, and spares an upload in flight", async () => {
      const old = randomBytes(111);
      const kept = randomBytes(222);
      const named = randomBytes(333);
      const inFlight = randomBytes(444);
      for (const b of [old, kept, named, inFlight]) expect((await put(alice, b)).status).toBe(201);
      const body = manifestOf({ n: named });
      const md = digestOf(body);
      expect((await api("PUT", url("manifests", md), alice, body, BIN)).status).toBe(201);
      // A bundle's output manifest lives as long as the bundle.
      await getDb().query(
        "UPDATE bundles SET output_manifest = $1 WHERE uuid = (SELECT uuid FROM bundles LIMIT 1)",
        [formatDigest(md)],
      );
      nowMs += 8 * DAY;
      expect(await missing(alice, [digestOf(kept)])).toEqual([]); // asking extends its life
      expect(await beginUpload(getDb(), digestOf(inFlight), new Date(nowMs))).toBe("present");
      await app.casGc.gcOnce();
      const left = await listAll(backend);
      expect(left).not.toContain(formatDigest(digestOf(old)));
      expect(left).toContain(formatDigest(digestOf(kept)));
      expect(left).toContain(formatDigest(digestOf(named)));
      expect(left).toContain(formatDigest(md));
      expect(left).toContain(formatDigest(digestOf(inFlight)));
      expect(await missing(alice, [digestOf(old)])).toEqual([formatDigest(digestOf(old))]);
      // A row being deleted refuses uploads with cas.busy.
      await getDb().query("UPDATE cas_blobs SET state = 'deleting' WHERE hash = $1", [digestOf(kept).hash]);
      expectApiError(await put(alice, kept), 503, "cas.busy");
      await app.casGc.gcOnce();
      expect(await listAll(backend)).not.toContain(formatDigest(digestOf(kept)));
      expect((await put(alice, kept)).status).toBe(201);
    });

    it("an old blob being uploaded again while garbage collection runs is kept", async () => {
      const data = randomBytes(100_000);
      const d = digestOf(data);
      expect((await put(alice, data)).status).toBe(201);
      nowMs += 8 * DAY;
      const body = new PassThrough();
      const pending = app.inject({
        method: "PUT",
        url: url("blobs", d),
        headers: { authorization: `Bearer ${alice}`, ...BIN },
        payload: body,
      });
      body.write(data.subarray(0, 50_000));
      // The upload has begun once it touched the row.
      for (let i = 0; i < 200; i++) {
        const { rows } = await getDb().query<Json>("SELECT touched_at FROM cas_blobs WHERE hash = $1", [
          d.hash,
        ]);
        if (rows[0]?.touched_at.getTime() === nowMs) break;
        await new Promise((r) => setTimeout(r, 10));
      }
      await app.casGc.gcOnce();
      body.end(data.subarray(50_000));
      const res = await pending;
      expect(res.statusCode, res.body).toBe(201);
      expect(await listAll(backend)).toContain(formatDigest(d));
      expect((await api("GET", url("blobs", d), alice)).raw.equals(data)).toBe(true);
    });

    it("garbage collection removes partial uploads a day after their last write", async () => {
      const dir = join(dataDir, "cas-partial", aliceUuid);
      await mkdir(dir, { recursive: true });
      const stale = join(dir, `${"a".repeat(64)}-10`);
      const fresh = join(dir, `${"b".repeat(64)}-10`);
      await writeFile(stale, "12345");
      await writeFile(fresh, "12345");
      await utimes(stale, new Date(nowMs - 2 * DAY), new Date(nowMs - 2 * DAY));
      await utimes(fresh, new Date(nowMs - DAY / 2), new Date(nowMs - DAY / 2));
      const result = await app.casGc.gcOnce();
      expect(result.partials).toBeGreaterThanOrEqual(1);
      await expect(stat(stale)).rejects.toThrow();
      expect((await stat(fresh)).size).toBe(5);
      await rm(fresh);
    });

    it("garbage collection removes bytes the store has no row for, once a day", async () => {
      // Bytes written by an upload that ended before it was recorded (a crash): in the backend, no row.
      const orphan = randomBytes(555);
      const recorded = randomBytes(556);
      await backend.writeBytes(digestOf(orphan), orphan);
      expect((await put(alice, recorded)).status).toBe(201);
      nowMs += DAY; // a day after any earlier collection's look
      const first = await app.casGc.gcOnce();
      expect(first.orphans).toBeGreaterThanOrEqual(1);
      expect(first.blobs).toBeGreaterThanOrEqual(first.orphans ?? 0);
      const left = await listAll(backend);
      expect(left).not.toContain(formatDigest(digestOf(orphan)));
      expect(left).toContain(formatDigest(digestOf(recorded)));
      const { rows } = await getDb().query("SELECT 1 FROM cas_blobs WHERE hash = $1", [
        digestOf(orphan).hash,
      ]);
      expect(rows).toEqual([]);
      // The same bytes uploaded for real now are stored, recorded and kept.
      expect((await put(alice, orphan)).status).toBe(201);
      expect((await api("GET", url("blobs", digestOf(orphan)), alice)).raw.equals(orphan)).toBe(true);
      // Not looked for again within the day; the next day it is.
      const another = randomBytes(557);
      await backend.writeBytes(digestOf(another), another);
      nowMs += DAY / 2;
      expect((await app.casGc.gcOnce()).orphans).toBeNull();
      expect(await listAll(backend)).toContain(formatDigest(digestOf(another)));
      nowMs += DAY / 2;
      expect((await app.casGc.gcOnce()).orphans).toBe(1);
      const after = await listAll(backend);
      expect(after).not.toContain(formatDigest(digestOf(another)));
      expect(after).toContain(formatDigest(digestOf(orphan)));
      expect(after).toContain(formatDigest(digestOf(recorded)));
    });

    it("an upload cut off by a server restart resumes from the offset the server kept", async () => {
      const data = randomBytes(3 * 2 ** 20);
      const d = digestOf(data);
      const open = async () => {
        const srv = await createRestServer({
          db: getDb(),
          logger: false,
          clusterId: CLUSTER,
          maxRequestBodySize: 64 * 1024,
          defaultMaxAttempts: 3,
          dataDir,
          clock: { now: () => nowMs },
          cas: { backend: await backendKind.make(dataDir) },
        });
        await srv.listen({ port: 0, host: "127.0.0.1" });
        return srv;
      };
      const first = await open();
      const port = (first.server.address() as AddressInfo).port;
      const sent = 2 ** 20;
      await new Promise<void>((resolve) => {
        const req = http.request({
          host: "127.0.0.1",
          port,
          method: "PUT",
          path: url("blobs", d),
          headers: { authorization: `Bearer ${alice}`, ...BIN, "content-length": String(data.length) },
        });
        req.on("error", () => resolve());
        req.on("response", () => resolve());
        req.write(data.subarray(0, sent), async () => {
          // Let the server write what arrived, then stop it in the middle of the upload.
          for (let i = 0; i < 50; i++) {
            const st = await stat(join(dataDir, "cas-partial", aliceUuid, `${d.hash}-${d.size}`)).catch(
              () => null,
            );
            if (st !== null && st.size >= sent) break;
            await new Promise((r) => setTimeout(r, 20));
          }
          first.server.closeAllConnections();
          await first.close();
        });
      });
      const second = await open();
      try {
        const sApi = injectClient(second);
        expect(
          await (async () => {
            const r = await sApi("POST", "/api/v1/cas/find-missing", alice, { digests: [formatDigest(d)] });
            return r.body.missing;
          })(),
        ).toEqual([formatDigest(d)]);
        const head = await second.inject({
          method: "HEAD",
          url: url("uploads", d),
          headers: { authorization: `Bearer ${alice}` },
        });
        const offset = Number(head.headers["upload-offset"]);
        expect(offset).toBe(sent);
        expectApiError(
          await sApi("PUT", url("blobs", d), alice, data.subarray(5), { ...BIN, "upload-offset": "5" }),
          409,
          "cas.upload_offset",
        );
        const done = await sApi("PUT", url("blobs", d), alice, gzipSync(data.subarray(offset)), {
          ...BIN,
          "upload-offset": String(offset),
          "content-encoding": "gzip",
        });
        expect(done.status, JSON.stringify(done.body)).toBe(201);
        expect((await sApi("GET", url("blobs", d), alice)).raw.equals(data)).toBe(true);
      } finally {
        await second.close();
      }
    });
  });
}
