import { mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import fc from "fast-check";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  decodeOutputCursor,
  encodeOutputCursor,
  listFilesPage,
  MAX_OUTPUT_PAGE,
  parseOutputListQuery,
} from "./outputs-listing.ts";

/** Names made of characters that sort just below, at and above "/" (0x2f), so directories interleave with files. */
const name = fc.stringMatching(/^[-. 0a/~]{1,3}$/).filter((n) => !n.includes("/") && n !== "." && n !== "..");

/** File paths of 1..3 names such that no file is also a directory of another path. */
const tree = fc
  .array(fc.array(name, { minLength: 1, maxLength: 3 }), { minLength: 1, maxLength: 25 })
  .map((paths) => {
    const files = new Set<string>();
    const dirs = new Set<string>();
    for (const parts of paths) {
      const prefixes = parts.slice(0, -1).map((_, i) => parts.slice(0, i + 1).join("/"));
      const p = parts.join("/");
      if (dirs.has(p) || files.has(p) || prefixes.some((d) => files.has(d))) continue;
      files.add(p);
      for (const d of prefixes) dirs.add(d);
    }
    return [...files];
  });

describe("listFilesPage", () => {
  let scratch: string;
  beforeAll(async () => {
    scratch = await mkdtemp(path.join(tmpdir(), "dc-listing-"));
  });
  afterAll(async () => {
    if (scratch) await rm(scratch, { recursive: true, force: true });
  });

  it("lists the files after any cursor in path order, at most limit of them, as a sort of all paths would", async () => {
    let n = 0;
    await fc.assert(
      fc.asyncProperty(
        tree,
        fc.option(fc.stringMatching(/^[-. 0a/~]{1,7}$/)),
        fc.integer({ min: 1, max: 30 }),
        async (files, after, limit) => {
          const root = path.join(scratch, `t${n++}`);
          for (const f of files) {
            await mkdir(path.dirname(path.join(root, f)), { recursive: true });
            await writeFile(path.join(root, f), f);
          }
          const all = [...files].sort();
          const expected = all.filter((p) => after === null || p > after).slice(0, limit);
          const got = await listFilesPage(root, "", { after, limit });
          expect(got.map((f) => f.path)).toEqual(expected);
          expect(got.map((f) => f.size)).toEqual(expected.map((p) => Buffer.byteLength(p)));
          // Page after page, from the start, gives every file once.
          const paged: string[] = [];
          let cursor: string | null = null;
          for (;;) {
            const page = await listFilesPage(root, "", { after: cursor, limit });
            paged.push(...page.map((f) => f.path));
            if (page.length < limit) break;
            cursor = page[page.length - 1]!.path;
          }
          expect(paged).toEqual(all);
        },
      ),
      { numRuns: 60 },
    );
  });

  it("lists a sub-directory with paths from the root", async () => {
    const root = path.join(scratch, "sub");
    for (const f of ["d/x", "d/y/z", "d.txt", "e"]) {
      await mkdir(path.dirname(path.join(root, f)), { recursive: true });
      await writeFile(path.join(root, f), "1");
    }
    expect(await listFilesPage(root, "d", { after: null, limit: 10 })).toEqual([
      { path: "d/x", size: 1 },
      { path: "d/y/z", size: 1 },
    ]);
    expect(await listFilesPage(root, "d", { after: "d/x", limit: 10 })).toEqual([{ path: "d/y/z", size: 1 }]);
  });
});

describe("outputs listing query", () => {
  it("round-trips the cursor and refuses what it did not make", () => {
    for (const p of ["a", "a/b c/ü.txt", "x".repeat(4096)])
      expect(decodeOutputCursor(encodeOutputCursor(p))).toBe(p);
    const bad = [
      "",
      "***",
      Buffer.from("[]").toString("base64url"),
      Buffer.from('{"after":1}').toString("base64url"),
      Buffer.from('{"after":"a\\u0000"}').toString("base64url"),
      encodeOutputCursor("x".repeat(4097)),
    ];
    for (const text of bad) {
      expect(() => decodeOutputCursor(text), text).toThrow(
        expect.objectContaining({ code: "request.invalid_query", path: "cursor" }),
      );
    }
  });

  it("takes limit and cursor, with defaults, and nothing else", () => {
    expect(parseOutputListQuery({})).toEqual({ after: null, limit: 1000 });
    expect(parseOutputListQuery({ limit: "5", cursor: encodeOutputCursor("a/b") })).toEqual({
      after: "a/b",
      limit: 5,
    });
    expect(parseOutputListQuery({ limit: String(MAX_OUTPUT_PAGE), cursor: "" })).toEqual({
      after: null,
      limit: MAX_OUTPUT_PAGE,
    });
    for (const [query, where] of [
      [{ limit: "0" }, "limit"],
      [{ limit: "-1" }, "limit"],
      [{ limit: "1e3" }, "limit"],
      [{ limit: ["1", "2"] }, "limit"],
      [{ offset: "3" }, "offset"],
    ] as const) {
      expect(() => parseOutputListQuery(query)).toThrow(
        expect.objectContaining({ code: "request.invalid_query", path: where }),
      );
    }
  });
});
