/**
 * Pinning at submit time, the registry's part (docs/images.md "Pinning", "Registries"): an ImageResolver that asks
 * the image's registry for the digest of a tag through the registry v2 API (`HEAD /v2/<repository>/manifests/<tag>`,
 * its `Docker-Content-Digest` header; a GET and the body's sha256 when a registry leaves the header out) and
 * answers `<name>@sha256:<hex>`, so every attempt of the bundle runs the same image.
 *
 * Authentication as the registry asks (its 401's WWW-Authenticate): Basic with containers.registries' credentials
 * (the distribution registry with htpasswd), or Bearer: a token from the challenge's realm for
 * `repository:<repo>:pull`, anonymously or with those credentials (Docker Hub, most hosted registries). Loopback
 * registries are spoken to over plain HTTP (as dockerd does by default), others over HTTPS.
 *
 * No answer (no such tag, refused credentials, an unreachable registry, a timeout) is null: the bundle keeps its
 * reference unpinned, which is not an error. Answers, and the lack of one, are kept for `cacheMs` and concurrent
 * questions about one reference share one request, so a batch of 10,000 bundles naming one image asks once.
 * Credentials are read (resolveSecret) when used and never logged; no message here carries one.
 */
import { createHash } from "node:crypto";
import { resolveSecret } from "../config/secrets.ts";
import { DOCKER_HUB, DOCKER_HUB_API_HOST, isLoopbackRegistry, parseImageRef } from "../lib/image-ref.ts";
import type { Logger } from "../lib/logger.ts";
import type { ImageResolution, ImageResolver } from "./image-resolve.ts";

const MANIFEST_TYPES = [
  "application/vnd.oci.image.index.v1+json",
  "application/vnd.docker.distribution.manifest.list.v2+json",
  "application/vnd.oci.image.manifest.v1+json",
  "application/vnd.docker.distribution.manifest.v2+json",
].join(", ");
const DIGEST = /^sha256:[0-9a-f]{64}$/;

export interface RegistryResolverOptions {
  /** containers.registries: credentials by registry host, passwords as secret references. */
  registries: Readonly<Record<string, { readonly username: string; readonly password: string }>>;
  /**
   * Answer only for images of the registries in `registries` (what `serve` does: an operator's list of registries
   * is also the list asked at submit time; an image elsewhere runs unpinned, and an offline site asks nobody).
   */
  configuredOnly?: boolean;
  /** Reads a secret reference; default config's resolveSecret (file:, env:). */
  readSecret?: (ref: string, key: string) => string;
  /** Milliseconds for one question to the registry, token included; default 5000. */
  timeoutMs?: number;
  /** How long an answer (or the lack of one) is kept; default 30 s. */
  cacheMs?: number;
  fetch?: typeof fetch;
  now?: () => number;
  log?: Logger;
}

