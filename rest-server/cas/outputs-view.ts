/**
 * A bundle's outputs kept as a manifest of the content-addressed store, seen the way the outputs routes see
 * outputs on disk (rest-server/outputs.ts): a file by its path (links inside the tree followed, loops and
 * dangling links name nothing), the paged recursive listing of a directory (files and links, paths from the
 * root, in UTF-16 code-unit order, exactly like outputs-listing.ts), and a tar archive of a part of the tree (the
 * dependency route of older runners).
 */
import { Readable } from "node:stream";
import type { Digest } from "../../lib/cas/digest.ts";
import { type Manifest, type ManifestEntry, subManifest } from "../../lib/cas/manifest.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import { packFromEntries } from "../../lib/tar.ts";
import type { OutputEntry, OutputFile } from "../outputs.ts";
import type { OutputPage } from "../outputs-listing.ts";

/** Links followed while resolving one path before it counts as a loop (as Linux's ELOOP). */
const MAX_LINK_HOPS = 40;

export interface ManifestOutputs {
  get(rel: string, page?: OutputPage): OutputEntry;
  pack(rel: string): Readable | null;
}

/** Reads a blob's bytes; null when the store does not have it. */
export type BlobReader = (d: Digest) => Promise<AsyncIterable<Uint8Array> | null>;

export function manifestOutputs(uuid: string, manifest: Manifest, read: BlobReader): ManifestOutputs {
  const byPath = new Map<string, ManifestEntry>();
  for (const e of manifest.entries) byPath.set(e.path, e);
  let listed: OutputFile[] | undefined;
  /** Every file and link, in the listing's order (built on first use). */
  const listing = (): OutputFile[] => {
    if (listed !== undefined) return listed;
    const out: OutputFile[] = [];
    for (const e of manifest.entries) {
      if (e.type === "file") out.push({ path: e.path, size: e.digest.size });
      else if (e.type === "link") out.push({ path: e.path, size: 0, link: e.target });
    }
    out.sort((a, b) => (a.path < b.path ? -1 : a.path > b.path ? 1 : 0));
    listed = out;
    return out;
  };

  /** The real path (no links on the way) that `rel` names, "" for the root, or null when it names nothing. */
  const resolve = (rel: string): string | null => {
    let pending = rel === "" ? [] : rel.split("/");
    let hops = 0;
    const done: string[] = [];
    while (pending.length > 0) {
      const name = pending[0] as string;
      pending = pending.slice(1);
      const p = [...done, name].join("/");
      const e = byPath.get(p);
      if (e === undefined) return null;
      if (e.type !== "link") {
        if (e.type === "file" && pending.length > 0) return null;
        done.push(name);
        continue;
      }
      if (++hops > MAX_LINK_HOPS) return null;
      // The target is relative to the link's directory (`done`); start again from the root with it in front.
      const parts = [...done];
      for (const t of e.target.split("/")) {
        if (t === "" || t === ".") continue;
        if (t === "..") {
          if (parts.length === 0) return null;
          parts.pop();
        } else parts.push(t);
      }
      pending = [...parts, ...pending];
      done.length = 0;
    }
    return done.join("/");
  };

  const missing = (rel: string) =>
    new DispatchCloudError("output.not_found", `bundle ${uuid} has no output ${JSON.stringify(rel)}`, {
      path: "path",
    });

  const openBlob = (d: Digest, shown: string): AsyncIterable<Uint8Array> => {
    async function* bytes(): AsyncGenerator<Uint8Array> {
      if (d.size === 0) return;
      const src = await read(d);
      if (src === null) {
        throw new DispatchCloudError(
          "cas.not_found",
          `the store has lost the blob of output ${JSON.stringify(shown)}`,
        );
      }
      yield* src;
    }
    return bytes();
  };

  return {
    get(rel, page = { after: null, limit: Number.POSITIVE_INFINITY }) {
      const real = resolve(rel);
      if (real === null) throw missing(rel);
      const e = real === "" ? undefined : byPath.get(real);
      if (e?.type === "file") {
        const d = e.digest;
        return { kind: "file", path: rel, size: d.size, open: () => Readable.from(openBlob(d, rel)) };
      }
      const prefix = real === "" ? "" : `${real}/`;
      const files: OutputFile[] = [];
      if (page.limit > 0) {
        for (const f of listing()) {
          if (!f.path.startsWith(prefix)) continue;
          if (page.after !== null && f.path <= page.after) continue;
          files.push(f);
          if (files.length >= page.limit) break;
        }
      }
      return { kind: "dir", files };
    },

    pack(rel) {
      const real = resolve(rel);
      if (real === null) return null;
      const part = subManifest(manifest, real);
      if (part === null) return null;
      const entries = part.entries.map((e) => ({
        rel: e.path,
        kind: e.type,
        size: e.type === "file" ? e.digest.size : 0,
        executable: e.type === "file" && e.executable,
        target: e.type === "link" ? e.target : "",
      }));
      const digests = new Map(part.entries.map((e) => [e.path, e.type === "file" ? e.digest : undefined]));
      return packFromEntries(entries, async (e) => openBlob(digests.get(e.rel) as Digest, e.rel));
    },
  };
}
