/**
 * `dispatch-cloud config check FILE` and `dispatch-cloud config defaults`, as functions the CLI wires up.
 */
import { DispatchCloudError } from "../lib/errors.ts";
import { defaultsYamlText } from "./defaults.ts";
import {
  type ConfigProblem,
  type ConfigWarning,
  formatProblem,
  parseConfig,
  readConfigText,
  secretRefs,
} from "./load.ts";
import { resolveSecret, secretKind } from "./secrets.ts";

export { defaultsYamlText } from "./defaults.ts";
export { formatProblem } from "./load.ts";

export interface ConfigCheckResult {
  ok: boolean;
  problems: ConfigProblem[];
  warnings: ConfigWarning[];
}

/**
 * Validates a config file. Problems make it unusable; warnings do not (literal secrets, and env:/file: secrets
 * that cannot be resolved in this environment).
 */
export function checkConfigFile(
  path: string,
  env: Readonly<Record<string, string | undefined>> = process.env,
): ConfigCheckResult {
  let text: string;
  try {
    text = readConfigText(path);
  } catch (err) {
    const e = err as DispatchCloudError;
    return { ok: false, problems: [{ code: e.code, path: "", message: e.message }], warnings: [] };
  }
  const result = parseConfig(text, path);
  if (result.config === undefined) return { ok: false, problems: result.problems, warnings: result.warnings };
  const warnings = [...result.warnings];
  for (const { path: key, ref } of secretRefs(result.config)) {
    const kind = secretKind(ref);
    if (kind !== "env" && kind !== "file") continue;
    try {
      resolveSecret(ref, key, env);
    } catch (err) {
      if (!(err instanceof DispatchCloudError)) throw err;
      const message = `cannot be resolved here: ${err.message.replace(`${key}: `, "")} (${err.code})`;
      warnings.push({ path: key, message });
    }
  }
  return { ok: true, problems: [], warnings };
}

/** One `path: message (code)` line per problem. */
export function formatProblems(problems: readonly ConfigProblem[]): string[] {
  return problems.map(formatProblem);
}

export function formatWarnings(warnings: readonly ConfigWarning[]): string[] {
  return warnings.map(
    (w) => `warning: ${w.path}: ${w.message}${w.line === undefined ? "" : ` [line ${w.line}]`}`,
  );
}

/** Prints the check's findings; returns the exit code (0 valid, 1 problems). */
export function runConfigCheck(
  path: string,
  out: (line: string) => void,
  env: Readonly<Record<string, string | undefined>> = process.env,
): number {
  const result = checkConfigFile(path, env);
  for (const line of formatProblems(result.problems)) out(line);
  for (const line of formatWarnings(result.warnings)) out(line);
  if (!result.ok) {
    out(`${path}: ${result.problems.length} problem(s); the config is not valid`);
    return 1;
  }
  out(`${path}: OK${result.warnings.length > 0 ? ` (${result.warnings.length} warning(s))` : ""}`);
  return 0;
}

/** Prints the annotated defaults (config/defaults.yml); returns 0. */
export function runConfigDefaults(out: (line: string) => void): number {
  for (const line of defaultsYamlText().replace(/\n$/, "").split("\n")) out(line);
  return 0;
}
