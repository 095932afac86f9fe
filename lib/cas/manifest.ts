/**
 * Manifests: a tree of files as one canonical JSON blob of the content-addressed store (docs/storage.md).
 *
 *   {"version":1,"entries":[{"path":"a","type":"dir"},
 *                           {"path":"a/x","type":"file","digest":"<sha256>/<size>","executable":false},
 *                           {"path":"l","type":"link","target":"a/x"}]}
 *
 * Entries are sorted by the UTF-8 bytes of their paths; every parent directory is an entry of its own (so empty
 * directories travel); nothing lies below a link; a link's target is relative and stays inside the tree. The bytes
 * are canonical: keys in the order above, no spaces, so one tree has exactly one manifest and one digest. The
 * server refuses a manifest whose bytes are not the canonical form of what they say (`cas.invalid_manifest`).
 */
import { DispatchCloudError } from "../errors.ts";
import { linkInside } from "../tar.ts";
import { pathLengthProblem } from "../text-limits.ts";
import { type Digest, digestBytes, formatDigest, parseDigest } from "./digest.ts";

export type ManifestEntry =
  | { path: string; type: "dir" }
  | { path: string; type: "file"; digest: Digest; executable: boolean }
  | { path: string; type: "link"; target: string };

export interface Manifest {
  version: 1;
  entries: ManifestEntry[];
}

/** Most entries of one manifest (what a bundle's outputs may hold is restServer.maxOutputFiles, lower). */
export const MAX_MANIFEST_ENTRIES = 1_000_000;

const bad = (why: string, field = "manifest") =>
  new DispatchCloudError("cas.invalid_manifest", `${field}: ${why}`, { path: field });

/** Byte order of the paths' UTF-8, which is what `sort` on Buffers gives. */
export function comparePaths(a: string, b: string): number {
  return Buffer.compare(Buffer.from(a), Buffer.from(b));
}

/** The canonical bytes of a manifest (entries must already be in order; `validateManifest` checks). */
export function canonicalManifest(m: Manifest): Buffer {
  const parts = m.entries.map((e) => {
    const p = JSON.stringify(e.path);
    if (e.type === "dir") return `{"path":${p},"type":"dir"}`;
    if (e.type === "link") return `{"path":${p},"type":"link","target":${JSON.stringify(e.target)}}`;
    return `{"path":${p},"type":"file","digest":"${formatDigest(e.digest)}","executable":${e.executable}}`;
  });
  return Buffer.from(`{"version":1,"entries":[${parts.join(",")}]}`);
}

export function manifestDigest(m: Manifest): Digest {
  return digestBytes(canonicalManifest(m));
}

/** Files, their bytes, and the distinct blobs a manifest names. */
export function manifestStats(m: Manifest): { files: number; bytes: number; blobs: Digest[] } {
  const seen = new Map<string, Digest>();
  let files = 0;
  let bytes = 0;
  for (const e of m.entries) {
    if (e.type !== "file") continue;
    files++;
    bytes += e.digest.size;
    seen.set(e.digest.hash, e.digest);
  }
  return { files, bytes, blobs: [...seen.values()] };
}

function checkPath(p: unknown, field: string): string {
  if (typeof p !== "string" || p === "") throw bad("must be a non-empty relative path", field);
  if (p.includes("\0")) throw bad("must not contain NUL characters", field);
  if (p.startsWith("/")) throw bad("must be relative (no leading /)", field);
  const names = p.split("/");
  for (const n of names) {
    if (n === "" || n === "." || n === "..")
      throw bad(`must not contain ${JSON.stringify(n)} as a name`, field);
  }
  const tooLong = pathLengthProblem(names);
  if (tooLong !== undefined) throw bad(tooLong, field);
  return p;
}

/**
 * Checks a parsed manifest's shape and rules (order, parents, links inside, no duplicates) and returns it typed.
 * Errors are `cas.invalid_manifest` with the path of the bad field (`manifest.entries[3].target`).
 */
