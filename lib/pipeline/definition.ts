/**
 * A pipeline definition (docs/pipelines.md): apps, each with a job-id template of typed fields, a bundle template,
 * autofill values, dependency groups and valid_if_or. YAML for people, the same structure as JSON on the wire;
 * both are checked here, every problem named by its key path (`apps.train.depends_on.by_client[1].date`).
 * The result is plain JSON (it may be stored and read back as it is).
 */
import { parse as parseYaml, YAMLParseError } from "yaml";
import { DispatchCloudError } from "../errors.ts";
import {
  APP_NAME_RE,
  expandRange,
  FIELD_NAME_RE,
  FIELD_TYPES,
  type FieldType,
  type FieldValue,
  formatValue,
  GROUP_NAME_RE,
  JOB_ID_RE,
  MAX_VALUES,
  normaliseValue,
  parseJobIdTemplate,
  parseTextTemplate,
  RESERVED_NAMES,
  type Segment,
  splitJobId,
  templateFields,
} from "./fields.ts";

export interface FieldSpec {
  type: FieldType;
}

/** A bundle as POST /api/v1/bundles takes it, minus dependencies; text may use `{field}`, `{app_name}`, `{job_id}`. */
export interface BundleTemplate {
  image: string;
  command: string[];
  env?: Record<string, string>;
  resources?: unknown;
  limits?: unknown;
  name?: string;
}

/** One clause: parents in `apps`, either the literal `jobIds` or the jobs the fields select. */
export interface DependencyClause {
  apps: string[];
  jobIds?: string[];
  fields: Record<string, FieldValue[] | "all">;
}

export interface DependencyGroup {
  name: string;
  /** Every clause must match (AND). */
  clauses: DependencyClause[];
}

export interface AppDefinition {
  name: string;
  /** The job-id template, e.g. `{date}_{client}`. */
  jobId: string;
  fieldNames: string[];
  bundle: BundleTemplate;
  /** Bundles tried for one job before it is failed (default 1). */
  maxAttempts: number;
  autofill: Record<string, FieldValue[]>;
  /** Groups are alternatives (OR); every group that matches a job gives it parents (docs/pipelines.md). */
  dependsOn: { groups: DependencyGroup[] } | null;
  validIfOr: Record<string, FieldValue[]> | null;
}

export interface PipelineDefinition {
  name: string;
  fields: Record<string, FieldSpec>;
  apps: Record<string, AppDefinition>;
}

export interface PipelineProblem {
  path: string;
  message: string;
}

export const PIPELINE_NAME_RE = APP_NAME_RE;
export const MAX_APPS = 1000;
export const MAX_ATTEMPTS = 10;
export const DEFAULT_GROUP = "default";

/** YAML text -> validated definition; throws pipeline.invalid naming the first problem's key path. */
export function parsePipelineYaml(text: string): PipelineDefinition {
  return validatePipeline(parseYamlText(text));
}

/** The value a YAML text holds, or pipeline.invalid saying where the YAML is wrong. */
export function parseYamlText(text: string): unknown {
  try {
    return parseYaml(text, { prettyErrors: true, uniqueKeys: true });
  } catch (err) {
    if (err instanceof YAMLParseError) {
      const line = err.linePos?.[0];
      const where = line === undefined ? "" : `line ${line.line}, column ${line.col}: `;
      throw new DispatchCloudError(
        "pipeline.invalid",
        `not valid YAML: ${where}${(err.message.split("\n")[0] ?? "").replace(/ at line \d+, column \d+:?$/, "")}`,
        {
          path: "",
          cause: err,
        },
      );
    }
    throw err;
  }
}

/** A definition given as JSON (a request body): validated, or pipeline.invalid naming the first problem. */
export function validatePipeline(value: unknown, pathPrefix = ""): PipelineDefinition {
  const { definition, problems } = check(value, pathPrefix);
  const first = problems[0];
  if (first !== undefined) {
    const more =
      problems.length > 1
        ? ` (and ${problems.length - 1} more problem${problems.length > 2 ? "s" : ""})`
        : "";
    const at = first.path === "" ? "" : `${first.path}: `;
    throw new DispatchCloudError("pipeline.invalid", `${at}${first.message}${more}`, { path: first.path });
  }
  return definition as PipelineDefinition;
}

