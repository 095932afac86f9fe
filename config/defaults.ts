/**
 * The annotated defaults, generated from ConfigSchema: every key with its description, what it accepts and its
 * default. config/defaults.yml is this text checked in (a test keeps them equal); regenerate it with
 * `dispatch-cloud config defaults > config/defaults.yml`.
 */
import { Kind, type TSchema } from "@sinclair/typebox";
import { Value } from "@sinclair/typebox/value";
import { stringify } from "yaml";
import { ConfigSchema } from "./schema.ts";

type AnnotatedSchema = TSchema & Record<string, unknown>;

const HEADER = [
  "# dispatch-cloud configuration: every key with its default. Generated from config/schema.ts.",
  "# Copy only the keys you change into your own file; everything else keeps these defaults.",
  "# Durations: 10s, 1m30s, 1.5h, 500ms (a bare number is an error). Sizes: 4GiB, 512MiB, 1.5GB, or bytes.",
  "# Secrets: empty, file:///absolute/path or env:NAME (literal values work but `config check` warns).",
  "# An empty value (`key:`) means the default.",
];

/** The schema's defaults in their written (encoded) form: durations and sizes as strings. */
export function schemaDefaults(): Record<string, unknown> {
  return Value.Default(ConfigSchema, {}) as Record<string, unknown>;
}

/** The annotated defaults file, as `dispatch-cloud config defaults` prints it. */
export function defaultsYamlText(): string {
  const lines = [...HEADER];
  emitObject(ConfigSchema as unknown as AnnotatedSchema, schemaDefaults(), "", lines, true);
  return `${lines.join("\n")}\n`;
}

/** Short text of what a leaf accepts, for comments. */
function accepts(schema: AnnotatedSchema): string {
  switch (schema["unit"]) {
    case "duration":
      if (typeof schema["offOrAtLeast"] === "string")
        return `Duration: 0 (off) or >= ${schema["offOrAtLeast"]}.`;
      return schema["format"] === "dc-duration-positive" ? "Duration, > 0." : "Duration.";
    case "size":
      return "Size.";
    case "secret":
      return "Secret: empty, file:///path or env:NAME.";
  }
  const expected = schema["expected"];
  if (typeof expected === "string") {
    return expected.startsWith("one of") ? `${capitalize(expected)}.` : `Format: ${expected}.`;
  }
  const range = () => {
    const max = schema["maximum"];
    const upper = typeof max === "number" && max < Number.MAX_SAFE_INTEGER ? `..${max}` : "";
    return typeof schema["minimum"] === "number"
      ? ` ${upper === "" ? ">= " : ""}${schema["minimum"]}${upper}`
      : "";
  };
  switch (schema[Kind]) {
    case "Integer":
      return `Integer${range()}.`;
    case "Number":
      return `Number${range()}.`;
    case "Boolean":
      return "true or false.";
    default:
      return "";
  }
}

function capitalize(s: string): string {
  return s.charAt(0).toUpperCase() + s.slice(1);
}

function scalar(value: unknown): string {
  return stringify(value, { flow: true }).trimEnd();
}

function emitObject(
  schema: AnnotatedSchema,
  value: Record<string, unknown>,
  indent: string,
  lines: string[],
  spaced: boolean,
): void {
  const props = schema["properties"] as Record<string, AnnotatedSchema>;
  for (const [key, prop] of Object.entries(props)) {
    if (spaced) lines.push("");
    pushComment(prop, `${indent}# `, lines);
    const v = value[key];
    if (prop[Kind] === "Object" && v !== undefined) {
      lines.push(`${indent}${key}:`);
      emitObject(prop, v as Record<string, unknown>, `${indent}  `, lines, false);
    } else if (
      prop[Kind] === "Record" &&
      prop["patternProperties"] !== undefined &&
      isObjectRecord(prop) &&
      Object.keys(v ?? {}).length > 0
    ) {
      lines.push(`${indent}${key}:`);
      const entrySchema = Object.values(prop["patternProperties"] as Record<string, AnnotatedSchema>)[0]!;
      for (const [name, entry] of Object.entries(v as Record<string, Record<string, unknown>>)) {
        lines.push(`${indent}  ${name}:`);
        emitObject(entrySchema, entry, `${indent}    `, lines, false);
      }
    } else if (v === undefined) {
      // An optional object with no default: show its example, commented out.
      lines.push(`${indent}# ${key}:`);
      if (prop[Kind] === "Object") emitExample(prop, `${indent}#   `, lines);
    } else {
      lines.push(`${indent}${key}: ${scalar(v)}`);
    }
  }
}

function isObjectRecord(schema: AnnotatedSchema): boolean {
  const entry = Object.values(schema["patternProperties"] as Record<string, AnnotatedSchema>)[0];
  return entry?.[Kind] === "Object";
}

function emitExample(schema: AnnotatedSchema, prefix: string, lines: string[]): void {
  const example = (schema["example"] ?? {}) as Record<string, unknown>;
  const props = schema["properties"] as Record<string, AnnotatedSchema>;
  for (const [key, prop] of Object.entries(props)) {
    pushComment(prop, `${prefix}# `, lines);
    lines.push(`${prefix}${key}: ${scalar(example[key])}`);
  }
}

/** The schema's description and what it accepts, as comment lines wrapped to fit the line width. */
function pushComment(schema: AnnotatedSchema, prefix: string, lines: string[]): void {
  const text = [schema["description"], accepts(schema)]
    .filter((s) => typeof s === "string" && s !== "")
    .join(" ");
  let line = "";
  for (const word of text.split(" ")) {
    if (line !== "" && prefix.length + line.length + 1 + word.length > COMMENT_WIDTH) {
      lines.push(`${prefix}${line}`);
      line = word;
    } else {
      line = line === "" ? word : `${line} ${word}`;
    }
  }
  if (line !== "") lines.push(`${prefix}${line}`);
}

const COMMENT_WIDTH = 110;
