/**
 * Loading a bundle's image from the content-addressed store (docs/images.md "Images in our store"): the image's
 * unpacked `docker save` tree is fetched into the instance's cache (cas-cache.ts, as dependencies are, pinned for
 * the attempt), a tar of it is streamed from the cached blobs to the Docker Engine API's `POST /images/load`, and
 * the loaded image is tagged with the name the bundle gave. Bundles on one instance that need one image at once
 * load it once: a lock file per image id (`${ROOT}/var/lock/crunch-run-image-<hex>.lock`) lets one load while the
 * others wait and then find it on the daemon.
 */
import { createReadStream } from "node:fs";
import { mkdir, stat } from "node:fs/promises";
import http from "node:http";
import path from "node:path";
import { CasApiError } from "../lib/cas/client.ts";
import { type Digest, formatDigest, parseDigest } from "../lib/cas/digest.ts";
import type { Manifest } from "../lib/cas/manifest.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { packFromEntries } from "../lib/tar.ts";
import { formatSize } from "../lib/units.ts";
import type { RunnerSpec } from "./api-client.ts";
import type { CasCache, CasReader, FetchResult } from "./cas-cache.ts";
import { DOCKER_API_VERSION, type DockerClient } from "./docker-api.ts";
import {
  parseLock,
  procStartTime,
  readLockText,
  releaseLock,
  removeDeadLock,
  tryCreateLock,
} from "./lock.ts";

export type StoreImage = NonNullable<RunnerSpec["imageStore"]>;

export interface StoreImageLoaderDeps {
  /** The instance's cache, opened on first use (the supervisor's, shared with dependency staging). */
  cache(): Promise<CasCache>;
  /** The content-addressed store, with the runner's token. */
  cas: CasReader;
  docker: DockerClient;
  /** The attempt's pin (the image's blobs stay in the cache while the attempt runs). */
  pin: { id: string; lockFile: string };
  /** Where the per-image load locks live (`${ROOT}/var/lock`). */
  lockDir: string;
  /** The name the bundle gave its image: the loaded image is tagged with it (unless it is an id or digest). */
  image: string;
  /** A line for the bundle's log. */
  say(line: string): void;
  signal?: AbortSignal;
  /** What a load did, for the bundle's figures and tests. */
  onLoaded?(r: StoreImageLoad): void;
}

