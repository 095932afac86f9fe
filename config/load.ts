/**
 * Reads a YAML config, fills defaults, validates against ConfigSchema collecting every problem (with the full
 * key path, the accepted values, and the YAML line where known), decodes durations/sizes and deep-freezes it.
 */
import { readFileSync } from "node:fs";
import { Kind, type TSchema } from "@sinclair/typebox";
import { type ValueError, ValueErrorType } from "@sinclair/typebox/errors";
import { Value } from "@sinclair/typebox/value";
import { isMap, isScalar, LineCounter, type Node, type Pair, parseDocument } from "yaml";
import { DispatchCloudError, type ErrorCode } from "../lib/errors.ts";
import { parseDuration, parseSize } from "../lib/units.ts";
import { type Config, ConfigSchema } from "./schema.ts";
import { secretKind, secretRefProblem } from "./secrets.ts";

export interface ConfigProblem {
  code: ErrorCode;
  /** Full dotted key path, e.g. "cloud.timeoutIdle"; "" for the document itself. */
  path: string;
  message: string;
  line?: number;
}

export interface ConfigWarning {
  path: string;
  message: string;
  line?: number;
}

export interface ConfigParseResult {
  /** The frozen config, or undefined when there are problems. */
  config: Config | undefined;
  problems: ConfigProblem[];
  warnings: ConfigWarning[];
}

/** A config file that did not validate; `problems` lists every one. */
export class ConfigError extends DispatchCloudError {
  readonly problems: readonly ConfigProblem[];
  constructor(source: string, problems: ConfigProblem[]) {
    const first = problems[0];
    const lines = problems.map((p) => `  ${formatProblem(p)}`).join("\n");
    super(
      first?.code ?? "config.invalid_value",
      `${source}: ${problems.length} config problem(s):\n${lines}`,
      {
        ...(first === undefined || first.path === "" ? {} : { path: first.path }),
      },
    );
    this.name = "ConfigError";
    this.problems = problems;
  }
}

/** `path: message (code)`, with ` [line N]` when the line is known. */
export function formatProblem(p: ConfigProblem): string {
  const where = p.path === "" ? "(config)" : p.path;
  return `${where}: ${p.message} (${p.code})${p.line === undefined ? "" : ` [line ${p.line}]`}`;
}

/** The config with every default, as a frozen Config. */
export function defaultConfig(): Config {
  const { config } = parseConfig("", "<defaults>");
  if (config === undefined) throw new Error("the schema's defaults do not validate");
  return config;
}

/** Reads and validates a config file; no path = the defaults. Throws ConfigError listing every problem. */
export function loadConfig(path?: string): Config {
  if (path === undefined) return defaultConfig();
  const result = parseConfig(readConfigText(path), path);
  if (result.config === undefined) throw new ConfigError(path, result.problems);
  return result.config;
}

export function readConfigText(path: string): string {
  try {
    return readFileSync(path, "utf8");
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code ?? "error";
    throw new DispatchCloudError("config.unreadable_file", `cannot read config file ${path} (${code})`, {
      cause: err,
    });
  }
}

export function parseConfig(yamlText: string, _source = "<config>"): ConfigParseResult {
  const lineCounter = new LineCounter();
  const doc = parseDocument(yamlText, { lineCounter, prettyErrors: false, uniqueKeys: true });
  if (doc.errors.length > 0) {
    const problems = doc.errors.map((e): ConfigProblem => {
      const message = `invalid YAML: ${e.message.split("\n")[0]}`;
      return withLine({ code: "config.invalid_yaml", path: "", message }, lineCounter.linePos(e.pos[0]).line);
    });
    return { config: undefined, problems, warnings: [] };
  }
  const raw: unknown = dropNulls(doc.toJS({ maxAliasCount: 1000 }) ?? {});
  const lineOf = (segments: string[]) => lineOfPath(doc.contents, segments, lineCounter);
  if (!isPlainObject(raw)) {
    const problem: ConfigProblem = {
      code: "config.invalid_value",
      path: "",
      message: "the config must be a YAML mapping of keys such as clusterId:, database:, cloud:",
    };
    return { config: undefined, problems: [withLine(problem, lineOf([]))], warnings: [] };
  }
  const value = applyDefaults(raw);
  const problems = collectProblems(value, lineOf);
  if (problems.length > 0) return { config: undefined, problems, warnings: [] };

  const decoded = Value.Decode(ConfigSchema, value);
  // Derived defaults that depend on other keys.
  if (decoded.cloud.instanceSetId === "") decoded.cloud.instanceSetId = decoded.clusterId;
  for (const [name, type] of Object.entries(decoded.instanceTypes)) {
    if (type.providerType === "") type.providerType = name;
  }
  return { config: deepFreeze(decoded), problems: [], warnings: secretWarnings(decoded, lineOf) };
}

