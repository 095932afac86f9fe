import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../lib/errors.ts";
import { checkConfigFile, formatProblems, runConfigCheck, runConfigDefaults } from "./check.ts";
import { resolveSecret } from "./schema.ts";

const dir = mkdtempSync(join(tmpdir(), "dc-check-"));

function file(name: string, text: string): string {
  const path = join(dir, name);
  writeFileSync(path, text);
  return path;
}

function run(path: string, env: Record<string, string> = {}): { code: number; lines: string[] } {
  const lines: string[] = [];
  const code = runConfigCheck(path, (l) => lines.push(l), env);
  return { code, lines };
}

describe("runConfigCheck", () => {
  it("exits 0 and says OK for a valid file", () => {
    const { code, lines } = run(file("ok.yml", "cloud:\n  maxInstances: 3\n"));
    expect(code).toBe(0);
    expect(lines).toEqual([`${dir}/ok.yml: OK`]);
  });

  it("exits 1 and prints one `path: message (code)` line per problem", () => {
    const { code, lines } = run(file("bad.yml", 'cloud:\n  timeoutIdle: "abc"\n  maxInstnces: 3\n'));
    expect(code).toBe(1);
    expect(lines).toHaveLength(3);
    expect(lines[0]).toMatch(
      /^cloud\.timeoutIdle: must be a duration .* \(config\.invalid_value\) \[line 2\]$/,
    );
    expect(lines[1]).toMatch(
      /^cloud\.maxInstnces: .*did you mean maxInstances\? \(config\.unknown_key\) \[line 3\]$/,
    );
    expect(lines[2]).toContain("2 problem(s)");
  });

  it("exits 1 for a missing file", () => {
    const { code, lines } = run(join(dir, "missing.yml"));
    expect(code).toBe(1);
    expect(lines[0]).toContain("config.unreadable_file");
  });

  it("warns about literal and unresolvable secrets without printing them", () => {
    const path = file(
      "secrets.yml",
      "management:\n  token: hunter2\ndispatcher:\n  privateKey: env:DC_TEST_KEY\n",
    );
    const { code, lines } = run(path);
    expect(code).toBe(0);
    expect(lines).toEqual([
      expect.stringMatching(/^warning: management\.token: is a literal secret.*\[line 2\]$/),
      expect.stringMatching(
        /^warning: dispatcher\.privateKey: cannot be resolved here: .*DC_TEST_KEY.*missing_secret/,
      ),
      `${path}: OK (2 warning(s))`,
    ]);
    expect(lines.join("\n")).not.toContain("hunter2");
    expect(run(path, { DC_TEST_KEY: "k" }).lines).toHaveLength(2);
  });
});

describe("checkConfigFile and formatProblems", () => {
  it("returns the problems for formatting", () => {
    const result = checkConfigFile(file("enum.yml", "logging:\n  format: xml\n"), {});
    expect(result.ok).toBe(false);
    expect(formatProblems(result.problems)).toEqual([
      'logging.format: must be one of: auto, json, text; got "xml" (config.invalid_value) [line 2]',
    ]);
  });
});

describe("runConfigDefaults", () => {
  it("prints config/defaults.yml line by line", () => {
    const lines: string[] = [];
    expect(runConfigDefaults((l) => lines.push(l))).toBe(0);
    expect(`${lines.join("\n")}\n`).toBe(readFileSync(new URL("./defaults.yml", import.meta.url), "utf8"));
  });
});

describe("resolveSecret", () => {
  it("reads a file:// secret at use time, dropping one trailing newline", () => {
    const path = file("token", "s3cr3t-from-file\n");
    expect(resolveSecret(pathToFileURL(path).href, "management.token")).toBe("s3cr3t-from-file");
    writeFileSync(path, "rotated\n");
    expect(resolveSecret(pathToFileURL(path).href, "management.token")).toBe("rotated");
  });

  it("reads an env: secret", () => {
    expect(resolveSecret("env:DC_TOKEN", "management.token", { DC_TOKEN: "s3cr3t-from-env" })).toBe(
      "s3cr3t-from-env",
    );
  });

  it("returns literals as they are and empty as not configured", () => {
    expect(resolveSecret("plain", "management.token", {})).toBe("plain");
    expect(resolveSecret("", "management.token", {})).toBe("");
  });

  function failure(fn: () => unknown): DispatchCloudError {
    try {
      fn();
    } catch (err) {
      expect(err).toBeInstanceOf(DispatchCloudError);
      return err as DispatchCloudError;
    }
    throw new Error("expected an error");
  }

  it("names the key, not the value, when a secret is missing or unreadable", () => {
    const unset = failure(() => resolveSecret("env:DC_UNSET", "dispatcher.privateKey", {}));
    expect(unset).toMatchObject({ code: "config.missing_secret", path: "dispatcher.privateKey" });
    expect(unset.message).toContain("DC_UNSET");
    const gone = failure(() => resolveSecret("file:///nonexistent/dc-key", "dispatcher.privateKey", {}));
    expect(gone).toMatchObject({ code: "config.unreadable_file", path: "dispatcher.privateKey" });
    const empty = failure(() => resolveSecret(pathToFileURL(file("empty", "")).href, "management.token", {}));
    expect(empty.code).toBe("config.missing_secret");
    const bad = failure(() => resolveSecret("file:s3cr3t", "management.token", {}));
    expect(bad.code).toBe("config.invalid_value");
    expect(bad.message).not.toContain("s3cr3t");
  });
});
