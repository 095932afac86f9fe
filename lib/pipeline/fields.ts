/**
 * The pieces of a job id: typed fields, their values, `min:max[:step]` ranges, and job-id templates such as
 * `{date}_{client}` (literal text plus `{field}`), parsed and formatted without regular expressions built from
 * user text. docs/pipelines.md describes the rules; graph.ts and definition.ts use them.
 */

export type FieldType = "int" | "str" | "date";
export const FIELD_TYPES: readonly FieldType[] = ["int", "str", "date"];
/** A field's value: int and date (YYYYMMDD) are numbers, str is a string. */
export type FieldValue = string | number;

export const JOB_ID_RE = /^[A-Za-z0-9._-]{1,100}$/;
export const APP_NAME_RE = /^[A-Za-z][A-Za-z0-9_-]{0,49}$/;
export const FIELD_NAME_RE = /^[a-z][a-z0-9_]{0,31}$/;
export const GROUP_NAME_RE = /^[A-Za-z][A-Za-z0-9_-]{0,49}$/;
/** Names a bundle template may use beside the job id's fields; never field names. */
export const RESERVED_NAMES = ["app_name", "job_id"] as const;
/** The most values a list or range may hold, and the most parents one clause may give one job. */
export const MAX_VALUES = 100_000;

const STR_CHAR = /[A-Za-z0-9.-]/;
const STR_RE = /^[A-Za-z0-9.-]{1,100}$/;
const INT_RE = /^-?(?:0|[1-9][0-9]{0,14})$/;
const DATE_RE = /^([0-9]{4})-?([0-9]{2})-?([0-9]{2})$/;
const DAY_MS = 86_400_000;

/** Whether `n` (YYYYMMDD) is a real calendar day. */
function dateParts(n: number): Date | undefined {
  const year = Math.floor(n / 10_000);
  const month = Math.floor(n / 100) % 100;
  const day = n % 100;
  if (year < 1000 || month < 1 || month > 12 || day < 1) return undefined;
  const d = new Date(Date.UTC(year, month - 1, day));
  return d.getUTCMonth() === month - 1 && d.getUTCDate() === day ? d : undefined;
}

function dateNumber(d: Date): number {
  return d.getUTCFullYear() * 10_000 + (d.getUTCMonth() + 1) * 100 + d.getUTCDate();
}

/** The text of a value in a job id (and the key used to compare values). */
export function formatValue(value: FieldValue): string {
  return String(value);
}

/** A value as written in a job id, or undefined when it is not one of `type`. */
export function parseValueText(type: FieldType, text: string): FieldValue | undefined {
  switch (type) {
    case "int": {
      if (!INT_RE.test(text)) return undefined;
      const n = Number(text);
      return Number.isSafeInteger(n) ? n : undefined;
    }
    case "str":
      return STR_RE.test(text) ? text : undefined;
    case "date": {
      if (!/^[0-9]{8}$/.test(text)) return undefined;
      const n = Number(text);
      return dateParts(n) === undefined ? undefined : n;
    }
  }
}

const TYPE_WORDS: Record<FieldType, string> = {
  int: "an integer",
  str: "1-100 characters from A-Z a-z 0-9 . - (no _)",
  date: "a date YYYYMMDD (or YYYY-MM-DD)",
};

/** A value as a definition gives it (YAML or JSON): its canonical form, or a problem. */
export function normaliseValue(type: FieldType, raw: unknown): { value: FieldValue } | { problem: string } {
  const bad = { problem: `${JSON.stringify(raw)} is not ${TYPE_WORDS[type]}` };
  switch (type) {
    case "int":
      return typeof raw === "number" && Number.isSafeInteger(raw) ? { value: raw } : bad;
    case "str": {
      const text = typeof raw === "number" && Number.isSafeInteger(raw) && raw >= 0 ? String(raw) : raw;
      return typeof text === "string" && STR_RE.test(text) ? { value: text } : bad;
    }
    case "date": {
      const text = typeof raw === "number" ? String(raw) : raw;
      if (typeof text !== "string") return bad;
      const m = DATE_RE.exec(text);
      if (m === null) return bad;
      const n = Number(`${m[1]}${m[2]}${m[3]}`);
      return dateParts(n) === undefined
        ? { problem: `${JSON.stringify(raw)} is not a calendar date` }
        : { value: n };
    }
  }
}

