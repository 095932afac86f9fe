/**
 * The outputs listing one page at a time. Files are listed in path order (UTF-16 code-unit order, as JS compares
 * strings) after a cursor path; the walk visits each directory's entries in that same order (a directory sorts as
 * its name plus `/`) and skips every subtree that lies wholly before the cursor, so a page reads the directories
 * on its way and stops once it has its files, instead of walking and sorting the whole tree each time.
 *
 * Also the listing's query string (`limit`, `cursor`) and its opaque cursor.
 */
import { lstat, readdir, readlink } from "node:fs/promises";
import path from "node:path";
import { DispatchCloudError } from "../lib/errors.ts";

export const DEFAULT_OUTPUT_PAGE = 1000;
export const MAX_OUTPUT_PAGE = 10_000;

/** A file of a listing (outputs.ts's OutputFile). */
export interface ListedFile {
  /** Path relative to the listed tree's root, `/`-separated. */
  path: string;
  size: number;
  /** A symbolic link (inside the outputs, as uploads are checked to be): its target, relative to its directory. */
  link?: string;
}

export interface OutputPage {
  /** List only files whose path sorts after this one (null: from the first). */
  after: string | null;
  /** At most this many files. */
  limit: number;
}

/**
 * The files under `rel` (a directory, "" = the root) of the tree at `root`, as paths from `root`, in path order:
 * those after `page.after`, at most `page.limit` of them.
 */
export async function listFilesPage(root: string, rel: string, page: OutputPage): Promise<ListedFile[]> {
  const { after, limit } = page;
  const out: ListedFile[] = [];
  if (limit <= 0) return out;
  /** Walks one directory; true once the page is full. */
  const walk = async (dirRel: string): Promise<boolean> => {
    const entries = await readdir(dirRel === "" ? root : path.join(root, dirRel), { withFileTypes: true });
    const items: { path: string; key: string; dir: boolean }[] = [];
    for (const d of entries) {
      // Nothing else can be there (extractTar writes files, directories and links only); links are listed, not
      // followed.
      if (!d.isDirectory() && !d.isFile() && !d.isSymbolicLink()) continue;
      const p = dirRel === "" ? d.name : `${dirRel}/${d.name}`;
      items.push({ path: p, key: d.isDirectory() ? `${p}/` : p, dir: d.isDirectory() });
    }
    items.sort((a, b) => (a.key < b.key ? -1 : a.key > b.key ? 1 : 0));
    for (const item of items) {
      if (item.dir) {
        // Every path under the directory starts with its key: all of them sort before the cursor when the key
        // does and the cursor is not itself under the directory.
        if (after !== null && item.key < after && !after.startsWith(item.key)) continue;
        if (await walk(item.path)) return true;
      } else {
        if (after !== null && item.path <= after) continue;
        const full = path.join(root, item.path);
        const st = await lstat(full);
        out.push(
          st.isSymbolicLink()
            ? { path: item.path, size: 0, link: await readlink(full) }
            : { path: item.path, size: st.size },
        );
        if (out.length >= limit) return true;
      }
    }
    return false;
  };
  await walk(rel);
  return out;
}

const badQuery = (param: string, message: string) =>
  new DispatchCloudError("request.invalid_query", `${param}: ${message}`, { path: param });

/** The cursor is opaque to clients: base64url of `{"after": <the last path of the page>}`. */
export function encodeOutputCursor(after: string): string {
  return Buffer.from(JSON.stringify({ after }), "utf8").toString("base64url");
}

export function decodeOutputCursor(text: string): string {
  const bad = () => badQuery("cursor", "not a cursor returned by this API");
  if (text.length > 8192 || !/^[A-Za-z0-9_-]+$/.test(text)) throw bad();
  let parsed: unknown;
  try {
    parsed = JSON.parse(Buffer.from(text, "base64url").toString("utf8"));
  } catch {
    throw bad();
  }
  const after = (parsed as { after?: unknown } | null)?.after;
  // Only ever compared with listed paths, never opened: a non-empty string without NUL is enough.
  if (typeof after !== "string" || after === "" || after.length > 4096 || after.includes("\0")) throw bad();
  return after;
}

/** `?limit=N&cursor=C` of an outputs listing; anything else is refused. */
export function parseOutputListQuery(query: unknown): OutputPage {
  const page: OutputPage = { after: null, limit: DEFAULT_OUTPUT_PAGE };
  for (const [key, raw] of Object.entries((query ?? {}) as Record<string, unknown>)) {
    if (Array.isArray(raw)) throw badQuery(key, "must be given once");
    const value = String(raw);
    if (key === "limit") {
      if (!/^[0-9]{1,5}$/.test(value) || Number(value) < 1 || Number(value) > MAX_OUTPUT_PAGE) {
        throw badQuery("limit", `must be a whole number from 1 to ${MAX_OUTPUT_PAGE}`);
      }
      page.limit = Number(value);
    } else if (key === "cursor") {
      page.after = value === "" ? null : decodeOutputCursor(value);
    } else {
      throw badQuery(key, "unknown query parameter; known: limit, cursor");
    }
  }
  return page;
}