export function createRegistryResolver(opts: RegistryResolverOptions): ImageResolver {
  const doFetch = opts.fetch ?? fetch;
  const now = opts.now ?? Date.now;
  const timeoutMs = opts.timeoutMs ?? 5000;
  const cacheMs = opts.cacheMs ?? 30_000;
  const readSecret = opts.readSecret ?? ((ref: string, key: string) => resolveSecret(ref, key));
  const cache = new Map<string, { at: number; answer: Promise<ImageResolution | null> }>();

  const credentials = (registry: string): { username: string; password: string } | null => {
    const entry = opts.registries[registry];
    if (entry === undefined) return null;
    try {
      return {
        username: entry.username,
        password: readSecret(entry.password, `containers.registries.${registry}.password`),
      };
    } catch (err) {
      opts.log?.warn({ registry, err: (err as Error).message }, "registry credentials cannot be read");
      return null;
    }
  };

  const ask = async (ref: string): Promise<ImageResolution | null> => {
    const parsed = parseImageRef(ref);
    if (parsed === null) return null;
    // A digest is already immutable.
    if (parsed.digest !== null) return { pinned: `${parsed.name}@${parsed.digest}`, store: null };
    if (opts.configuredOnly === true && opts.registries[parsed.registry] === undefined) return null;
    const host = parsed.registry === DOCKER_HUB ? DOCKER_HUB_API_HOST : parsed.registry;
    const scheme = isLoopbackRegistry(parsed.registry) ? "http" : "https";
    const url = `${scheme}://${host}/v2/${parsed.repository}/manifests/${parsed.tag ?? "latest"}`;
    const signal = AbortSignal.timeout(timeoutMs);
    const creds = credentials(parsed.registry);
    const request = (method: "HEAD" | "GET", authorization?: string) =>
      doFetch(url, {
        method,
        headers: { accept: MANIFEST_TYPES, ...(authorization === undefined ? {} : { authorization }) },
        signal,
        redirect: "follow",
      });
    try {
      let authorization: string | undefined;
      let res = await request("HEAD");
      if (res.status === 401) {
        authorization = await answerChallenge(
          res.headers.get("www-authenticate") ?? "",
          parsed.repository,
          creds,
          doFetch,
          signal,
        );
        if (authorization === undefined) return null;
        res = await request("HEAD", authorization);
      }
      if (res.status !== 200) {
        opts.log?.debug({ image: ref, status: res.status }, "the registry did not pin the image");
        return null;
      }
      let digest = res.headers.get("docker-content-digest");
      if (digest === null || !DIGEST.test(digest)) {
        const body = await request("GET", authorization);
        if (body.status !== 200) return null;
        digest = `sha256:${createHash("sha256")
          .update(Buffer.from(await body.arrayBuffer()))
          .digest("hex")}`;
      }
      return { pinned: `${parsed.name}@${digest}`, store: null };
    } catch (err) {
      opts.log?.debug({ image: ref, err: (err as Error).message }, "the registry could not be asked");
      return null;
    }
  };

  return (ref: string) => {
    const t = now();
    const hit = cache.get(ref);
    if (hit !== undefined && t - hit.at < cacheMs) return hit.answer;
    if (cache.size > 10_000) {
      for (const [k, v] of cache) if (t - v.at >= cacheMs) cache.delete(k);
    }
    const answer = ask(ref);
    cache.set(ref, { at: t, answer });
    return answer;
  };
}

/**
 * The Authorization header that answers a registry's 401 challenge, or undefined when it cannot be answered
 * (Basic without configured credentials, a token the realm refuses).
 */
async function answerChallenge(
  challenge: string,
  repository: string,
  creds: { username: string; password: string } | null,
  doFetch: typeof fetch,
  signal: AbortSignal,
): Promise<string | undefined> {
  const basic =
    creds === null
      ? undefined
      : `Basic ${Buffer.from(`${creds.username}:${creds.password}`, "utf8").toString("base64")}`;
  const scheme = challenge.trim().split(/\s+/, 1)[0]?.toLowerCase();
  if (scheme === "basic") return basic;
  if (scheme !== "bearer") return undefined;
  const params = Object.fromEntries(
    [...challenge.matchAll(/([a-zA-Z_]+)="([^"]*)"/g)].map((m) => [m[1]?.toLowerCase(), m[2]]),
  ) as Record<string, string | undefined>;
  const realm = params["realm"];
  if (realm === undefined) return undefined;
  const tokenUrl = new URL(realm);
  if (params["service"] !== undefined) tokenUrl.searchParams.set("service", params["service"]);
  tokenUrl.searchParams.set("scope", params["scope"] ?? `repository:${repository}:pull`);
  const res = await doFetch(tokenUrl, {
    headers: basic === undefined ? {} : { authorization: basic },
    signal,
  });
  if (res.status !== 200) return undefined;
  const body = (await res.json()) as { token?: unknown; access_token?: unknown };
  const token = typeof body.token === "string" ? body.token : body.access_token;
  return typeof token === "string" && token !== "" ? `Bearer ${token}` : undefined;
}