/**
 * A `min:max[:step]` range, both ends included: integers stepping by `step` (default 1), or dates stepping by
 * `step` days. str fields have no ranges.
 */
export function expandRange(type: FieldType, text: string): { values: FieldValue[] } | { problem: string } {
  if (type === "str") return { problem: `a str field takes a list of values, not a range (${text})` };
  const parts = text.split(":");
  if (parts.length < 2 || parts.length > 3)
    return { problem: `${JSON.stringify(text)} is not a range min:max or min:max:step` };
  const stepText = parts[2] ?? "1";
  if (!/^[1-9][0-9]{0,8}$/.test(stepText))
    return { problem: `the step of range ${JSON.stringify(text)} must be a whole number of at least 1` };
  const step = Number(stepText);
  const lo = normaliseValue(
    type,
    type === "int" && INT_RE.test(parts[0] ?? "") ? Number(parts[0]) : parts[0],
  );
  const hi = normaliseValue(
    type,
    type === "int" && INT_RE.test(parts[1] ?? "") ? Number(parts[1]) : parts[1],
  );
  if ("problem" in lo) return { problem: `the start of range ${JSON.stringify(text)}: ${lo.problem}` };
  if ("problem" in hi) return { problem: `the end of range ${JSON.stringify(text)}: ${hi.problem}` };
  const values: FieldValue[] = [];
  if (type === "int") {
    const a = lo.value as number;
    const b = hi.value as number;
    if (a > b) return { problem: `range ${JSON.stringify(text)} ends before it starts` };
    if ((b - a) / step + 1 > MAX_VALUES)
      return { problem: `range ${JSON.stringify(text)} holds more than ${MAX_VALUES} values` };
    for (let v = a; v <= b; v += step) values.push(v);
    return { values };
  }
  const a = dateParts(lo.value as number) as Date;
  const b = dateParts(hi.value as number) as Date;
  if (a.getTime() > b.getTime()) return { problem: `range ${JSON.stringify(text)} ends before it starts` };
  if ((b.getTime() - a.getTime()) / DAY_MS / step + 1 > MAX_VALUES)
    return { problem: `range ${JSON.stringify(text)} holds more than ${MAX_VALUES} values` };
  for (let t = a.getTime(); t <= b.getTime(); t += step * DAY_MS) values.push(dateNumber(new Date(t)));
  return { values };
}

/** A job-id template split into literal text and fields. */
export type Segment = { literal: string } | { field: string };

/**
 * Splits a job-id template. Literal text uses job-id characters only; each field appears at most once and is
 * declared in `types`; two fields are separated by literal text that starts with a character the first field's
 * values never hold (so a job id splits back one way only): for a str field that is `_`, for an int field
 * anything but a digit or `-`; a date is always 8 digits.
 */
export function parseJobIdTemplate(
  template: string,
  types: Readonly<Record<string, FieldType>>,
): { segments: Segment[] } | { problem: string } {
  const segments: Segment[] = [];
  const seen = new Set<string>();
  let i = 0;
  while (i < template.length) {
    const open = template.indexOf("{", i);
    const literalEnd = open === -1 ? template.length : open;
    const literal = template.slice(i, literalEnd);
    if (literal.length > 0) {
      if (!/^[A-Za-z0-9._-]+$/.test(literal))
        return {
          problem: `literal text ${JSON.stringify(literal)} may hold only A-Z a-z 0-9 . _ - (the characters of a job id)`,
        };
      segments.push({ literal });
    }
    if (open === -1) break;
    const close = template.indexOf("}", open);
    if (close === -1) return { problem: `"{" at character ${open + 1} is not closed` };
    const name = template.slice(open + 1, close);
    if (!FIELD_NAME_RE.test(name)) return { problem: `{${name}} is not a field name` };
    if (types[name] === undefined)
      return {
        problem: `{${name}} is not a declared field (declared: ${Object.keys(types).join(", ") || "none"})`,
      };
    if (seen.has(name)) return { problem: `{${name}} appears twice` };
    seen.add(name);
    segments.push({ field: name });
    i = close + 1;
  }
  if (segments.length === 0) return { problem: "a job-id template may not be empty" };
  for (let k = 0; k < segments.length; k++) {
    const seg = segments[k] as Segment;
    if (!("field" in seg)) continue;
    const next = segments[k + 1];
    if (next === undefined) continue;
    const type = types[seg.field] as FieldType;
    if (type === "date") continue;
    if ("field" in next)
      return { problem: `{${seg.field}} and {${next.field}} need literal text between them, such as "_"` };
    const first = next.literal[0] as string;
    const splits = type === "str" ? first === "_" : !/[0-9-]/.test(first);
    if (!splits && k + 2 < segments.length)
      return {
        problem: `the text after {${seg.field}} (${type}) must start with ${type === "str" ? '"_"' : 'a character other than a digit or "-"'}, or the job id could split two ways`,
      };
  }
  return { segments };
}