/** Every problem of a definition (for `pipeline check`); empty when it is valid. */
export function checkPipeline(value: unknown): PipelineProblem[] {
  return check(value, "").problems;
}

// ---------------------------------------------------------------------------------------------------------------

type Obj = Record<string, unknown>;

function isObj(v: unknown): v is Obj {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function join(path: string, key: string): string {
  return path === "" ? key : `${path}.${key}`;
}

function describe(v: unknown): string {
  if (v === null) return "null";
  if (Array.isArray(v)) return "a list";
  return typeof v === "object" ? "a mapping" : `${typeof v} ${JSON.stringify(v)}`;
}

function editDistance(a: string, b: string): number {
  let prev = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const cur = [i];
    for (let j = 1; j <= b.length; j++)
      cur[j] = Math.min(
        (prev[j] as number) + 1,
        (cur[j - 1] as number) + 1,
        (prev[j - 1] as number) + (a[i - 1] === b[j - 1] ? 0 : 1),
      );
    prev = cur;
  }
  return prev[b.length] as number;
}

function suggest(word: string, candidates: readonly string[]): string {
  const norm = (s: string) => s.toLowerCase().replace(/[_-]/g, "");
  let best: string | undefined;
  let bestD = Number.POSITIVE_INFINITY;
  for (const c of candidates) {
    const d = editDistance(norm(word), norm(c));
    if (d < bestD) {
      best = c;
      bestD = d;
    }
  }
  if (best !== undefined && bestD <= Math.max(2, Math.floor(word.length / 3)))
    return `; did you mean ${best}?`;
  return candidates.length > 0 ? ` (known: ${candidates.join(", ")})` : "";
}

class Checker {
  readonly problems: PipelineProblem[] = [];
  problem(path: string, message: string): void {
    this.problems.push({ path, message });
  }
  /** Reports keys of `obj` outside `known`. */
  keys(obj: Obj, known: readonly string[], path: string): void {
    for (const k of Object.keys(obj))
      if (!known.includes(k))
        this.problem(join(path, k), `unknown key ${JSON.stringify(k)}${suggest(k, known)}`);
  }
}

const TOP_KEYS = ["name", "description", "job_id", "fields", "apps"];
const APP_KEYS = [
  "description",
  "job_id",
  "bundle",
  "max_attempts",
  "autofill_values",
  "depends_on",
  "valid_if_or",
];
const BUNDLE_KEYS = ["image", "command", "env", "resources", "limits", "name"];
const ENV_NAME = /^[A-Za-z_][A-Za-z0-9_]*$/;

interface AppDraft {
  def: AppDefinition;
  path: string;
  segments: Segment[] | undefined;
  /** The raw depends_on, checked once every app's template is known. */
  dependsOn: unknown;
}

