import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { savedImageId } from "./images.ts";

describe("savedImageId", () => {
  const dir = mkdtempSync(join(tmpdir(), "saved-id-"));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));
  const hex = "0123456789abcdef".repeat(4);
  const withIndex = (index: unknown) => {
    writeFileSync(join(dir, "manifest.json"), JSON.stringify(index));
    return savedImageId(dir);
  };

  it("reads the config's name in docker's own layout and in the OCI layout", async () => {
    await expect(withIndex([{ Config: `${hex}.json`, Layers: [] }])).resolves.toBe(`sha256:${hex}`);
    await expect(withIndex([{ Config: `blobs/sha256/${hex}`, Layers: [] }])).resolves.toBe(`sha256:${hex}`);
  });

  it("refuses an index that names no config", async () => {
    await expect(withIndex([{ Layers: [] }])).rejects.toThrow(/names no config/);
    await expect(withIndex({ Config: `${hex}.json` })).rejects.toThrow(/names no config/);
    await expect(withIndex([{ Config: "config.json" }])).rejects.toThrow(/names no config/);
  });
});