/** The fields of a template, in order. */
export function templateFields(segments: readonly Segment[]): string[] {
  return segments.flatMap((s) => ("field" in s ? [s.field] : []));
}

/** Splits a job id by a parsed template; undefined when it does not match. */
export function splitJobId(
  segments: readonly Segment[],
  types: Readonly<Record<string, FieldType>>,
  jobId: string,
): Record<string, FieldValue> | undefined {
  const out: Record<string, FieldValue> = {};
  let pos = 0;
  for (let k = 0; k < segments.length; k++) {
    const seg = segments[k] as Segment;
    if ("literal" in seg) {
      if (!jobId.startsWith(seg.literal, pos)) return undefined;
      pos += seg.literal.length;
      continue;
    }
    const type = types[seg.field] as FieldType;
    const next = segments[k + 1];
    let end: number;
    if (next === undefined) end = jobId.length;
    else if (type === "date") end = pos + 8;
    else if ("literal" in next && k + 2 >= segments.length) {
      // The last field before trailing text: everything up to that text.
      end = jobId.length - next.literal.length;
      if (end < pos) return undefined;
    } else {
      end = pos;
      if (type === "int" && jobId[end] === "-") end++;
      while (
        end < jobId.length &&
        (type === "str" ? STR_CHAR.test(jobId[end] as string) : /[0-9]/.test(jobId[end] as string))
      )
        end++;
    }
    const value = parseValueText(type, jobId.slice(pos, end));
    if (value === undefined) return undefined;
    out[seg.field] = value;
    pos = end;
  }
  return pos === jobId.length ? out : undefined;
}

/** Fills a parsed template. */
export function joinJobId(
  segments: readonly Segment[],
  values: Readonly<Record<string, FieldValue>>,
): string {
  let out = "";
  for (const seg of segments) {
    if ("literal" in seg) out += seg.literal;
    else out += formatValue(values[seg.field] as FieldValue);
  }
  return out;
}

/** A text template of a bundle (`{name}`, `{{` and `}}` for braces), split; or a problem. */
export type TextPart = { text: string } | { name: string };

export function parseTextTemplate(
  template: string,
  names: readonly string[],
): { parts: TextPart[] } | { problem: string } {
  const parts: TextPart[] = [];
  let text = "";
  let i = 0;
  while (i < template.length) {
    const c = template[i] as string;
    if (c === "{" && template[i + 1] === "{") {
      text += "{";
      i += 2;
    } else if (c === "}" && template[i + 1] === "}") {
      text += "}";
      i += 2;
    } else if (c === "}") {
      return { problem: `"}" at character ${i + 1} has no "{" (write "}}" for a brace)` };
    } else if (c === "{") {
      const close = template.indexOf("}", i);
      if (close === -1)
        return { problem: `"{" at character ${i + 1} is not closed (write "{{" for a brace)` };
      const name = template.slice(i + 1, close);
      if (!names.includes(name))
        return { problem: `{${name}} is not one of ${names.map((n) => `{${n}}`).join(", ")}` };
      if (text !== "") parts.push({ text });
      text = "";
      parts.push({ name });
      i = close + 1;
    } else {
      text += c;
      i++;
    }
  }
  if (text !== "") parts.push({ text });
  return { parts };
}

export function renderText(parts: readonly TextPart[], values: Readonly<Record<string, string>>): string {
  let out = "";
  for (const p of parts) out += "text" in p ? p.text : (values[p.name] as string);
  return out;
}
