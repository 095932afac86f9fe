/**
 * crunch-run's loading of an image from the content-addressed store (crunch-run/image-store.ts) with real parts:
 * the REST server on PGlite, the CAS client, the instance's cache and the real Docker daemon. Two bundles that
 * need one image on one instance at once load it once (the other finds it loaded); an image whose tree the store
 * does not have fails with crunchrun.image_missing naming the image.
 */
import { execFile } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { CasCache } from "../crunch-run/cas-cache.ts";
import { createDockerClient } from "../crunch-run/docker-api.ts";
import { createStoreImageLoader, type StoreImageLoad } from "../crunch-run/image-store.ts";
import { type CasClient, createCasClient } from "../lib/cas/client.ts";
import { formatDigest } from "../lib/cas/digest.ts";
import { extractTar } from "../lib/tar.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createUser } from "../store/queries.ts";
import { openTestDb, type TestDb } from "./db.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";

const BASE = requireDockerImage();
const run = promisify(execFile);
const docker = (...args: string[]) => run("docker", args, { timeout: 60_000 });

describe("loading an image from the store into Docker", () => {
  const dir = mkdtempSync(join(tmpdir(), "image-store-"));
  const nonce = randomBytes(6).toString("hex");
  const image = `dctest/image-store-${nonce}:1`;
  let db: TestDb;
  let app: FastifyInstance;
  let cas: CasClient;
  let imageId = "";
  let manifest = "";
  let bytes = 0;

  beforeAll(async () => {
    db = await openTestDb("pglite");
    const token = newUserToken();
    await createUser(db, {
      uuid: newUserUuid("zzzzz"),
      name: "img",
      isAdmin: false,
      tokenHash: hashToken(token),
    });
    app = await createRestServer({
      db,
      logger: false,
      clusterId: "zzzzz",
      maxRequestBodySize: 1 << 20,
      defaultMaxAttempts: 3,
      dataDir: join(dir, "server"),
    });
    const url = await app.listen({ host: "127.0.0.1", port: 0 });
    cas = createCasClient({ url, token });
    // An image of its own, saved, unpacked and uploaded as `images push` does; then gone from the daemon.
    const container = `dctest-image-store-${nonce}`;
    await docker("run", "--name", container, BASE, "sh", "-c", `echo ${nonce} > /nonce`);
    await docker("commit", container, image);
    await docker("rm", "-f", container);
    imageId = (await docker("image", "inspect", "--format", "{{.Id}}", image)).stdout.trim();
    const tree = join(dir, "saved");
    mkdirSync(tree);
    const save = execFile("docker", ["save", image], { encoding: "buffer", maxBuffer: 1 << 30 });
    await extractTar(save.stdout!, tree);
    const up = await cas.uploadTree(tree, { absoluteRoot: tree });
    manifest = formatDigest(up.digest);
    bytes = up.bytes;
    await docker("rmi", "-f", imageId);
  }, 120_000);

  afterAll(async () => {
    cas?.close();
    await app?.close();
    await db?.close();
    await docker("rmi", "-f", imageId || image).catch(() => {});
    rmSync(dir, { recursive: true, force: true });
  });

  const loader = (cacheDir: string, id: string, onLoaded: (r: StoreImageLoad) => void, lines: string[]) => {
    const cache = new CasCache(cacheDir);
    const lockFile = join(dir, "lock", `crunch-run-${id}.lock`);
    mkdirSync(join(dir, "lock"), { recursive: true });
    writeFileSync(lockFile, JSON.stringify({ uuid: id, pid: process.pid, startTime: "" }));
    return createStoreImageLoader({
      cache: async () => cache,
      cas,
      docker: createDockerClient(process.env),
      pin: { id, lockFile },
      lockDir: join(dir, "lock"),
      image,
      say: (l) => lines.push(l),
      onLoaded,
    });
  };

  it("two bundles on one instance needing it at once: loaded once, tagged, said in both logs", async () => {
    const results: StoreImageLoad[] = [];
    const linesA: string[] = [];
    const linesB: string[] = [];
    const cacheDir = join(dir, "vm-cache");
    const store = { manifest, imageId, bytes };
    await Promise.all([
      loader(cacheDir, "a-1", (r) => results.push(r), linesA)(store),
      loader(cacheDir, "b-1", (r) => results.push(r), linesB)(store),
    ]);
    expect(results.map((r) => r.outcome).sort()).toEqual(["loaded", "present"]);
    const loaded = results.find((r) => r.outcome === "loaded")!;
    expect(loaded.fetch?.blobsHit).toBe(0);
    expect(loaded.fetch?.bytesFetched).toBeGreaterThanOrEqual(bytes);
    expect((await docker("image", "inspect", "--format", "{{.Id}}", image)).stdout.trim()).toBe(imageId);
    const all = [...linesA, ...linesB].join("\n");
    expect(all).toMatch(/is not on this instance: loading it from the store/);
    expect(all).toMatch(/loaded image dctest\/image-store-\w+:1 \(sha256:\w+\) into Docker from the store/);
    expect(all).toMatch(/was loaded by another bundle on this instance/);
    const ran = await docker("run", "--rm", image, "cat", "/nonce");
    expect(ran.stdout.trim()).toBe(nonce);
  }, 120_000);

  it("a tree the store does not have fails with crunchrun.image_missing naming the image", async () => {
    await docker("rmi", "-f", imageId);
    const missing = { manifest: `${"0".repeat(64)}/100`, imageId, bytes };
    const err = await loader(join(dir, "other-cache"), "c-1", () => {}, [])(missing).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: "crunchrun.image_missing" });
    expect((err as Error).message).toContain(image);
  }, 60_000);
});