function check(
  value: unknown,
  prefix: string,
): { definition?: PipelineDefinition; problems: PipelineProblem[] } {
  const c = new Checker();
  if (!isObj(value)) {
    c.problem(
      prefix,
      `a pipeline definition must be a mapping with name, fields and apps, not ${describe(value)}`,
    );
    return { problems: c.problems };
  }
  c.keys(value, TOP_KEYS, prefix);

  let name = "";
  if (typeof value["name"] !== "string" || !PIPELINE_NAME_RE.test(value["name"]))
    c.problem(
      join(prefix, "name"),
      value["name"] === undefined
        ? "missing: the pipeline's name (a letter, then up to 49 of A-Z a-z 0-9 _ -)"
        : `must be a letter, then up to 49 of A-Z a-z 0-9 _ - (got ${describe(value["name"])})`,
    );
  else name = value["name"];
  if (value["description"] !== undefined && typeof value["description"] !== "string")
    c.problem(join(prefix, "description"), "must be text");

  const fields = checkFields(c, value["fields"], join(prefix, "fields"));
  const types: Record<string, FieldType> = Object.fromEntries(
    Object.entries(fields).map(([k, f]) => [k, f.type]),
  );

  let defaultTemplate: string | undefined;
  if (value["job_id"] !== undefined) {
    if (typeof value["job_id"] !== "string")
      c.problem(join(prefix, "job_id"), "must be a job-id template such as {date}_{client}");
    else {
      const t = parseJobIdTemplate(value["job_id"], types);
      if ("problem" in t) c.problem(join(prefix, "job_id"), t.problem);
      else defaultTemplate = value["job_id"];
    }
  }

  const appsPath = join(prefix, "apps");
  const rawApps = value["apps"];
  const drafts = new Map<string, AppDraft>();
  if (!isObj(rawApps) || Object.keys(rawApps).length === 0) {
    c.problem(
      appsPath,
      rawApps === undefined
        ? "missing: a mapping of app names to apps"
        : "must be a mapping of app names to apps (at least one)",
    );
  } else {
    if (Object.keys(rawApps).length > MAX_APPS) c.problem(appsPath, `at most ${MAX_APPS} apps`);
    for (const [appName, rawApp] of Object.entries(rawApps)) {
      const path = join(appsPath, appName);
      if (!APP_NAME_RE.test(appName)) {
        c.problem(path, "an app name is a letter, then up to 49 of A-Z a-z 0-9 _ -");
        continue;
      }
      const draft = checkApp(c, appName, rawApp, path, types, defaultTemplate);
      if (draft !== undefined) drafts.set(appName, draft);
    }
    for (const draft of drafts.values()) {
      if (draft.dependsOn === undefined || draft.dependsOn === null) continue;
      draft.def.dependsOn = checkDependsOn(c, draft, drafts, types, join(draft.path, "depends_on"));
    }
    checkCycles(c, drafts);
  }
  if (c.problems.length > 0) return { problems: c.problems };
  const apps: Record<string, AppDefinition> = {};
  for (const [k, d] of drafts) apps[k] = d.def;
  return { definition: { name, fields, apps }, problems: [] };
}

function checkFields(c: Checker, raw: unknown, path: string): Record<string, FieldSpec> {
  const out: Record<string, FieldSpec> = {};
  if (raw === undefined) return out;
  if (!isObj(raw)) {
    c.problem(path, `must be a mapping of field names to types (${FIELD_TYPES.join(", ")})`);
    return out;
  }
  for (const [name, spec] of Object.entries(raw)) {
    const p = join(path, name);
    if (!FIELD_NAME_RE.test(name)) {
      c.problem(p, "a field name is a lower-case letter, then up to 31 of a-z 0-9 _");
      continue;
    }
    if ((RESERVED_NAMES as readonly string[]).includes(name)) {
      c.problem(p, `${name} is reserved (bundle templates use {${name}}); choose another field name`);
      continue;
    }
    let type: unknown = spec;
    if (isObj(spec)) {
      c.keys(spec, ["type", "description"], p);
      type = spec["type"];
    }
    if (typeof type !== "string" || !(FIELD_TYPES as readonly string[]).includes(type)) {
      c.problem(
        isObj(spec) ? join(p, "type") : p,
        `must be one of ${FIELD_TYPES.join(", ")} (got ${describe(type)})`,
      );
      continue;
    }
    out[name] = { type: type as FieldType };
  }
  return out;
}

