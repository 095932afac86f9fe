import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../errors.ts";
import { digestBytes, digestOf, EMPTY_DIGEST, formatDigest, parseDigest } from "./digest.ts";
import {
  canonicalManifest,
  type Manifest,
  manifestDigest,
  manifestStats,
  parseManifest,
  subManifest,
  validateManifest,
} from "./manifest.ts";

const D = digestBytes(Buffer.from("hello"));
const fileEntry = (path: string, executable = false) => ({
  path,
  type: "file",
  digest: formatDigest(D),
  executable,
});

function failure(fn: () => unknown): { code: string; path: string | undefined } {
  try {
    fn();
  } catch (err) {
    if (err instanceof DispatchCloudError) return { code: err.code, path: err.path };
    throw err;
  }
  throw new Error("did not fail");
}

describe("digests", () => {
  it("round-trip as <hash>/<size>, and the empty digest is sha256 of nothing", () => {
    expect(digestBytes(new Uint8Array())).toEqual(EMPTY_DIGEST);
    expect(parseDigest(formatDigest(D))).toEqual(D);
  });

  it("refuse upper-case or short hashes, signs, fractions and sizes over the limit, naming the field", () => {
    for (const bad of [
      `${D.hash.toUpperCase()}/5`,
      `${D.hash.slice(1)}/5`,
      `${D.hash}/-1`,
      `${D.hash}/1.5`,
      `${D.hash}/01`,
      `${D.hash}/99999999999999999`,
      `${D.hash}`,
      42,
    ]) {
      expect(failure(() => parseDigest(bad, "digests[3]"))).toEqual({
        code: "cas.invalid_digest",
        path: "digests[3]",
      });
    }
    expect(() => digestOf(D.hash, "5")).not.toThrow();
  });
});

describe("manifests", () => {
  const good = {
    version: 1,
    entries: [{ path: "a", type: "dir" }, fileEntry("a/x", true), { path: "l", type: "link", target: "a/x" }],
  };

  it("have one canonical encoding, which parses back to the same manifest and digest", () => {
    const m = validateManifest(good);
    const bytes = canonicalManifest(m);
    expect(bytes.toString()).toBe(JSON.stringify(good));
    expect(parseManifest(bytes)).toEqual(m);
    expect(manifestDigest(m)).toEqual(digestBytes(bytes));
    expect(manifestStats(m)).toEqual({ files: 1, bytes: 5, blobs: [D] });
  });

  it("refuse bytes that say the same thing in another form", () => {
    expect(failure(() => parseManifest(Buffer.from(JSON.stringify(good, null, 1))))).toMatchObject({
      code: "cas.invalid_manifest",
    });
  });

  it("refuse bad trees with the path of the bad field", () => {
    const cases: [unknown[], string][] = [
      [[fileEntry("a/x")], "manifest.entries[0].path"], // parent missing
      [[fileEntry("b"), fileEntry("a")], "manifest.entries[1].path"], // order
      [[fileEntry("a"), fileEntry("a")], "manifest.entries[1].path"], // duplicate
      [[fileEntry("../x")], "manifest.entries[0].path"],
      [[fileEntry("/x")], "manifest.entries[0].path"],
      [[fileEntry("a//b")], "manifest.entries[0].path"],
      [[{ path: "l", type: "link", target: "../out" }], "manifest.entries[0].target"],
      [[{ path: "l", type: "link", target: "/etc/passwd" }], "manifest.entries[0].target"],
      [[{ path: "l", type: "link", target: "." }, fileEntry("l/x")], "manifest.entries[1].path"],
      [[{ path: "x", type: "fifo" }], "manifest.entries[0].type"],
      [[{ ...fileEntry("x"), digest: "nope" }], "manifest.entries[0].digest"],
      [[{ ...fileEntry("x"), executable: 1 }], "manifest.entries[0].executable"],
      [[{ ...fileEntry("x"), mode: 7 }], "manifest.entries[0].mode"],
    ];
    for (const [entries, path] of cases) {
      const f = failure(() => validateManifest({ version: 1, entries }));
      expect(f.path, JSON.stringify(entries)).toBe(path);
      expect(["cas.invalid_manifest", "cas.invalid_digest"]).toContain(f.code);
    }
    expect(failure(() => validateManifest({ version: 2, entries: [] })).path).toBe("manifest.version");
    expect(
      failure(() => validateManifest({ version: 1, entries: [fileEntry("a"), fileEntry("b")] }, 1)).path,
    ).toBe("manifest.entries");
  });

  it("give a part of the tree re-rooted, without links that leave it", () => {
    const m = validateManifest({
      version: 1,
      entries: [
        { path: "a", type: "dir" },
        { path: "a/in", type: "link", target: "x" },
        { path: "a/out", type: "link", target: "../top" },
        fileEntry("a/x"),
        fileEntry("top"),
      ],
    });
    expect(subManifest(m, "a")?.entries.map((e) => e.path)).toEqual(["in", "x"]);
    expect(subManifest(m, "a/x")?.entries).toEqual([
      { path: "x", type: "file", digest: D, executable: false },
    ]);
    expect(subManifest(m, "b")).toBeNull();
    expect(subManifest(m, "")).toBe(m);
  });

  it("of any tree of names round-trip through their canonical bytes (property)", () => {
    const name = fc.stringMatching(/^[a-zA-Z0-9é._ -]{1,8}$/).filter((n) => n !== "." && n !== "..");
    fc.assert(
      fc.property(
        fc.uniqueArray(fc.array(name, { minLength: 1, maxLength: 3 }), { maxLength: 20 }),
        (paths) => {
          const all = new Map<string, "dir" | "file">();
          for (const p of paths) {
            for (let i = 1; i < p.length; i++) all.set(p.slice(0, i).join("/"), "dir");
          }
          for (const p of paths) if (!all.has(p.join("/"))) all.set(p.join("/"), "file");
          const entries = [...all]
            .sort(([a], [b]) => Buffer.compare(Buffer.from(a), Buffer.from(b)))
            .map(([path, type]) => (type === "dir" ? { path, type } : fileEntry(path)));
          const m: Manifest = validateManifest({ version: 1, entries });
          expect(parseManifest(canonicalManifest(m))).toEqual(m);
        },
      ),
    );
  });
});