/**
 * Fills defaults. Value.Default merges a given object into an object default, which is right for sections but
 * wrong for instanceTypes: a configured list replaces the default list, so only its entries get defaults.
 */
function applyDefaults(raw: Record<string, unknown>): unknown {
  const { instanceTypes, ...rest } = raw;
  const value = Value.Default(ConfigSchema, rest) as Record<string, unknown>;
  if (instanceTypes === undefined) return value;
  if (isPlainObject(instanceTypes)) {
    const entrySchema = Object.values(ConfigSchema.properties.instanceTypes.patternProperties)[0]!;
    for (const [name, entry] of Object.entries(instanceTypes))
      instanceTypes[name] = Value.Default(entrySchema, entry);
  }
  value["instanceTypes"] = instanceTypes;
  return value;
}

// ---- Problems ---------------------------------------------------------------------------------------------

type LineOf = (segments: string[]) => number | undefined;

function collectProblems(value: unknown, lineOf: LineOf): ConfigProblem[] {
  const seen = new Set<string>();
  const problems: ConfigProblem[] = [];
  for (const err of Value.Errors(ConfigSchema, value)) {
    const segments = pointerSegments(err.path);
    const path = segments.join(".");
    if (seen.has(path)) continue; // one problem per key: the first is the most specific
    seen.add(path);
    problems.push(withLine(toProblem(err, segments), lineOf(segments)));
  }
  // In file order; problems without a line (none expected) last.
  return problems.sort((a, b) => (a.line ?? Number.MAX_SAFE_INTEGER) - (b.line ?? Number.MAX_SAFE_INTEGER));
}

function toProblem(err: ValueError, segments: string[]): ConfigProblem {
  const path = segments.join(".");
  const key = segments[segments.length - 1] ?? "";
  const schema = err.schema as AnnotatedSchema;
  switch (err.type) {
    case ValueErrorType.ObjectAdditionalProperties: {
      if (schema[Kind] === "Record") {
        const expected = String(schema["keyExpected"] ?? "a valid name");
        return {
          code: "config.invalid_value",
          path,
          message: `${JSON.stringify(key)} is not a valid name: use ${expected}`,
        };
      }
      return { code: "config.unknown_key", path, message: unknownKeyMessage(key, segments, schema) };
    }
    case ValueErrorType.ObjectRequiredProperty:
      return { code: "config.missing_key", path, message: `is required: ${expectedOf(schema)}` };
    case ValueErrorType.ObjectMinProperties:
      return { code: "config.invalid_value", path, message: "must define at least one entry" };
    default:
      return { code: "config.invalid_value", path, message: valueMessage(schema, err.value) };
  }
}

type AnnotatedSchema = TSchema & Record<string, unknown>;

