/**
 * Images in the content-addressed store (rest-server/images-routes.ts, image-resolve.ts; docs/images.md) on
 * PostgreSQL and PGlite: registering an uploaded `docker save` tree, listing, getting and removing it, the
 * `images.*` errors, submit-time pinning on every insert path (single submissions through the coalescer and
 * through the checked insert, batches), the runner's spec on a retried attempt, who may read the tree, and
 * garbage collection keeping an image's blobs.
 */
import { createHash, randomBytes } from "node:crypto";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, expect, it } from "vitest";
import { type Digest, formatDigest } from "../lib/cas/digest.ts";
import { canonicalManifest, type Manifest } from "../lib/cas/manifest.ts";
import { type BundleManager, createBundleManager } from "../rest-server/bundle-manager.ts";
import type { ImageResolver } from "../rest-server/image-resolve.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createTestUserWithToken, describeEachDb, startWithRunnerToken } from "./db.ts";
import { silentLogger as silent } from "./fixtures.ts";
import { expectApiError, injectClient, type Json } from "./rest-client.ts";

const CLUSTER = "zzzzz";
const DAY = 86_400_000;
const BIN = { "content-type": "application/octet-stream" };

const digestOf = (data: Buffer): Digest => ({
  hash: createHash("sha256").update(data).digest("hex"),
  size: data.length,
});
const url = (kind: "blobs" | "manifests", d: Digest) => `/api/v1/cas/${kind}/${d.hash}/${d.size}`;

/** A tree shaped like an unpacked `docker save` (docker's own layout): config, manifest.json, one layer. */
function fakeSavedImage(layer: Buffer): { files: Record<string, Buffer>; imageId: string } {
  const config = Buffer.from(
    JSON.stringify({ architecture: "amd64", rootfs: { nonce: randomBytes(8).toString("hex") } }),
  );
  const hex = digestOf(config).hash;
  const layerDir = digestOf(layer).hash;
  const index = Buffer.from(
    JSON.stringify([{ Config: `${hex}.json`, RepoTags: ["x:1"], Layers: [`${layerDir}/layer.tar`] }]),
  );
  return {
    files: { [`${hex}.json`]: config, "manifest.json": index, [`${layerDir}/layer.tar`]: layer },
    imageId: `sha256:${hex}`,
  };
}

function manifestOf(files: Record<string, Buffer>): Buffer {
  const paths = Object.keys(files);
  const dirs = [...new Set(paths.filter((p) => p.includes("/")).map((p) => p.slice(0, p.lastIndexOf("/"))))];
  const m: Manifest = {
    version: 1,
    entries: [
      ...dirs.map((path) => ({ path, type: "dir" as const })),
      ...paths.map((path) => ({
        path,
        type: "file" as const,
        digest: digestOf(files[path]!),
        executable: false,
      })),
    ].sort((a, b) => (a.path < b.path ? -1 : a.path > b.path ? 1 : 0)),
  };
  return canonicalManifest(m);
}