/** A list of values, or a `min:max[:step]` range, of a field's type. */
function checkValues(c: Checker, raw: unknown, type: FieldType, path: string): FieldValue[] | undefined {
  if (typeof raw === "string" && raw.includes(":")) {
    const r = expandRange(type, raw);
    if ("problem" in r) {
      c.problem(path, r.problem);
      return undefined;
    }
    return r.values;
  }
  if (!Array.isArray(raw)) {
    c.problem(
      path,
      `must be a list of values${type === "str" ? "" : " or a range min:max[:step]"} (got ${describe(raw)})`,
    );
    return undefined;
  }
  if (raw.length === 0) {
    c.problem(path, "must not be empty");
    return undefined;
  }
  if (raw.length > MAX_VALUES) {
    c.problem(path, `at most ${MAX_VALUES} values`);
    return undefined;
  }
  const out: FieldValue[] = [];
  const seen = new Set<string>();
  let ok = true;
  raw.forEach((v, i) => {
    const n = normaliseValue(type, v);
    if ("problem" in n) {
      c.problem(`${path}[${i}]`, n.problem);
      ok = false;
    } else if (!seen.has(formatValue(n.value))) {
      seen.add(formatValue(n.value));
      out.push(n.value);
    }
  });
  return ok ? out : undefined;
}

/** A mapping of this app's fields to values (autofill_values, valid_if_or). */
function checkFieldValues(
  c: Checker,
  raw: unknown,
  fieldNames: readonly string[],
  types: Readonly<Record<string, FieldType>>,
  path: string,
): Record<string, FieldValue[]> {
  const out: Record<string, FieldValue[]> = {};
  if (!isObj(raw)) {
    c.problem(path, "must be a mapping of this app's job-id fields to lists of values or ranges");
    return out;
  }
  for (const [field, values] of Object.entries(raw)) {
    const p = join(path, field);
    if (!fieldNames.includes(field)) {
      c.problem(
        p,
        `${field} is not a field of this app's job id (${fieldNames.join(", ") || "it has none"})${suggest(field, fieldNames)}`,
      );
      continue;
    }
    const v = checkValues(c, values, types[field] as FieldType, p);
    if (v !== undefined) out[field] = v;
  }
  return out;
}

function checkApp(
  c: Checker,
  name: string,
  raw: unknown,
  path: string,
  types: Readonly<Record<string, FieldType>>,
  defaultTemplate: string | undefined,
): AppDraft | undefined {
  if (!isObj(raw)) {
    c.problem(path, `an app must be a mapping with job_id and bundle (got ${describe(raw)})`);
    return undefined;
  }
  c.keys(raw, APP_KEYS, path);
  if (raw["description"] !== undefined && typeof raw["description"] !== "string")
    c.problem(join(path, "description"), "must be text");
  let template = defaultTemplate;
  let segments: Segment[] | undefined;
  if (raw["job_id"] !== undefined) {
    if (typeof raw["job_id"] !== "string") {
      c.problem(join(path, "job_id"), "must be a job-id template such as {date}_{client}");
      template = undefined;
    } else {
      const t = parseJobIdTemplate(raw["job_id"], types);
      if ("problem" in t) c.problem(join(path, "job_id"), t.problem);
      else {
        template = raw["job_id"];
        segments = t.segments;
      }
    }
  } else if (template === undefined) {
    c.problem(
      join(path, "job_id"),
      "missing: a job-id template such as {date}_{client} (or a top-level job_id)",
    );
  } else {
    const t = parseJobIdTemplate(template, types);
    if (!("problem" in t)) segments = t.segments;
  }
  const fieldNames = segments === undefined ? [] : templateFields(segments);

  let maxAttempts = 1;
  if (raw["max_attempts"] !== undefined) {
    const m = raw["max_attempts"];
    if (typeof m !== "number" || !Number.isInteger(m) || m < 1 || m > MAX_ATTEMPTS)
      c.problem(join(path, "max_attempts"), `must be a whole number from 1 to ${MAX_ATTEMPTS}`);
    else maxAttempts = m;
  }

  const autofill =
    raw["autofill_values"] === undefined || segments === undefined
      ? {}
      : checkFieldValues(c, raw["autofill_values"], fieldNames, types, join(path, "autofill_values"));
  let validIfOr: Record<string, FieldValue[]> | null = null;
  if (raw["valid_if_or"] !== undefined && segments !== undefined) {
    validIfOr = checkFieldValues(c, raw["valid_if_or"], fieldNames, types, join(path, "valid_if_or"));
    if (Object.keys(validIfOr).length === 0 && isObj(raw["valid_if_or"]))
      c.problem(join(path, "valid_if_or"), "must name at least one field");
  }

  const bundle = checkBundle(
    c,
    raw["bundle"],
    join(path, "bundle"),
    segments === undefined ? undefined : fieldNames,
  );
  // A draft even when something is wrong (then it is never returned), so other apps may name this one.
  return {
    def: {
      name,
      jobId: segments === undefined ? "" : (template as string),
      fieldNames,
      bundle: bundle ?? { image: "", command: [] },
      maxAttempts,
      autofill,
      dependsOn: null,
      validIfOr,
    },
    path,
    segments,
    dependsOn: raw["depends_on"],
  };
}