export function validateManifest(value: unknown, maxEntries = MAX_MANIFEST_ENTRIES): Manifest {
  if (typeof value !== "object" || value === null || Array.isArray(value)) throw bad("must be a JSON object");
  const v = value as Record<string, unknown>;
  for (const k of Object.keys(v))
    if (k !== "version" && k !== "entries") throw bad(`unknown field ${JSON.stringify(k)}`, `manifest.${k}`);
  if (v.version !== 1) throw bad("must be 1", "manifest.version");
  if (!Array.isArray(v.entries)) throw bad("must be an array", "manifest.entries");
  if (v.entries.length > maxEntries) throw bad(`has more than ${maxEntries} entries`, "manifest.entries");
  const kinds = new Map<string, ManifestEntry["type"]>();
  const entries: ManifestEntry[] = [];
  let prev: string | undefined;
  for (const [i, raw] of v.entries.entries()) {
    const field = `manifest.entries[${i}]`;
    if (typeof raw !== "object" || raw === null || Array.isArray(raw)) throw bad("must be an object", field);
    const e = raw as Record<string, unknown>;
    const p = checkPath(e.path, `${field}.path`);
    if (prev !== undefined && comparePaths(prev, p) >= 0) {
      throw bad("entries must be sorted by path with no duplicates", `${field}.path`);
    }
    prev = p;
    const slash = p.lastIndexOf("/");
    if (slash >= 0) {
      const parent = p.slice(0, slash);
      const kind = kinds.get(parent);
      if (kind === "link") throw bad(`lies below the link ${JSON.stringify(parent)}`, `${field}.path`);
      if (kind !== "dir")
        throw bad(`its directory ${JSON.stringify(parent)} is not an entry before it`, `${field}.path`);
    }
    const allowed = (keys: string[]) => {
      for (const k of Object.keys(e))
        if (!keys.includes(k)) throw bad(`unknown field ${JSON.stringify(k)}`, `${field}.${k}`);
    };
    if (e.type === "dir") {
      allowed(["path", "type"]);
      entries.push({ path: p, type: "dir" });
    } else if (e.type === "file") {
      allowed(["path", "type", "digest", "executable"]);
      const digest = parseDigest(e.digest, `${field}.digest`);
      if (typeof e.executable !== "boolean") throw bad("must be true or false", `${field}.executable`);
      entries.push({ path: p, type: "file", digest, executable: e.executable });
    } else if (e.type === "link") {
      allowed(["path", "type", "target"]);
      if (typeof e.target !== "string" || e.target.startsWith("/")) {
        throw bad("must be a relative path", `${field}.target`);
      }
      const inside = linkInside(p, e.target);
      if (inside === null || inside !== e.target) {
        throw bad("must be a normalised relative path that stays inside the tree", `${field}.target`);
      }
      entries.push({ path: p, type: "link", target: e.target });
    } else {
      throw bad('must be "dir", "file" or "link"', `${field}.type`);
    }
    kinds.set(p, (entries.at(-1) as ManifestEntry).type);
  }
  return { version: 1, entries };
}

/** Parses and validates manifest bytes, which must be canonical (the one encoding of what they say). */
export function parseManifest(bytes: Uint8Array, maxEntries = MAX_MANIFEST_ENTRIES): Manifest {
  let value: unknown;
  try {
    value = JSON.parse(Buffer.from(bytes).toString("utf8"));
  } catch {
    throw bad("is not valid JSON");
  }
  const m = validateManifest(value, maxEntries);
  if (!Buffer.from(bytes).equals(canonicalManifest(m))) {
    throw bad("is not in canonical form (keys in order, no spaces; see docs/storage.md)");
  }
  return m;
}

/**
 * The part of a tree below `subpath` ("" = all of it), re-rooted there: a directory's contents, or a file alone
 * under its base name. Links that would leave the part are left out. Null when `subpath` names nothing.
 */
export function subManifest(m: Manifest, subpath: string): Manifest | null {
  if (subpath === "") return m;
  const at = m.entries.find((e) => e.path === subpath);
  if (at === undefined) return null;
  if (at.type === "file")
    return { version: 1, entries: [{ ...at, path: subpath.slice(subpath.lastIndexOf("/") + 1) }] };
  if (at.type === "link") return null;
  const prefix = `${subpath}/`;
  const entries: ManifestEntry[] = [];
  for (const e of m.entries) {
    if (!e.path.startsWith(prefix)) continue;
    const rel = e.path.slice(prefix.length);
    if (e.type === "link") {
      const target = linkInside(rel, e.target);
      if (target === null) continue;
      entries.push({ ...e, path: rel, target });
    } else entries.push({ ...e, path: rel });
  }
  return { version: 1, entries };
}
