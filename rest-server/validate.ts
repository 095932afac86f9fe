/**
 * Request validation: TypeBox schemas checked with no coercion and no stripping, first error reported with
 * a stable code and the field's path in dotted form (`resources.ram`, `dependencies[2].bundle`). Before any
 * schema, every string and key of a body is checked for what no layer below can hold (NUL, lone surrogates).
 */
import type { Static, TSchema } from "@sinclair/typebox";
import { TypeCompiler } from "@sinclair/typebox/compiler";
import { Value, ValueErrorType } from "@sinclair/typebox/value";
import { DispatchCloudError } from "../lib/errors.ts";
import { hasLoneSurrogate } from "../lib/text-limits.ts";

/** Bodies nest a few levels; anything deeper is junk and is refused before any recursive walk. */
const MAX_DEPTH = 16;

/** `/dependencies/2/bundle` -> `dependencies[2].bundle`; `/env/A.B` -> `env["A.B"]`. */
export function pointerToPath(pointer: string): string {
  if (pointer === "") return "";
  let out = "";
  for (const raw of pointer.slice(1).split("/")) {
    const seg = raw.replace(/~1/g, "/").replace(/~0/g, "~");
    if (/^(0|[1-9]\d*)$/.test(seg)) out += `[${seg}]`;
    else if (/^[A-Za-z_$][A-Za-z0-9_$]*$/.test(seg)) out += out === "" ? seg : `.${seg}`;
    else out += `[${JSON.stringify(seg)}]`;
  }
  return out;
}

/** Joins a dotted path and a child key or index. */
export function childPath(parent: string, key: string | number): string {
  if (typeof key === "number") return `${parent}[${key}]`;
  if (/^[A-Za-z_$][A-Za-z0-9_$]*$/.test(key)) return parent === "" ? key : `${parent}.${key}`;
  return `${parent}[${JSON.stringify(key)}]`;
}

export function invalidBody(path: string, message: string): DispatchCloudError {
  const where = path === "" ? "the body" : path;
  return new DispatchCloudError("request.invalid_body", `${where}: ${message}`, path === "" ? {} : { path });
}

const LONE_SURROGATE_MESSAGE =
  "must not contain a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape): UTF-8 cannot hold it";

/**
 * Refuses what no schema here would accept and what could hurt the layers below: nesting deeper than
 * MAX_DEPTH, `__proto__` keys, NUL characters (PostgreSQL text and jsonb cannot hold them), and lone
 * surrogates (UTF-8 cannot: the database would store U+FFFD instead, and nothing may be coerced).
 */
export function checkJsonShape(value: unknown): void {
  // Paths are built only for the error: a body may hold 10,000 strings (find-missing), and a path string per
  // element was most of this walk's cost.
  type Item = { v: unknown; parent: Item | null; key: string | number; depth: number };
  const pathOf = (it: Item): string => (it.parent === null ? "" : childPath(pathOf(it.parent), it.key));
  const stack: Item[] = [{ v: value, parent: null, key: "", depth: 0 }];
  while (stack.length > 0) {
    const it = stack.pop()!;
    const v = it.v;
    if (typeof v === "string") {
      if (v.includes("\u0000")) throw invalidBody(pathOf(it), "must not contain NUL characters");
      if (hasLoneSurrogate(v)) throw invalidBody(pathOf(it), LONE_SURROGATE_MESSAGE);
      continue;
    }
    if (v === null || typeof v !== "object") continue;
    if (it.depth >= MAX_DEPTH) throw invalidBody(pathOf(it), `is nested more than ${MAX_DEPTH} levels deep`);
    const depth = it.depth + 1;
    if (Array.isArray(v)) {
      for (let i = 0; i < v.length; i++) {
        const item: unknown = v[i];
        // Numbers, booleans and null need no look: no item for them.
        if (typeof item === "string" || (typeof item === "object" && item !== null))
          stack.push({ v: item, parent: it, key: i, depth });
      }
      continue;
    }
    for (const [key, item] of Object.entries(v)) {
      if (key === "__proto__" || key.includes("\u0000") || hasLoneSurrogate(key)) {
        throw invalidBody(childPath(pathOf(it), key), "is not an allowed field name");
      }
      stack.push({ v: item, parent: it, key, depth });
    }
  }
}

/** Fills defaults (in place) and checks `value` against `schema`; throws the first problem found. */
export function validate<S extends TSchema>(schema: S, value: unknown): Static<S> {
  checkJsonShape(value);
  const filled: unknown = Value.Default(schema, value);
  // The compiled check first (one pass, no allocation); the errors walk only for a body that fails it.
  if (checkerOf(schema)(filled)) return filled as Static<S>;
  for (const error of Value.Errors(schema, filled)) {
    const path = pointerToPath(error.path);
    if (error.type === ValueErrorType.ObjectAdditionalProperties) {
      throw new DispatchCloudError("request.unknown_field", `unknown field ${path}`, { path });
    }
    const custom = (error.schema as { errorMessage?: unknown }).errorMessage;
    const message = typeof custom === "string" ? custom : lowerFirst(error.message);
    throw invalidBody(path, message);
  }
  throw invalidBody("", "does not match the expected shape");
}

const checkers = new WeakMap<TSchema, (value: unknown) => boolean>();

/** The schema compiled to a check function (once per schema); Value.Check where it cannot be compiled. */
function checkerOf(schema: TSchema): (value: unknown) => boolean {
  let check = checkers.get(schema);
  if (check === undefined) {
    try {
      const compiled = TypeCompiler.Compile(schema);
      check = (value) => compiled.Check(value);
    } catch {
      check = (value) => Value.Check(schema, value);
    }
    checkers.set(schema, check);
  }
  return check;
}

function lowerFirst(s: string): string {
  return s.charAt(0).toLowerCase() + s.slice(1);
}
