/**
 * Secret references. A secret config value is empty (not configured), `file:///absolute/path` (read the file),
 * `env:NAME` (read the environment variable), or a literal (accepted; `config check` warns about it). The config
 * keeps the reference; resolveSecret reads the value when it is used, so a loaded Config never holds one.
 */
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { DispatchCloudError } from "../lib/errors.ts";

export type SecretKind = "empty" | "file" | "env" | "literal";

export const SECRET_FORMAT =
  "empty, file:///absolute/path or env:NAME (a literal value is accepted, but belongs in a file or variable)";

const ENV_NAME = /^[A-Za-z_][A-Za-z0-9_]*$/;

export function secretKind(ref: string): SecretKind {
  if (ref === "") return "empty";
  if (ref.startsWith("file:")) return "file";
  if (ref.startsWith("env:")) return "env";
  return "literal";
}

/** Why a reference is malformed, or undefined if it is fine. The message never contains the reference. */
export function secretRefProblem(ref: string): string | undefined {
  switch (secretKind(ref)) {
    case "file":
      if (!ref.startsWith("file:///")) return "a file secret must be written file:///absolute/path";
      try {
        fileURLToPath(ref);
      } catch {
        return "a file secret must be written file:///absolute/path (the path could not be decoded)";
      }
      return undefined;
    case "env":
      if (!ENV_NAME.test(ref.slice(4))) {
        return "an env secret must be written env:NAME, NAME made of letters, digits and _ and not starting with a digit";
      }
      return undefined;
    default:
      return undefined;
  }
}

/**
 * Reads the secret a reference points at. `path` is the config key (e.g. "management.token"), used in errors.
 * Empty refs resolve to "" (not configured). A file's single trailing newline is dropped.
 * Throws config.missing_secret (variable unset/empty, file empty) or config.unreadable_file; messages name the
 * key, the variable or the file, never the value.
 */
export function resolveSecret(
  ref: string,
  path: string,
  env: Readonly<Record<string, string | undefined>> = process.env,
): string {
  const problem = secretRefProblem(ref);
  if (problem !== undefined)
    throw new DispatchCloudError("config.invalid_value", `${path}: ${problem}`, { path });
  switch (secretKind(ref)) {
    case "empty":
      return "";
    case "literal":
      return ref;
    case "env": {
      const name = ref.slice(4);
      const value = env[name];
      if (value === undefined || value === "") {
        throw new DispatchCloudError(
          "config.missing_secret",
          `${path}: environment variable ${name} is not set (or empty)`,
          {
            path,
          },
        );
      }
      return value;
    }
    case "file": {
      const file = fileURLToPath(ref);
      let text: string;
      try {
        text = readFileSync(file, "utf8");
      } catch (err) {
        const code = (err as NodeJS.ErrnoException).code ?? "error";
        throw new DispatchCloudError(
          "config.unreadable_file",
          `${path}: cannot read secret file ${file} (${code})`,
          {
            path,
          },
        );
      }
      const value = text.endsWith("\r\n")
        ? text.slice(0, -2)
        : text.endsWith("\n")
          ? text.slice(0, -1)
          : text;
      if (value === "")
        throw new DispatchCloudError("config.missing_secret", `${path}: secret file ${file} is empty`, {
          path,
        });
      return value;
    }
  }
}