function valueMessage(schema: AnnotatedSchema, value: unknown): string {
  switch (schema["unit"]) {
    case "duration":
      try {
        parseDuration(value as string);
        if (typeof schema["offOrAtLeast"] === "string") {
          return `must be 0 (off) or at least ${schema["offOrAtLeast"]}; got ${JSON.stringify(value)}`;
        }
        return "must be greater than 0";
      } catch (e) {
        return (e as Error).message;
      }
    case "size":
      try {
        parseSize(value as string);
      } catch (e) {
        return (e as Error).message;
      }
      return `must be ${expectedOf(schema)}`;
    case "secret":
      // Never echo the value: it may be the secret itself.
      if (typeof value !== "string") return `must be a string: ${expectedOf(schema)}`;
      return secretRefProblem(value) ?? `must be ${expectedOf(schema)}`;
  }
  let message = `must be ${expectedOf(schema)}; got ${show(value)}`;
  if (schema[Kind] === "String" && (typeof value === "number" || typeof value === "boolean")) {
    message += " (quote it in YAML to make it a string)";
  }
  return message;
}

/** Human text of what a schema accepts. */
export function expectedOf(schema: AnnotatedSchema): string {
  if (typeof schema["expected"] === "string") return schema["expected"];
  const range = (noun: string) => {
    const parts = [noun];
    if (typeof schema["minimum"] === "number") parts.push(`>= ${schema["minimum"]}`);
    const max = schema["maximum"];
    if (typeof max === "number" && max < Number.MAX_SAFE_INTEGER)
      parts.push(`${parts.length > 1 ? "and " : ""}<= ${max}`);
    return parts.join(" ");
  };
  switch (schema[Kind]) {
    case "Integer":
      return range("an integer");
    case "Number":
      return range("a number");
    case "Boolean":
      return "true or false";
    case "String":
      return "a string";
    case "Object":
    case "Record":
      return "a mapping (key: value)";
    default:
      return "a valid value";
  }
}

function unknownKeyMessage(key: string, segments: string[], parent: AnnotatedSchema): string {
  const siblings = Object.keys((parent["properties"] as Record<string, unknown> | undefined) ?? {});
  const where = segments.length > 1 ? ` in ${segments.slice(0, -1).join(".")}` : "";
  const suggestion = closest(key, siblings);
  if (suggestion !== undefined)
    return `unknown key ${JSON.stringify(key)}${where}; did you mean ${suggestion}?`;
  return `unknown key ${JSON.stringify(key)}${where}; valid keys: ${siblings.join(", ")}`;
}

/** The sibling key nearest to `key` by edit distance (ignoring case, `_` and `-`), if near enough. */
export function closest(key: string, candidates: string[]): string | undefined {
  const norm = (s: string) => s.toLowerCase().replace(/[_-]/g, "");
  let best: string | undefined;
  let bestDistance = Number.POSITIVE_INFINITY;
  for (const c of candidates) {
    const d = editDistance(norm(key), norm(c));
    if (d < bestDistance) {
      best = c;
      bestDistance = d;
    }
  }
  const limit = Math.max(2, Math.floor(key.length / 3));
  return bestDistance <= limit ? best : undefined;
}

function editDistance(a: string, b: string): number {
  let prev = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const cur = [i];
    for (let j = 1; j <= b.length; j++) {
      const cost = a[i - 1] === b[j - 1] ? 0 : 1;
      cur[j] = Math.min(prev[j]! + 1, cur[j - 1]! + 1, prev[j - 1]! + cost);
    }
    prev = cur;
  }
  return prev[b.length]!;
}

function show(value: unknown): string {
  if (value === undefined) return "nothing";
  let text: string;
  if (typeof value === "string") text = JSON.stringify(value);
  else if (Array.isArray(value)) text = "a list";
  else if (typeof value === "object" && value !== null) text = "a mapping";
  else text = String(value);
  return text.length > 60 ? `${text.slice(0, 57)}...` : text;
}

// ---- Warnings ---------------------------------------------------------------------------------------------

