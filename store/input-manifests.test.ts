import { describe, expect, it } from "vitest";
import { MAX_INPUT_MANIFESTS, readInputManifests } from "./input-manifests.ts";

const D = `${"c".repeat(64)}/12`;

describe("readInputManifests", () => {
  it("keeps valid entries once each, and reads nothing from a missing or empty value", () => {
    expect(
      readInputManifests([
        { digest: D, bytes: 3 },
        { digest: D, bytes: 3 },
      ]),
    ).toEqual({
      manifests: [{ digest: D, bytes: 3 }],
      problem: null,
    });
    for (const none of [undefined, null, []])
      expect(readInputManifests(none)).toEqual({ manifests: [], problem: null });
  });

  it("turns bad contents into no inputs with the reason, never an exception", () => {
    const cases: [unknown, string][] = [
      [{}, "not a JSON array"],
      ["x", "not a JSON array"],
      [[1], "[0] is not an object"],
      [
        [
          { digest: D, bytes: 1 },
          { digest: "x/1", bytes: 1 },
        ],
        "[1].digest: ",
      ],
      [[{ digest: D }], "[0].bytes: must be a whole number of bytes"],
      [[{ digest: D, bytes: -1 }], "[0].bytes"],
      [[{ digest: D, bytes: 1.5 }], "[0].bytes"],
      [[{ digest: `${"C".repeat(64)}/1`, bytes: 1 }], "[0].digest"],
      [
        Array.from({ length: MAX_INPUT_MANIFESTS + 1 }, () => ({ digest: D, bytes: 1 })),
        "more than 1000 entries",
      ],
    ];
    for (const [raw, why] of cases) {
      const r = readInputManifests(raw);
      expect(r.manifests).toEqual([]);
      expect(r.problem).toContain(`input_manifests ignored: ${why}`);
    }
  });
});