function checkText(
  c: Checker,
  raw: unknown,
  path: string,
  names: readonly string[] | undefined,
  what: string,
): string | undefined {
  if (typeof raw !== "string") {
    c.problem(path, `must be ${what} (got ${describe(raw)})`);
    return undefined;
  }
  if (names !== undefined) {
    const t = parseTextTemplate(raw, names);
    if ("problem" in t) {
      c.problem(path, t.problem);
      return undefined;
    }
  }
  return raw;
}

function checkBundle(
  c: Checker,
  raw: unknown,
  path: string,
  fieldNames: readonly string[] | undefined,
): BundleTemplate | undefined {
  if (!isObj(raw)) {
    c.problem(
      path,
      raw === undefined
        ? "missing: the bundle each job runs (image, command, ...)"
        : `must be a mapping (got ${describe(raw)})`,
    );
    return undefined;
  }
  c.keys(raw, BUNDLE_KEYS, path);
  const names = fieldNames === undefined ? undefined : [...fieldNames, ...RESERVED_NAMES];
  const image = checkText(c, raw["image"], join(path, "image"), names, "an image reference");
  if (image !== undefined && image.trim() === "") c.problem(join(path, "image"), "must not be empty");
  const command: string[] = [];
  const rawCommand = raw["command"];
  if (!Array.isArray(rawCommand) || rawCommand.length === 0)
    c.problem(join(path, "command"), `must be a non-empty list of strings (got ${describe(rawCommand)})`);
  else
    rawCommand.forEach((a, i) => {
      const t = checkText(
        c,
        typeof a === "number" ? String(a) : a,
        `${join(path, "command")}[${i}]`,
        names,
        "a string",
      );
      if (t !== undefined) command.push(t);
    });
  const bundle: BundleTemplate = { image: image ?? "", command };
  if (raw["env"] !== undefined) {
    const env: Record<string, string> = {};
    if (!isObj(raw["env"])) c.problem(join(path, "env"), "must be a mapping of variable names to strings");
    else
      for (const [k, v] of Object.entries(raw["env"])) {
        const p = join(join(path, "env"), k);
        if (!ENV_NAME.test(k))
          c.problem(p, "an environment variable name is A-Z a-z 0-9 _, not starting with a digit");
        const t = checkText(
          c,
          typeof v === "number" || typeof v === "boolean" ? String(v) : v,
          p,
          names,
          "a string",
        );
        if (t !== undefined) env[k] = t;
      }
    bundle.env = env;
  }
  for (const key of ["resources", "limits"] as const) {
    if (raw[key] === undefined) continue;
    if (!isObj(raw[key]))
      c.problem(join(path, key), `must be a mapping, as POST /api/v1/bundles takes ${key}`);
    else bundle[key] = raw[key];
  }
  if (raw["name"] !== undefined) {
    const n = checkText(c, raw["name"], join(path, "name"), names, "text");
    if (n !== undefined) bundle.name = n;
  }
  return bundle;
}

