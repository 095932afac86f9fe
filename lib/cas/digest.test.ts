import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../errors.ts";
import { formatDigest, MAX_BLOB_SIZE, parseDigest, parseDigestList } from "./digest.ts";

const REFERENCE = /^([0-9a-f]{64})\/(0|[1-9][0-9]{0,15})$/;
const H = "ab".repeat(32);

/** What a digest text must be, said once more without the fast path's character loop. */
const valid = (t: string): boolean => {
  const m = REFERENCE.exec(t);
  return m !== null && Number(m[2]) <= MAX_BLOB_SIZE;
};

const errorOf = (f: () => unknown): DispatchCloudError => {
  try {
    f();
  } catch (err) {
    if (err instanceof DispatchCloudError) return err;
    throw err;
  }
  throw new Error("did not throw");
};

describe("parseDigest", () => {
  it("round-trips every well-formed digest", () => {
    fc.assert(
      fc.property(
        fc.stringMatching(/^[0-9a-f]{64}$/),
        fc.integer({ min: 0, max: MAX_BLOB_SIZE }),
        (hash, size) => {
          expect(parseDigest(formatDigest({ hash, size }))).toEqual({ hash, size });
        },
      ),
    );
  });

  it("accepts exactly what the reference pattern accepts", () => {
    const near = fc.oneof(
      fc.string({ maxLength: 90 }),
      fc
        .tuple(fc.stringMatching(/^[0-9a-fA-F]{62,66}$/), fc.stringMatching(/^[0-9]{0,18}$/))
        .map(([h, s]) => `${h}/${s}`),
      fc.stringMatching(/^[0-9]{0,18}$/).map((s) => `${H}/${s}`),
    );
    fc.assert(
      fc.property(near, (t) => {
        if (valid(t)) expect(formatDigest(parseDigest(t))).toBe(t);
        else expect(errorOf(() => parseDigest(t, "digests/0")).code).toBe("cas.invalid_digest");
      }),
      { numRuns: 2000 },
    );
  });

  it("refuses the near misses, naming the field", () => {
    for (const t of [
      `${H.toUpperCase()}/1`,
      `${H}/01`,
      `${H}/`,
      `${H.slice(1)}/1`,
      `${H}/1 `,
      `${H}/${2 ** 40 + 1}`,
      `${H.slice(0, 63)}é/1`,
    ]) {
      const e = errorOf(() => parseDigest(t, "x.digest"));
      expect(e.code, t).toBe("cas.invalid_digest");
      expect(e.path, t).toBe("x.digest");
    }
  });

  it("parseDigestList names the bad element's index", () => {
    expect(parseDigestList([`${H}/1`, `${H}/0`], "digests")).toEqual([
      { hash: H, size: 1 },
      { hash: H, size: 0 },
    ]);
    expect(errorOf(() => parseDigestList([`${H}/1`, `${H}/1`, 7], "digests")).path).toBe("digests/2");
    expect(errorOf(() => parseDigestList([`${H}/x`], "missing")).path).toBe("missing/0");
  });
});
