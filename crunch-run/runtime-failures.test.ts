import {
  existsSync,
  mkdirSync,
  mkdtempSync,
  readFileSync,
  rmSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { runnerPaths } from "./paths.ts";
import { clearRuntimeFailures, countRuntimeFailures, recordRuntimeFailure } from "./runtime-failures.ts";

describe("the instance's count of runtime failures", () => {
  const root = mkdtempSync(path.join(tmpdir(), "dc-failures-"));
  afterAll(() => rmSync(root, { recursive: true, force: true }));
  const paths = runnerPaths({ DISPATCH_VM_ROOT: root });

  it("counts failures in a row, one line each, until a start clears them", () => {
    expect(countRuntimeFailures(paths)).toBe(0);
    expect(recordRuntimeFailure(paths, "zzzzz-bndl-aaaaaaaaaaaaaaa", "hook\nfailed", new Date(0))).toBe(1);
    expect(recordRuntimeFailure(paths, "zzzzz-bndl-bbbbbbbbbbbbbbb", "mount failed")).toBe(2);
    const lines = readFileSync(paths.runtimeFailuresFile, "utf8").split("\n");
    expect(lines[0]).toBe("1970-01-01T00:00:00.000Z zzzzz-bndl-aaaaaaaaaaaaaaa hook failed");
    expect(lines[1]).toMatch(/ zzzzz-bndl-bbbbbbbbbbbbbbb mount failed$/);
    clearRuntimeFailures(paths);
    expect(existsSync(paths.runtimeFailuresFile)).toBe(false);
    expect(countRuntimeFailures(paths)).toBe(0);
    clearRuntimeFailures(paths);
  });

  it("does not follow a symbolic link planted in its place", () => {
    const target = path.join(root, "target");
    writeFileSync(target, "untouched\n");
    symlinkSync(target, paths.runtimeFailuresFile);
    expect(() => recordRuntimeFailure(paths, "zzzzz-bndl-aaaaaaaaaaaaaaa", "x")).toThrow(/ELOOP/);
    expect(readFileSync(target, "utf8")).toBe("untouched\n");
    clearRuntimeFailures(paths);
  });

  it("clearing never throws, even when something else holds the name", () => {
    mkdirSync(paths.runtimeFailuresFile);
    expect(() => clearRuntimeFailures(paths)).not.toThrow();
    rmSync(paths.runtimeFailuresFile, { recursive: true });
  });
});
