/**
 * Checks shared by the cloud drivers' parameter parsers (cloud.driverParameters): one error shape
 * (cloud.invalid_parameters with the key's path, the driver named, no value longer than 60 characters quoted),
 * the unknown-keys check, secrets from `file://` / `env:` references, and durations.
 */
import { resolveSecret, secretRefProblem } from "../config/secrets.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { parseDuration } from "../lib/units.ts";

const PATH = "cloud.driverParameters";

export interface ParameterTools {
  /** cloud.invalid_parameters for `key` ("" = the whole map). */
  invalid(key: string, message: string, cause?: unknown): DispatchCloudError;
  /** A value as a message may show it: JSON, cut at 60 characters. Never use it for secrets. */
  show(value: unknown): string;
  /** The parameters as a map with only known keys; undefined or null is an error naming `required`. */
  knownMap(
    params: unknown,
    known: readonly string[],
    required: { key: string; hint: string },
  ): Record<string, unknown>;
  /** A secret given as `file:///path`, `env:NAME` or the value itself, resolved; errors never show the value. */
  secretValue(key: string, ref: unknown, env: Readonly<Record<string, string | undefined>>): string;
  /** A duration such as `30s` (`dflt` when absent); 0 only when `zeroOk`. */
  duration(key: string, raw: Record<string, unknown>, dflt: string, zeroOk?: boolean): number;
}

export function parameterTools(driver: string): ParameterTools {
  const invalid = (key: string, message: string, cause?: unknown): DispatchCloudError => {
    const path = key === "" ? PATH : `${PATH}.${key}`;
    return new DispatchCloudError("cloud.invalid_parameters", `${driver} driver: ${path} ${message}`, {
      path,
      ...(cause === undefined ? {} : { cause }),
    });
  };
  const show = (value: unknown): string => {
    const text = typeof value === "string" ? JSON.stringify(value) : String(JSON.stringify(value) ?? value);
    return text.length > 60 ? `${text.slice(0, 57)}...` : text;
  };
  return {
    invalid,
    show,
    knownMap(params, known, required) {
      if (params === undefined || params === null) throw invalid(required.key, required.hint);
      if (typeof params !== "object" || Array.isArray(params))
        throw invalid("", "must be a map of parameters");
      const raw = params as Record<string, unknown>;
      for (const key of Object.keys(raw)) {
        if (!known.includes(key)) {
          throw invalid(key, `is not a parameter of the ${driver} driver (known: ${known.join(", ")})`);
        }
      }
      return raw;
    },
    secretValue(key, ref, env) {
      if (typeof ref !== "string" || ref === "") {
        throw invalid(key, "must be a non-empty string: file:///absolute/path, env:NAME or the value itself");
      }
      const problem = secretRefProblem(ref);
      if (problem !== undefined) throw invalid(key, problem);
      try {
        return resolveSecret(ref, `${PATH}.${key}`, env);
      } catch (err) {
        // resolveSecret's messages name the key, the variable or the file, never the value.
        const message =
          err instanceof DispatchCloudError ? err.message.replace(`${PATH}.${key}: `, "") : "cannot be read";
        throw invalid(key, message, err);
      }
    },
    duration(key, raw, dflt, zeroOk = false) {
      const value = raw[key] ?? dflt;
      let ms: number;
      try {
        ms = parseDuration(value as string);
      } catch (err) {
        throw invalid(key, (err as Error).message, err);
      }
      if (ms <= 0 && !zeroOk) throw invalid(key, `must be longer than 0; got ${show(value)}`);
      return ms;
    },
  };
}