describeEachDb("images in the store", (getDb) => {
  let app: FastifyInstance;
  let api: ReturnType<typeof injectClient>;
  let manager: BundleManager;
  let dataDir: string;
  let nowMs = Date.UTC(2026, 5, 1);
  let alice: { uuid: string; token: string };
  let bob: { uuid: string; token: string };
  /** What a registry resolver (helper P's, in production) answers: every `reg.test/...` tag. */
  const registryResolver: ImageResolver = async (ref) =>
    ref.startsWith("reg.test/")
      ? { pinned: `${ref.split(":")[0]}@sha256:${"ab".repeat(32)}`, store: null }
      : null;

  /** Uploads a tree's blobs and manifest as `token`'s user; returns the manifest digest. */
  const uploadTree = async (token: string, files: Record<string, Buffer>): Promise<string> => {
    for (const data of Object.values(files)) {
      const res = await api("PUT", url("blobs", digestOf(data)), token, data, BIN);
      expect(res.status, JSON.stringify(res.body)).toBe(201);
    }
    const body = manifestOf(files);
    const md = digestOf(body);
    const res = await api("PUT", url("manifests", md), token, body, BIN);
    expect(res.status, JSON.stringify(res.body)).toBe(201);
    return formatDigest(md);
  };
  const push = async (token: string, name: string, layer = randomBytes(3000)) => {
    const img = fakeSavedImage(layer);
    const manifest = await uploadTree(token, img.files);
    const res = await api("POST", "/api/v1/images", token, { name, manifest, imageId: img.imageId });
    expect(res.status, JSON.stringify(res.body)).toBe(201);
    return { ...img, manifest, view: res.body };
  };
  const submit = async (token: string, body: object): Promise<Json> => {
    const res = await api("POST", "/api/v1/bundles", token, { command: ["true"], ...body });
    expect(res.status, JSON.stringify(res.body)).toBe(201);
    return res.body;
  };
  const runnerSpec = async (uuid: string): Promise<{ spec: Json; token: string }> => {
    await manager.runOnce();
    const r = await startWithRunnerToken(getDb(), uuid);
    const spec = await api("GET", "/api/v1/runner/spec", r.token);
    expect(spec.status, JSON.stringify(spec.body)).toBe(200);
    return { spec: spec.body, token: r.token };
  };

  beforeAll(async () => {
    dataDir = await mkdtemp(join(tmpdir(), "dc-images-"));
    app = await createRestServer({
      db: getDb(),
      logger: false,
      clusterId: CLUSTER,
      maxRequestBodySize: 64 * 1024,
      defaultMaxAttempts: 3,
      dataDir,
      clock: { now: () => nowMs },
      cas: { retention: 7 * DAY },
      imageResolvers: [registryResolver],
    });
    api = injectClient(app);
    manager = createBundleManager({ db: getDb(), logger: silent });
    alice = await createTestUserWithToken(getDb());
    bob = await createTestUserWithToken(getDb());
  });
  afterAll(async () => {
    await app?.close();
    if (dataDir) await rm(dataDir, { recursive: true, force: true });
  });

  it("registers an uploaded image, lists it, gets it by name or id, and names without a tag get :latest", async () => {
    const img = await push(alice.token, "tools/busybox");
    expect(img.view).toMatchObject({
      name: "tools/busybox:latest",
      imageId: img.imageId,
      manifest: img.manifest,
      bytes: Object.values(img.files).reduce((n, b) => n + b.length, 0),
      replaced: false,
    });
    const list = await api("GET", "/api/v1/images", alice.token);
    expect(list.body.items.map((i: Json) => i.name)).toContain("tools/busybox:latest");
    expect((await api("GET", "/api/v1/images", bob.token)).body.items).toEqual([]);
    for (const ref of ["tools%2Fbusybox", "tools%2Fbusybox%3Alatest", img.imageId]) {
      const got = await api("GET", `/api/v1/images/${ref}`, alice.token);
      expect(got.status, JSON.stringify(got.body)).toBe(200);
      expect(got.body.imageId).toBe(img.imageId);
    }
    expectApiError(
      await api("GET", "/api/v1/images/tools%2Fbusybox", bob.token),
      404,
      "images.not_found",
      "ref",
    );
    expectApiError(
      await api("GET", "/api/v1/images/Not%20A%20Name", alice.token),
      400,
      "images.invalid_name",
      "ref",
    );
    // A second push of the name replaces what it named.
    const again = await push(alice.token, "tools/busybox:latest");
    expect(again.view.replaced).toBe(true);
    expect((await api("GET", "/api/v1/images/tools%2Fbusybox", alice.token)).body.imageId).toBe(
      again.imageId,
    );
  });

  it("refuses bad registrations with stable codes and field paths", async () => {
    const img = fakeSavedImage(randomBytes(100));
    const manifest = await uploadTree(alice.token, img.files);
    const reg = (token: string, body: object) => api("POST", "/api/v1/images", token, body);
    const ok = { name: "x:1", manifest, imageId: img.imageId };
    expectApiError(await reg(alice.token, { ...ok, name: "Upper/Case" }), 400, "images.invalid_name", "name");
    expectApiError(await reg(alice.token, { ...ok, name: img.imageId }), 400, "images.invalid_name", "name");
    expectApiError(
      await reg(alice.token, { ...ok, imageId: "sha256:xyz" }),
      400,
      "images.invalid_image_id",
      "imageId",
    );
    expectApiError(
      await reg(alice.token, { ...ok, manifest: "nope" }),
      400,
      "cas.invalid_digest",
      "manifest",
    );
    // Bob never uploaded the tree: he may not name it.
    expectApiError(await reg(bob.token, ok), 400, "images.unknown_manifest", "manifest");
    // A tree without the config named by the id is not that image's docker save.
    const other = `sha256:${"0".repeat(64)}`;
    expectApiError(
      await reg(alice.token, { ...ok, imageId: other }),
      400,
      "images.config_missing",
      "imageId",
    );
    const { "manifest.json": _, ...noIndex } = img.files;
    const m2 = await uploadTree(alice.token, noIndex);
    expectApiError(await reg(alice.token, { ...ok, manifest: m2 }), 400, "images.config_missing", "imageId");
    expectApiError(await reg(alice.token, { ...ok, extra: 1 }), 400, "request.unknown_field");
    expect((await reg(alice.token, ok)).status).toBe(201);
  });

  it("pins a bundle's image on every insert path, shows it, and gives every attempt the same spec", async () => {
    const img = await push(alice.token, "pin/me:1");
    const store = { manifest: img.manifest, imageId: img.imageId, bytes: img.view.bytes };
    // 1. A single submission without dependencies or limits: the submit coalescer's multi-row insert.
    const coalesced = await submit(alice.token, { image: "pin/me:1" });
    expect(coalesced.imagePinned).toBe(img.imageId);
    // 2. A single submission with a dependency: the checked insert (insertBundle's one statement).
    const dep = await submit(alice.token, { image: "busybox" });
    const withDep = await submit(alice.token, { image: img.imageId, dependencies: [{ bundle: dep.uuid }] });
    expect(withDep.imagePinned).toBe(img.imageId);
    // 3. A batch (insertBundles), with one store image, one registry tag and one unknown image.
    const batch = await api("POST", "/api/v1/bundles/batch", alice.token, {
      items: [
        { command: ["true"], image: "pin/me:1" },
        { command: ["true"], image: "reg.test/tool:2" },
        { command: ["true"], image: "nowhere/else:3" },
      ],
    });
    expect(batch.status, JSON.stringify(batch.body)).toBe(201);
    expect(batch.body.items.map((b: Json) => b.imagePinned)).toEqual([
      img.imageId,
      `reg.test/tool@sha256:${"ab".repeat(32)}`,
      null,
    ]);
    // Another user's image of that name is not theirs: no pin.
    expect((await submit(bob.token, { image: "pin/me:1" })).imagePinned).toBe(null);
    const got = await api("GET", `/api/v1/bundles/${batch.body.items[0].uuid}`, alice.token);
    expect(got.body.imagePinned).toBe(img.imageId);

    const { spec, token } = await runnerSpec(coalesced.uuid);
    // Staged, its image's tree counts among its inputs for the scheduler's locality, with the tree's bytes.
    const staged = await getDb().query<{ input_manifests: unknown }>(
      "SELECT input_manifests FROM bundles WHERE uuid = $1",
      [coalesced.uuid],
    );
    expect(staged.rows[0]!.input_manifests).toEqual([{ digest: img.manifest, bytes: img.view.bytes }]);
    // Staged by the batch's insert too: the store image's tree, and nothing for a registry image.
    const inBatch = await getDb().query<{ uuid: string; state: string; input_manifests: unknown }>(
      "SELECT uuid, state, input_manifests FROM bundles WHERE uuid = ANY($1::text[])",
      [batch.body.items.slice(0, 2).map((b: Json) => b.uuid)],
    );
    const byUuid = new Map(inBatch.rows.map((r) => [r.uuid, r]));
    expect(byUuid.get(batch.body.items[0].uuid)).toMatchObject({
      state: "staged",
      input_manifests: [{ digest: img.manifest, bytes: img.view.bytes }],
    });
    expect(byUuid.get(batch.body.items[1].uuid)).toMatchObject({ state: "staged", input_manifests: [] });
    expect(spec).toMatchObject({ image: "pin/me:1", imagePinned: img.imageId, imageStore: store });
    const registry = await runnerSpec(batch.body.items[1].uuid);
    expect(registry.spec).toMatchObject({
      imagePinned: `reg.test/tool@sha256:${"ab".repeat(32)}`,
      imageStore: null,
    });
    // The name is pushed again (a newer build) and the first attempt fails on its instance: the retried attempt
    // runs what the bundle was pinned to, not what the name names now.
    await push(alice.token, "pin/me:1");
    expect((await api("POST", "/api/v1/runner/start", token, {})).status).toBe(200);
    const requeued = await api("POST", "/api/v1/runner/requeue", token, { reason: "disk gone" });
    expect(requeued.status, JSON.stringify(requeued.body)).toBe(200);
    expect(requeued.body.state).toBe("staged");
    const second = await startWithRunnerToken(getDb(), coalesced.uuid);
    expect(second.bundle.attempt).toBe(2);
    const spec2 = await api("GET", "/api/v1/runner/spec", second.token);
    expect(spec2.body).toMatchObject({ attempt: 2, imagePinned: img.imageId, imageStore: store });
  });

  it("without registry resolvers, the insert statements pin store images themselves, on every path", async () => {
    const plain = await createRestServer({
      db: getDb(),
      logger: false,
      clusterId: CLUSTER,
      maxRequestBodySize: 64 * 1024,
      defaultMaxAttempts: 3,
      dataDir: join(dataDir, "plain"),
      clock: { now: () => nowMs },
    });
    try {
      const p = injectClient(plain);
      const img = await push(alice.token, "sql/pin");
      const one = await p("POST", "/api/v1/bundles", alice.token, { command: ["true"], image: "sql/pin" });
      expect(one.body.imagePinned, JSON.stringify(one.body)).toBe(img.imageId);
      const withDep = await p("POST", "/api/v1/bundles", alice.token, {
        command: ["true"],
        image: img.imageId,
        dependencies: [{ bundle: one.body.uuid }],
      });
      expect(withDep.body.imagePinned).toBe(img.imageId);
      const batch = await p("POST", "/api/v1/bundles/batch", alice.token, {
        items: [
          { command: ["true"], image: "sql/pin:latest" },
          { command: ["true"], image: "reg.test/tool:2" },
        ],
      });
      expect(batch.body.items.map((b: Json) => b.imagePinned)).toEqual([img.imageId, null]);
      const bobs = await p("POST", "/api/v1/bundles", bob.token, { command: ["true"], image: "sql/pin" });
      expect(bobs.body.imagePinned).toBe(null);
      const { spec } = await runnerSpec(one.body.uuid);
      expect(spec.imageStore).toEqual({
        manifest: img.manifest,
        imageId: img.imageId,
        bytes: img.view.bytes,
      });
    } finally {
      await plain.close();
    }
  });

  it("lets the owner's runners read the image's blobs, even after the owner removed the image", async () => {
    const img = await push(alice.token, "read/me:1");
    const layer = Object.entries(img.files).find(([p]) => p.endsWith("layer.tar"))![1];
    const b = await submit(alice.token, { image: "read/me:1" });
    const { token } = await runnerSpec(b.uuid);
    const res = await api("GET", url("blobs", digestOf(layer)), token);
    expect(res.status).toBe(200);
    expect(res.raw.equals(layer)).toBe(true);
    // Bob's runners may not.
    const theirs = await submit(bob.token, { image: "busybox" });
    const bobRunner = await runnerSpec(theirs.uuid);
    expect((await api("GET", url("blobs", digestOf(layer)), bobRunner.token)).status).toBe(404);

    const del = await api("DELETE", "/api/v1/images/read%2Fme%3A1", alice.token);
    expect(del.status, JSON.stringify(del.body)).toBe(200);
    expect(del.body.removed.map((i: Json) => i.name)).toEqual(["read/me:1"]);
    expectApiError(await api("DELETE", "/api/v1/images/read%2Fme%3A1", alice.token), 404, "images.not_found");
    expect((await api("GET", url("blobs", digestOf(layer)), token)).status).toBe(200);
  });

  it("an image's blobs survive garbage collection while it is registered or a live bundle is pinned to it", async () => {
    const kept = await push(alice.token, "gc/kept:1");
    const pinned = await push(alice.token, "gc/pinned:1");
    const gone = await push(alice.token, "gc/gone:1");
    const b = await submit(alice.token, { image: "gc/pinned:1" });
    expect((await api("DELETE", "/api/v1/images/gc%2Fpinned%3A1", alice.token)).status).toBe(200);
    expect((await api("DELETE", `/api/v1/images/${gone.imageId}`, alice.token)).status).toBe(200);
    nowMs += 8 * DAY;
    await app.casGc.gcOnce();
    const stored = async (files: Record<string, Buffer>) => {
      const { rows } = await getDb().query<{ n: number }>(
        "SELECT count(*)::int AS n FROM cas_blobs WHERE hash = ANY($1::text[]) AND state = 'present'",
        [Object.values(files).map((f) => digestOf(f).hash)],
      );
      return rows[0]!.n;
    };
    expect(await stored(kept.files)).toBe(3);
    expect(await stored(pinned.files)).toBe(3);
    expect(await stored(gone.files)).toBe(0);
    // Once the pinned bundle is final, its image goes too.
    expect((await api("POST", `/api/v1/bundles/${b.uuid}/kill`, alice.token, {})).status).toBe(200);
    await app.casGc.gcOnce();
    expect(await stored(pinned.files)).toBe(0);
    expect(await stored(kept.files)).toBe(3);
  });
});