/** depends_on: one clause (a mapping with app_name), a list of clauses (AND), or named groups (OR). */
function checkDependsOn(
  c: Checker,
  child: AppDraft,
  apps: ReadonlyMap<string, AppDraft>,
  types: Readonly<Record<string, FieldType>>,
  path: string,
): { groups: DependencyGroup[] } | null {
  const raw = child.dependsOn;
  const shapes: { name: string; path: string; clauses: unknown[]; list: boolean }[] = [];
  if (Array.isArray(raw)) shapes.push({ name: DEFAULT_GROUP, path, clauses: raw, list: true });
  else if (isObj(raw) && "app_name" in raw)
    shapes.push({ name: DEFAULT_GROUP, path, clauses: [raw], list: false });
  else if (isObj(raw)) {
    for (const [g, v] of Object.entries(raw)) {
      const p = join(path, g);
      if (!GROUP_NAME_RE.test(g)) {
        c.problem(p, "a dependency group's name is a letter, then up to 49 of A-Z a-z 0-9 _ -");
        continue;
      }
      if (Array.isArray(v)) shapes.push({ name: g, path: p, clauses: v, list: true });
      else shapes.push({ name: g, path: p, clauses: [v], list: false });
    }
  } else {
    c.problem(
      path,
      `must be a clause (a mapping with app_name), a list of clauses, or a mapping of group names to those (got ${describe(raw)})`,
    );
    return null;
  }
  if (shapes.length === 0) c.problem(path, "must name at least one dependency group");
  const groups: DependencyGroup[] = [];
  for (const shape of shapes) {
    if (shape.clauses.length === 0) {
      c.problem(shape.path, "must hold at least one clause");
      continue;
    }
    const clauses: DependencyClause[] = [];
    shape.clauses.forEach((rawClause, i) => {
      const clause = checkClause(
        c,
        child,
        rawClause,
        apps,
        types,
        shape.list ? `${shape.path}[${i}]` : shape.path,
      );
      if (clause !== undefined) clauses.push(clause);
    });
    groups.push({ name: shape.name, clauses });
  }
  return { groups };
}