export interface StoreImageLoad {
  /** "loaded": this supervisor loaded it; "present": it was on the daemon (another bundle loaded it meanwhile). */
  outcome: "loaded" | "present";
  fetch: FetchResult | null;
  ms: number;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** The Docker Engine API says whether it has the image `ref` (an id or a name). */
async function hasImage(docker: DockerClient, ref: string): Promise<boolean> {
  const res = await docker.call("GET", `/images/${encodeURIComponent(ref)}/json`);
  if (res.status >= 500) {
    throw new DispatchCloudError(
      "crunchrun.docker_error",
      `docker image inspect failed: ${res.status} ${res.body.toString("utf8").slice(0, 300)}`,
    );
  }
  return res.status === 200;
}

const missing = (image: string, why: string) =>
  new DispatchCloudError(
    "crunchrun.image_missing",
    `image ${image} could not be loaded from the store: ${why}`,
  );

/** A tar of a cached tree, read from the cache's blob files. */
function packCachedTree(cache: CasCache, m: Manifest) {
  const entries = m.entries.map((e) => ({
    rel: e.path,
    kind: e.type,
    size: e.type === "file" ? e.digest.size : 0,
    executable: e.type === "file" && e.executable,
    target: e.type === "link" ? e.target : "",
  }));
  const digests = new Map<string, Digest>();
  for (const e of m.entries) if (e.type === "file") digests.set(e.path, e.digest);
  return packFromEntries(entries, async (e) =>
    e.size === 0 ? (async function* () {})() : createReadStream(cache.blobPath(digests.get(e.rel)!)),
  );
}

/** `POST /images/load` with the tar streamed as the body; returns the daemon's error line, or null. */
function dockerLoad(
  docker: DockerClient,
  body: NodeJS.ReadableStream,
  signal?: AbortSignal,
): Promise<string | null> {
  return new Promise((resolve, reject) => {
    const req = http.request({
      socketPath: docker.socketPath,
      method: "POST",
      path: `/${DOCKER_API_VERSION}/images/load?quiet=1`,
      headers: { host: "docker", "content-type": "application/x-tar" },
      ...(signal === undefined ? {} : { signal }),
    });
    req.on("error", reject);
    req.on("response", (res) => {
      const chunks: Buffer[] = [];
      res.on("data", (c: Buffer) => chunks.push(c));
      res.on("error", reject);
      res.on("end", () => {
        const text = Buffer.concat(chunks).toString("utf8");
        if ((res.statusCode ?? 0) >= 300) {
          let msg = text.trim().slice(0, 500);
          try {
            msg = (JSON.parse(text) as { message?: string }).message ?? msg;
          } catch {
            // not JSON
          }
          resolve(`${res.statusCode} ${msg}`);
          return;
        }
        // A stream of JSON lines; a failure is a line with "error".
        for (const line of text.split("\n")) {
          try {
            const rec = JSON.parse(line) as { error?: string; errorDetail?: { message?: string } };
            if (rec.error) {
              resolve(rec.error);
              return;
            }
          } catch {
            // partial or empty line
          }
        }
        resolve(null);
      });
    });
    body.on("error", (err) => req.destroy(err as Error));
    body.pipe(req);
  });
}

/** Repository and tag of a name to tag the loaded image with; null for an id or a digest reference. */
export function tagOf(image: string): { repo: string; tag: string } | null {
  if (image.startsWith("sha256:") || image.includes("@")) return null;
  const slash = image.lastIndexOf("/");
  const colon = image.lastIndexOf(":");
  if (colon > slash) return { repo: image.slice(0, colon), tag: image.slice(colon + 1) };
  return { repo: image, tag: "latest" };
}

async function tagImage(docker: DockerClient, imageId: string, image: string): Promise<void> {
  const t = tagOf(image);
  if (t === null) return;
  const res = await docker.call(
    "POST",
    `/images/${encodeURIComponent(imageId)}/tag?repo=${encodeURIComponent(t.repo)}&tag=${encodeURIComponent(t.tag)}`,
  );
  if (res.status >= 300)
    throw missing(image, `docker could not tag it: ${res.status} ${res.body.toString("utf8").slice(0, 300)}`);
}

/**
 * Takes the per-image load lock, or waits while a live process holds it; `done()` is asked between waits so a
 * waiter stops as soon as the holder's load landed. Returns whether this process took the lock.
 */
async function lockOrWait(
  file: string,
  done: () => Promise<boolean>,
  signal?: AbortSignal,
): Promise<boolean> {
  const me = { uuid: "image-load", pid: process.pid, startTime: procStartTime(process.pid) ?? "" };
  for (let delay = 20; ; delay = Math.min(delay * 2, 500)) {
    if (tryCreateLock(file, me)) return true;
    const text = await readLockText(file).catch(() => null);
    const info = text === null ? null : parseLock(text);
    if (text !== null && info !== null && procStartTime(info.pid) !== info.startTime) {
      await removeDeadLock(file, text);
      continue;
    }
    if (await done()) return false;
    if (signal?.aborted) throw signal.reason ?? new Error("aborted");
    await sleep(delay);
  }
}

/** Makes the `loadFromStore` of crunch-run's prepare step (runtime.ts PrepareContext). */
export function createStoreImageLoader(deps: StoreImageLoaderDeps): (store: StoreImage) => Promise<void> {
  const { docker, image, say } = deps;
  return async (store) => {
    const t0 = performance.now();
    const hex = store.imageId.replace(/^sha256:/, "");
    if (!/^[0-9a-f]{64}$/.test(hex))
      throw missing(image, `the image id ${JSON.stringify(store.imageId)} is malformed`);
    let digest: Digest;
    try {
      digest = parseDigest(store.manifest, "imageStore.manifest");
    } catch (err) {
      throw missing(image, (err as Error).message);
    }
    await mkdir(deps.lockDir, { recursive: true });
    const lock = path.join(deps.lockDir, `crunch-run-image-${hex}.lock`);
    const present = () => hasImage(docker, store.imageId);
    const took = await lockOrWait(lock, present, deps.signal);
    try {
      if (!took || (await present())) {
        await tagImage(docker, store.imageId, image);
        const ms = Math.round(performance.now() - t0);
        say(`image ${image} (${store.imageId.slice(0, 19)}) was loaded by another bundle on this instance`);
        deps.onLoaded?.({ outcome: "present", fetch: null, ms });
        return;
      }
      say(`image ${image} is not on this instance: loading it from the store (${formatSize(store.bytes)})`);
      const cache = await deps.cache();
      let fetched: FetchResult;
      try {
        fetched = await cache.fetchManifest(deps.cas, digest, { pin: deps.pin });
      } catch (err) {
        // Not stored (collected, never uploaded) or damaged: the image cannot be had. A refused token (401: the
        // bundle is no longer this runner's) and transient failures (after the client's retries) go up as they are.
        if (err instanceof DispatchCloudError && err.code.startsWith("cas."))
          throw missing(image, err.message);
        if (err instanceof CasApiError && err.status >= 400 && err.status < 500 && err.status !== 401) {
          throw missing(image, err.message);
        }
        throw err;
      }
      const tFetched = performance.now();
      say(
        `fetched image ${image} (${formatDigest(digest)}): from the instance's cache ${fetched.blobsHit} blobs, ` +
          `fetched ${fetched.blobsFetched} (${formatSize(fetched.bytesFetched)}) in ${Math.round(tFetched - t0)} ms`,
      );
      // Every file the tar is made from must still be in the cache (the pin keeps them from eviction).
      for (const e of fetched.manifest.entries) {
        if (e.type === "file" && e.digest.size > 0) await stat(cache.blobPath(e.digest));
      }
      const why = await dockerLoad(docker, packCachedTree(cache, fetched.manifest), deps.signal);
      if (why !== null) throw missing(image, `docker refused the archive: ${why}`);
      if (!(await present()))
        throw missing(image, `docker loaded the archive but has no image ${store.imageId}`);
      await tagImage(docker, store.imageId, image);
      const ms = Math.round(performance.now() - t0);
      say(
        `loaded image ${image} (${store.imageId.slice(0, 19)}) into Docker from the store: ` +
          `${formatSize(store.bytes)} in ${Math.round(performance.now() - tFetched)} ms (${ms} ms in all)`,
      );
      deps.onLoaded?.({ outcome: "loaded", fetch: fetched, ms });
    } finally {
      if (took) await releaseLock(lock, process.pid);
    }
  };
}