/** Paths of the secret keys; "*" stands for any key of a record (containers.registries.*.password). */
function secretPaths(schema: AnnotatedSchema, prefix: string[] = []): string[][] {
  if (schema["secret"] === true) return [prefix];
  if (schema[Kind] === "Record") {
    const entry = Object.values((schema["patternProperties"] ?? {}) as Record<string, AnnotatedSchema>)[0];
    return entry === undefined ? [] : secretPaths(entry, [...prefix, "*"]);
  }
  if (schema[Kind] !== "Object") return [];
  const props = schema["properties"] as Record<string, AnnotatedSchema>;
  return Object.entries(props).flatMap(([k, s]) => secretPaths(s, [...prefix, k]));
}

const SECRET_PATTERNS = secretPaths(ConfigSchema as unknown as AnnotatedSchema);

/** The secret keys present in `config`, their "*" segments expanded to the record's keys. */
function secretPathsIn(config: unknown): string[][] {
  const expand = (value: unknown, pattern: string[], done: string[]): string[][] => {
    if (pattern.length === 0) return [done];
    const [head, ...rest] = pattern as [string, ...string[]];
    if (head !== "*") return expand(isPlainObject(value) ? value[head] : undefined, rest, [...done, head]);
    if (!isPlainObject(value)) return [];
    return Object.keys(value).flatMap((k) => expand(value[k], rest, [...done, k]));
  };
  return SECRET_PATTERNS.flatMap((p) => expand(config, p, []));
}

function secretWarnings(config: unknown, lineOf: LineOf): ConfigWarning[] {
  const warnings: ConfigWarning[] = [];
  for (const segments of secretPathsIn(config)) {
    const ref = getIn(config, segments);
    if (typeof ref === "string" && secretKind(ref) === "literal") {
      const message = "is a literal secret; put it in a file (file:///path) or a variable (env:NAME) instead";
      warnings.push(withLine({ path: segments.join("."), message }, lineOf(segments)));
    }
  }
  return warnings;
}

/** The secret config keys (e.g. "management.token"), with their references in `config`. */
export function secretRefs(config: Config): { path: string; ref: string }[] {
  return secretPathsIn(config).map((segments) => ({
    path: segments.join("."),
    ref: String(getIn(config, segments) ?? ""),
  }));
}

// ---- Helpers ----------------------------------------------------------------------------------------------

function withLine<T extends ConfigWarning>(item: T, line: number | undefined): T {
  return line === undefined ? item : { ...item, line };
}

function pointerSegments(pointer: string): string[] {
  if (pointer === "") return [];
  return pointer
    .slice(1)
    .split("/")
    .map((s) => s.replace(/~1/g, "/").replace(/~0/g, "~"));
}

function lineOfPath(root: unknown, segments: string[], lc: LineCounter): number | undefined {
  let node = root;
  let line = rangeLine(node as Node | null, lc);
  for (const seg of segments) {
    if (!isMap(node)) break;
    const pair = (node.items as Pair[]).find((p) => isScalar(p.key) && String(p.key.value) === seg);
    if (pair === undefined) break;
    line = rangeLine(pair.key as Node, lc) ?? line;
    node = pair.value;
  }
  return line;
}

function rangeLine(node: Node | null | undefined, lc: LineCounter): number | undefined {
  const start = node?.range?.[0];
  return start === undefined ? undefined : lc.linePos(start).line;
}

function getIn(value: unknown, segments: string[]): unknown {
  let cur = value;
  for (const seg of segments) {
    if (!isPlainObject(cur)) return undefined;
    cur = cur[seg];
  }
  return cur;
}

function isPlainObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** `key:` with no value (YAML null) means "use the default", as if the key were absent. */
function dropNulls(v: unknown): unknown {
  if (Array.isArray(v)) return v.map(dropNulls);
  if (!isPlainObject(v)) return v;
  const out: Record<string, unknown> = {};
  for (const [k, x] of Object.entries(v)) if (x !== null) out[k] = dropNulls(x);
  return out;
}

function deepFreeze<T>(v: T): T {
  if (typeof v === "object" && v !== null && !Object.isFrozen(v)) {
    Object.freeze(v);
    for (const x of Object.values(v)) deepFreeze(x);
  }
  return v;
}