function checkClause(
  c: Checker,
  child: AppDraft,
  raw: unknown,
  apps: ReadonlyMap<string, AppDraft>,
  types: Readonly<Record<string, FieldType>>,
  path: string,
): DependencyClause | undefined {
  if (!isObj(raw)) {
    c.problem(path, `a clause must be a mapping with app_name (got ${describe(raw)})`);
    return undefined;
  }
  const before = c.problems.length;
  const appsPath = join(path, "app_name");
  const rawApps = typeof raw["app_name"] === "string" ? [raw["app_name"]] : raw["app_name"];
  const parents: AppDraft[] = [];
  if (!Array.isArray(rawApps) || rawApps.length === 0)
    c.problem(
      appsPath,
      rawApps === undefined ? "missing: the parent apps" : "must be an app name or a non-empty list of them",
    );
  else
    rawApps.forEach((a, i) => {
      const p = Array.isArray(raw["app_name"]) ? `${appsPath}[${i}]` : appsPath;
      const parent = typeof a === "string" ? apps.get(a) : undefined;
      if (parent === undefined)
        c.problem(
          p,
          `${describe(a)} is not an app of this pipeline${typeof a === "string" ? suggest(a, [...apps.keys()]) : ""}`,
        );
      else if (!parents.includes(parent)) parents.push(parent);
    });

  // An app whose job-id template is wrong (already reported) cannot be checked against: say nothing more.
  if (child.segments === undefined || parents.some((p) => p.segments === undefined)) return undefined;

  let jobIds: string[] | undefined;
  if (raw["job_id"] !== undefined) {
    const p = join(path, "job_id");
    const list = typeof raw["job_id"] === "string" ? [raw["job_id"]] : raw["job_id"];
    if (!Array.isArray(list) || list.length === 0)
      c.problem(p, "must be a job id or a non-empty list of them");
    else if (list.length > MAX_VALUES) c.problem(p, `at most ${MAX_VALUES} job ids`);
    else {
      jobIds = [];
      list.forEach((j, i) => {
        const jp = Array.isArray(raw["job_id"]) ? `${p}[${i}]` : p;
        if (typeof j !== "string" || !JOB_ID_RE.test(j)) {
          c.problem(jp, `${describe(j)} is not a job id (1-100 of A-Z a-z 0-9 . _ -)`);
          return;
        }
        for (const parent of parents) {
          const problem = jobIdProblem(parent, types, j);
          if (problem !== undefined) c.problem(jp, `${j} is not a job of ${parent.def.name}: ${problem}`);
        }
        if (!jobIds?.includes(j)) jobIds?.push(j);
      });
    }
  }

  const fields: Record<string, FieldValue[] | "all"> = {};
  const childFields = child.def.fieldNames;
  for (const [key, value] of Object.entries(raw)) {
    if (key === "app_name" || key === "job_id") continue;
    const p = join(path, key);
    const type = types[key];
    if (type === undefined) {
      c.problem(
        p,
        `unknown key ${JSON.stringify(key)}: neither app_name, job_id nor a declared field${suggest(key, ["app_name", "job_id", ...Object.keys(types)])}`,
      );
      continue;
    }
    const inParents = parents.filter((a) => a.def.fieldNames.includes(key));
    if (!childFields.includes(key) && inParents.length === 0) {
      c.problem(
        p,
        `${key} is in neither ${child.def.name}'s job id nor that of any app in app_name, so it selects nothing`,
      );
      continue;
    }
    if (value === "all") {
      if (jobIds !== undefined) {
        c.problem(
          p,
          '"all" takes the parents\' autofill_values; with job_id the parents are given, so list the values',
        );
        continue;
      }
      if (inParents.length === 0) {
        c.problem(
          p,
          `"all" means all of a parent app's ${key} values, but no app in app_name has ${key} in its job id`,
        );
        continue;
      }
      for (const a of inParents)
        if (a.def.autofill[key] === undefined)
          c.problem(p, `"all" takes ${a.def.name}'s autofill_values.${key}, which it does not have`);
      fields[key] = "all";
      continue;
    }
    if (jobIds !== undefined && !childFields.includes(key)) {
      c.problem(
        p,
        `with job_id, the other keys select the child's jobs, and ${key} is not in ${child.def.name}'s job id`,
      );
      continue;
    }
    const values = checkValues(c, value, type, p);
    if (values === undefined) continue;
    if (jobIds === undefined)
      for (const a of inParents) {
        const allowed = a.def.autofill[key];
        if (allowed === undefined) continue;
        const set = new Set(allowed.map(formatValue));
        const outside = (v: FieldValue, at: string) => {
          if (!set.has(formatValue(v)))
            c.problem(
              at,
              `${v} is not among ${a.def.name}'s autofill_values.${key}, so that parent job could never exist`,
            );
        };
        if (Array.isArray(value))
          value.forEach((x, i) => {
            const n = normaliseValue(type, x);
            if ("value" in n) outside(n.value, `${p}[${i}]`);
          });
        else for (const v of values) outside(v, p);
      }
    fields[key] = values;
  }
  if (c.problems.length > before) return undefined;

  // Every parent job must be computable from a child job, and every child job from a parent job.
  for (const parent of parents) {
    const pName = parent.def.name;
    if (jobIds === undefined)
      for (const f of parent.def.fieldNames)
        if (fields[f] === undefined && !childFields.includes(f) && parent.def.autofill[f] === undefined)
          c.problem(
            path,
            `${pName}'s job id has {${f}}, which ${child.def.name}'s job id lacks, this clause does not give, and ${pName} has no autofill_values for: the parents of a ${child.def.name} job cannot be listed`,
          );
    // A value the parent takes from the child must be one of the parent's: else the child would silently
    // match nothing (and run without that parent).
    if (jobIds === undefined)
      for (const f of parent.def.fieldNames) {
        const limit = parent.def.autofill[f];
        if (fields[f] !== undefined || !childFields.includes(f) || limit === undefined) continue;
        const own = child.def.autofill[f];
        const allowed = new Set(limit.map(formatValue));
        const outside = own?.find((v) => !allowed.has(formatValue(v)));
        if (own === undefined)
          c.problem(
            path,
            `${pName} takes {${f}} from ${child.def.name}'s job id, and ${pName}'s autofill_values.${f} limit it: give ${child.def.name} autofill_values.${f} within them (or give ${f} in this clause)`,
          );
        else if (outside !== undefined)
          c.problem(
            join(join(child.path, "autofill_values"), f),
            `${outside} is not among ${pName}'s autofill_values.${f}, and ${pName} takes {${f}} from ${child.def.name}'s job id (${path})`,
          );
      }
    for (const f of childFields)
      if (
        fields[f] === undefined &&
        !parent.def.fieldNames.includes(f) &&
        child.def.autofill[f] === undefined
      )
        c.problem(
          path,
          `${child.def.name}'s job id has {${f}}, which ${pName}'s job id lacks, this clause does not give, and ${child.def.name} has no autofill_values for: the children of a ${pName} job cannot be listed`,
        );
    if (jobIds === undefined) {
      let count = 1;
      for (const f of parent.def.fieldNames) {
        const given = fields[f];
        const n =
          given === "all" || (given === undefined && !childFields.includes(f))
            ? (parent.def.autofill[f]?.length ?? 1)
            : given === undefined
              ? 1
              : given.length;
        count *= n;
      }
      if (count > MAX_VALUES)
        c.problem(
          path,
          `gives each ${child.def.name} job ${count} parents of ${pName}; at most ${MAX_VALUES}`,
        );
    }
    // The children of one parent job are listed from the same rules the other way round.
    let children = 1;
    for (const f of childFields) {
      const given = fields[f];
      let n = 1;
      if (Array.isArray(given)) n = given.length;
      else if (given === "all")
        n = parent.def.fieldNames.includes(f)
          ? (parent.def.autofill[f]?.length ?? 1)
          : parents.reduce((sum, a) => sum + (a.def.autofill[f]?.length ?? 0), 0);
      else if (!parent.def.fieldNames.includes(f)) n = child.def.autofill[f]?.length ?? 1;
      children *= n;
    }
    if (children > MAX_VALUES)
      c.problem(
        path,
        `gives each ${pName} job ${children} children of ${child.def.name}; at most ${MAX_VALUES}`,
      );
  }
  if (c.problems.length > before) return undefined;
  return { apps: parents.map((p) => p.def.name), ...(jobIds === undefined ? {} : { jobIds }), fields };
}

