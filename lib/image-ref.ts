/**
 * Container image references as Docker reads them (`[registry/]repository[:tag][@digest]`): which registry an
 * image comes from, which repository and tag or digest it names. The dispatcher uses it to pick the one
 * registry's credentials for a bundle's start document, crunch-run to name the pull, and the REST server's
 * registry resolver to ask the registry's v2 API for a tag's digest.
 *
 * Docker's rule for the registry: the first `/`-separated component is a registry host when it holds a `.` or a
 * `:` or is `localhost`; otherwise the image is on Docker Hub (`docker.io`), where a one-component repository
 * is `library/<name>`.
 */

export const DOCKER_HUB = "docker.io";
/** The host Docker Hub's registry API answers on. */
export const DOCKER_HUB_API_HOST = "registry-1.docker.io";

export interface ImageRef {
  /** The registry host as references name it (`docker.io` for Docker Hub, `127.0.0.1:5000`, ...). */
  registry: string;
  /** The repository path within the registry (`library/busybox` on Docker Hub). */
  repository: string;
  /** The tag; null when the reference names none (a digest, or Docker's implied `latest`). */
  tag: string | null;
  /** `sha256:<hex>` when the reference names a digest, else null. */
  digest: string | null;
  /** The reference as written, without tag and digest (`busybox`, `127.0.0.1:5000/x/y`). */
  name: string;
}

const COMPONENT = /^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$/;
const TAG = /^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$/;
const DIGEST = /^sha256:[0-9a-f]{64}$/;
const HOST = /^[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]{1,5})?$/;

/** Parses an image reference; null when Docker would refuse it (bad characters, upper-case repository, ...). */
export function parseImageRef(ref: string): ImageRef | null {
  if (ref.length === 0 || ref.length > 1024) return null;
  let rest = ref;
  let digest: string | null = null;
  const at = rest.indexOf("@");
  if (at >= 0) {
    digest = rest.slice(at + 1);
    rest = rest.slice(0, at);
    if (!DIGEST.test(digest)) return null;
  }
  let tag: string | null = null;
  const colon = rest.lastIndexOf(":");
  if (colon > rest.lastIndexOf("/")) {
    tag = rest.slice(colon + 1);
    rest = rest.slice(0, colon);
    if (!TAG.test(tag)) return null;
  }
  const name = rest;
  const slash = rest.indexOf("/");
  let registry = DOCKER_HUB;
  let path = rest;
  if (slash >= 0) {
    const first = rest.slice(0, slash);
    if (first.includes(".") || first.includes(":") || first === "localhost") {
      if (!HOST.test(first)) return null;
      registry = first === "index.docker.io" ? DOCKER_HUB : first;
      path = rest.slice(slash + 1);
    }
  }
  const components = path.split("/");
  if (!components.every((c) => COMPONENT.test(c))) return null;
  const repository = registry === DOCKER_HUB && components.length === 1 ? `library/${path}` : path;
  return { registry, repository, tag, digest, name };
}

/** The registry an image reference names (`docker.io` when it names none); null for an unusable reference. */
export function registryOf(ref: string): string | null {
  return parseImageRef(ref)?.registry ?? null;
}

/**
 * Whether a registry host is on loopback (127.0.0.0/8, localhost, ::1). Docker reaches those over plain HTTP
 * without being told to (its default insecure registry range), and so does the registry resolver.
 */
export function isLoopbackRegistry(host: string): boolean {
  const h = host.replace(/:[0-9]+$/, "");
  return h === "localhost" || /^127\.[0-9]+\.[0-9]+\.[0-9]+$/.test(h) || h === "[::1]";
}