/** Why `jobId` is not a job of `app`, or undefined. */
function jobIdProblem(
  app: AppDraft,
  types: Readonly<Record<string, FieldType>>,
  jobId: string,
): string | undefined {
  if (app.segments === undefined) return undefined;
  const parsed = splitJobId(app.segments, types, jobId);
  if (parsed === undefined) return `it does not match the template ${app.def.jobId}`;
  for (const [f, allowed] of Object.entries(app.def.autofill))
    if (!allowed.some((v) => formatValue(v) === formatValue(parsed[f] as FieldValue)))
      return `${f} ${parsed[f]} is not among its autofill_values.${f}`;
  return undefined;
}

function checkCycles(c: Checker, apps: ReadonlyMap<string, AppDraft>): void {
  const state = new Map<string, "visiting" | "done">();
  const stack: string[] = [];
  const reported = new Set<string>();
  const parentsOf = (name: string): string[] =>
    apps.get(name)?.def.dependsOn?.groups.flatMap((g) => g.clauses.flatMap((cl) => cl.apps)) ?? [];
  const visit = (name: string): void => {
    state.set(name, "visiting");
    stack.push(name);
    for (const p of new Set(parentsOf(name))) {
      const s = state.get(p);
      if (s === "visiting") {
        const cycle = [...stack.slice(stack.indexOf(p)), p];
        const key = cycle.slice(0, -1).sort().join(",");
        if (!reported.has(key)) {
          reported.add(key);
          c.problem(
            join((apps.get(p) as AppDraft).path, "depends_on"),
            `a cycle of dependencies: ${cycle.join(" -> ")} (each app depends on the next)`,
          );
        }
      } else if (s === undefined) visit(p);
    }
    stack.pop();
    state.set(name, "done");
  };
  for (const name of apps.keys()) if (!state.has(name)) visit(name);
}
