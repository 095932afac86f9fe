/**
 * The jobs of a pipeline as a graph, computed from a validated definition and nothing else (no database):
 * the parents and children of a job, whether valid_if_or skips it, and the bundle it runs. The rules are in
 * docs/pipelines.md ("How parents are found"); in short, for a child job c and a clause of one of its groups,
 * with P an app of the clause:
 *
 *  - the clause matches c when each of the clause's fields that c's job id has holds c's value, and each field
 *    P shares with c (and the clause does not give) holds a value P's autofill_values allow;
 *  - a group matches c when all its clauses match; the parents of c are those of every matching group;
 *  - P's jobs for the clause: the clause's job_id list (those agreeing with c on the fields they share), or the
 *    cross product over P's fields of: the clause's values (or P's autofill_values for "all"), else c's value,
 *    else P's autofill_values.
 *
 * childrenOf is the exact inverse of parentsOf: it lists candidate children from the same rules and keeps those
 * whose parents include the job.
 */
import { DispatchCloudError } from "../errors.ts";
import type { AppDefinition, DependencyClause, PipelineDefinition } from "./definition.ts";
import {
  type FieldType,
  type FieldValue,
  formatValue,
  JOB_ID_RE,
  joinJobId,
  parseJobIdTemplate,
  parseTextTemplate,
  renderText,
  type Segment,
  splitJobId,
  type TextPart,
} from "./fields.ts";

export interface JobRef {
  app: string;
  jobId: string;
}

type Values = Record<string, FieldValue>;

interface CompiledApp {
  def: AppDefinition;
  segments: Segment[];
  fields: Set<string>;
  autofill: Map<string, Set<string>>;
}

interface ClauseRef {
  child: string;
  groupIndex: number;
  clause: DependencyClause;
}

interface Compiled {
  types: Record<string, FieldType>;
  apps: Map<string, CompiledApp>;
  /** For each app, the clauses (of other apps) that name it as a parent. */
  childClauses: Map<string, ClauseRef[]>;
}

const compiledCache = new WeakMap<PipelineDefinition, Compiled>();

function compile(def: PipelineDefinition): Compiled {
  const cached = compiledCache.get(def);
  if (cached !== undefined) return cached;
  const types: Record<string, FieldType> = {};
  for (const [k, f] of Object.entries(def.fields)) types[k] = f.type;
  const apps = new Map<string, CompiledApp>();
  const childClauses = new Map<string, ClauseRef[]>();
  for (const app of Object.values(def.apps)) {
    const t = parseJobIdTemplate(app.jobId, types);
    if ("problem" in t)
      throw new DispatchCloudError("pipeline.invalid", `apps.${app.name}.job_id: ${t.problem}`, {
        path: `apps.${app.name}.job_id`,
      });
    const autofill = new Map<string, Set<string>>();
    for (const [f, vs] of Object.entries(app.autofill)) autofill.set(f, new Set(vs.map(formatValue)));
    apps.set(app.name, { def: app, segments: t.segments, fields: new Set(app.fieldNames), autofill });
    childClauses.set(app.name, []);
  }
  for (const app of Object.values(def.apps))
    app.dependsOn?.groups.forEach((g, groupIndex) => {
      for (const clause of g.clauses)
        for (const p of clause.apps) childClauses.get(p)?.push({ child: app.name, groupIndex, clause });
    });
  const compiled = { types, apps, childClauses };
  compiledCache.set(def, compiled);
  return compiled;
}

function appOf(c: Compiled, app: string): CompiledApp {
  const a = c.apps.get(app);
  if (a === undefined)
    throw new DispatchCloudError(
      "pipeline.invalid_job_id",
      `the pipeline has no app ${JSON.stringify(app)}`,
      {
        path: "app",
      },
    );
  return a;
}

/** The fields of a job id, or undefined when it is not a job of the app (template or autofill_values). */
function tryParse(c: Compiled, app: CompiledApp, jobId: string): Values | undefined {
  if (!JOB_ID_RE.test(jobId)) return undefined;
  const v = splitJobId(app.segments, c.types, jobId);
  if (v === undefined) return undefined;
  for (const [f, allowed] of app.autofill)
    if (!allowed.has(formatValue(v[f] as FieldValue))) return undefined;
  return v;
}

/** The fields of a job id; pipeline.invalid_job_id when it does not fit the app's template or autofill_values. */
export function parseJobId(
  def: PipelineDefinition,
  app: string,
  jobId: string,
): Record<string, string | number> {
  const c = compile(def);
  const a = appOf(c, app);
  if (!JOB_ID_RE.test(jobId))
    throw new DispatchCloudError(
      "pipeline.invalid_job_id",
      `${JSON.stringify(jobId.slice(0, 120))} is not a job id: 1-100 characters from A-Z a-z 0-9 . _ -`,
      { path: "jobId" },
    );
  const v = splitJobId(a.segments, c.types, jobId);
  if (v === undefined)
    throw new DispatchCloudError(
      "pipeline.invalid_job_id",
      `${JSON.stringify(jobId)} is not a job id of ${app}: it does not fit the template ${a.def.jobId} (${a.def.fieldNames
        .map((f) => `${f}: ${c.types[f]}`)
        .join(", ")})`,
      { path: "jobId" },
    );
  for (const [f, allowed] of a.autofill)
    if (!allowed.has(formatValue(v[f] as FieldValue)))
      throw new DispatchCloudError(
        "pipeline.invalid_job_id",
        `${JSON.stringify(jobId)} is not a job id of ${app}: its ${f} ${v[f]} is not among the app's autofill_values.${f}`,
        { path: "jobId" },
      );
  return v;
}

/** The job id of `fields` (every field of the app's template); the values are not checked. */
export function formatJobId(
  def: PipelineDefinition,
  app: string,
  fields: Record<string, string | number>,
): string {
  const a = appOf(compile(def), app);
  for (const f of a.def.fieldNames)
    if (fields[f] === undefined)
      throw new DispatchCloudError("pipeline.invalid_job_id", `a job id of ${app} needs ${f}`, { path: f });
  return joinJobId(a.segments, fields);
}

/** The values a clause allows a field for parent app P, or undefined when it does not give the field. */
function clauseValues(clause: DependencyClause, p: CompiledApp, field: string): Set<string> | undefined {
  const given = clause.fields[field];
  if (given === undefined) return undefined;
  if (given === "all") return p.autofill.get(field);
  return new Set(given.map(formatValue));
}

const setCache = new WeakMap<FieldValue[], Set<string>>();
function asSet(values: FieldValue[]): Set<string> {
  let s = setCache.get(values);
  if (s === undefined) {
    s = new Set(values.map(formatValue));
    setCache.set(values, s);
  }
  return s;
}

/** Whether a clause matches child job `cv` of app `child` (see the file's comment). */
function clauseMatches(c: Compiled, clause: DependencyClause, child: CompiledApp, cv: Values): boolean {
  for (const pName of clause.apps) {
    const p = c.apps.get(pName) as CompiledApp;
    for (const [field, given] of Object.entries(clause.fields)) {
      if (!child.fields.has(field)) continue;
      const key = formatValue(cv[field] as FieldValue);
      if (given === "all") {
        if (p.fields.has(field) && !(p.autofill.get(field)?.has(key) ?? false)) return false;
      } else if (!asSet(given).has(key)) return false;
    }
    if (clause.jobIds === undefined)
      for (const field of p.fields) {
        if (clause.fields[field] !== undefined || !child.fields.has(field)) continue;
        const allowed = p.autofill.get(field);
        if (allowed !== undefined && !allowed.has(formatValue(cv[field] as FieldValue))) return false;
      }
  }
  return true;
}

function groupMatches(c: Compiled, clauses: DependencyClause[], child: CompiledApp, cv: Values): boolean {
  return clauses.every((cl) => clauseMatches(c, cl, child, cv));
}

/** Calls `emit` with every combination of the per-field choices, in template order. */
function crossProduct(fields: string[], choices: FieldValue[][], emit: (v: Values) => void): void {
  const current: Values = {};
  const walk = (i: number): void => {
    if (i === fields.length) {
      emit({ ...current });
      return;
    }
    for (const v of choices[i] as FieldValue[]) {
      current[fields[i] as string] = v;
      walk(i + 1);
    }
  };
  walk(0);
}

/** The jobs of parent app p that a matching clause gives child job cv. */
function clauseParents(
  c: Compiled,
  clause: DependencyClause,
  p: CompiledApp,
  child: CompiledApp,
  cv: Values,
  emit: (jobId: string) => void,
): void {
  if (clause.jobIds !== undefined) {
    for (const j of clause.jobIds) {
      const pv = tryParse(c, p, j);
      if (pv === undefined) continue; // validation refuses such ids; a stored definition from before is tolerated
      let agrees = true;
      for (const f of p.fields)
        if (
          child.fields.has(f) &&
          clause.fields[f] === undefined &&
          formatValue(pv[f] as FieldValue) !== formatValue(cv[f] as FieldValue)
        )
          agrees = false;
      if (agrees) emit(j);
    }
    return;
  }
  const choices: FieldValue[][] = [];
  for (const f of p.def.fieldNames) {
    const given = clause.fields[f];
    if (given === "all") choices.push(p.def.autofill[f] ?? []);
    else if (given !== undefined) choices.push(given);
    else if (child.fields.has(f)) choices.push([cv[f] as FieldValue]);
    else choices.push(p.def.autofill[f] ?? []);
  }
  crossProduct(p.def.fieldNames, choices, (v) => emit(joinJobId(p.segments, v)));
}

/**
 * The parents of a job: for every dependency group whose clauses all match the job, the parent jobs of each
 * clause; deduplicated, in the order of groups, clauses, apps and values. pipeline.invalid_job_id when the job
 * id is not one of the app's.
 */
export function parentsOf(def: PipelineDefinition, job: JobRef): JobRef[] {
  const c = compile(def);
  const child = appOf(c, job.app);
  const cv = parseJobId(def, job.app, job.jobId);
  const out: JobRef[] = [];
  const seen = new Set<string>();
  for (const group of child.def.dependsOn?.groups ?? []) {
    if (!groupMatches(c, group.clauses, child, cv)) continue;
    for (const clause of group.clauses)
      for (const pName of clause.apps) {
        const p = c.apps.get(pName) as CompiledApp;
        clauseParents(c, clause, p, child, cv, (jobId) => {
          const key = `${pName}\u0000${jobId}`;
          if (seen.has(key)) return;
          seen.add(key);
          out.push({ app: pName, jobId });
        });
      }
  }
  return out;
}

/** Whether parent job pv of app p is among the parents a clause gives child job cv (clause assumed matching). */
function isParentVia(
  clause: DependencyClause,
  p: CompiledApp,
  pJobId: string,
  pv: Values,
  child: CompiledApp,
  cv: Values,
): boolean {
  if (clause.jobIds !== undefined) {
    if (!clause.jobIds.includes(pJobId)) return false;
    for (const f of p.fields)
      if (
        child.fields.has(f) &&
        clause.fields[f] === undefined &&
        formatValue(pv[f] as FieldValue) !== formatValue(cv[f] as FieldValue)
      )
        return false;
    return true;
  }
  for (const f of p.fields) {
    const key = formatValue(pv[f] as FieldValue);
    const given = clauseValues(clause, p, f);
    if (given !== undefined) {
      if (!given.has(key)) return false;
    } else if (child.fields.has(f)) {
      if (key !== formatValue(cv[f] as FieldValue)) return false;
    } else if (!(p.autofill.get(f)?.has(key) ?? false)) return false;
  }
  return true;
}

/**
 * The children of a job: every job whose parentsOf includes it; deduplicated, in the order of apps, groups and
 * clauses. pipeline.invalid_job_id when the job id is not one of the app's.
 */
export function childrenOf(def: PipelineDefinition, job: JobRef): JobRef[] {
  const c = compile(def);
  const parent = appOf(c, job.app);
  const pv = parseJobId(def, job.app, job.jobId);
  const out: JobRef[] = [];
  const seen = new Set<string>();
  for (const ref of c.childClauses.get(job.app) ?? []) {
    const child = c.apps.get(ref.child) as CompiledApp;
    const group = child.def.dependsOn?.groups[ref.groupIndex];
    if (group === undefined) continue;
    const clause = ref.clause;
    // Quick refusals: the parent's own values against the clause.
    if (clause.jobIds !== undefined && !clause.jobIds.includes(job.jobId)) continue;
    if (clause.jobIds === undefined) {
      let possible = true;
      for (const f of parent.fields) {
        const given = clauseValues(clause, parent, f);
        if (given !== undefined && !given.has(formatValue(pv[f] as FieldValue))) possible = false;
      }
      if (!possible) continue;
    }
    const choices: FieldValue[][] = [];
    for (const f of child.def.fieldNames) {
      const given = clause.fields[f];
      if (given !== undefined && given !== "all") choices.push(given);
      else if (given === "all" && parent.fields.has(f)) choices.push(parent.def.autofill[f] ?? []);
      else if (given === "all") {
        const union = new Map<string, FieldValue>();
        for (const a of clause.apps)
          for (const v of (c.apps.get(a) as CompiledApp).def.autofill[f] ?? []) union.set(formatValue(v), v);
        choices.push([...union.values()]);
      } else if (parent.fields.has(f)) choices.push([pv[f] as FieldValue]);
      else choices.push(child.def.autofill[f] ?? []);
    }
    crossProduct(child.def.fieldNames, choices, (cv) => {
      const jobId = joinJobId(child.segments, cv);
      const key = `${child.def.name}\u0000${jobId}`;
      if (seen.has(key)) return;
      const parsed = tryParse(c, child, jobId);
      if (parsed === undefined) return;
      if (!groupMatches(c, group.clauses, child, parsed)) return;
      if (!isParentVia(clause, parent, job.jobId, pv, child, parsed)) return;
      seen.add(key);
      out.push({ app: child.def.name, jobId });
    });
  }
  return out;
}

/** Whether valid_if_or skips the job: it names fields, and the job has none of the values given for any of them. */
export function isSkipped(def: PipelineDefinition, job: JobRef): boolean {
  const app = appOf(compile(def), job.app);
  const v = parseJobId(def, job.app, job.jobId);
  const rule = app.def.validIfOr;
  if (rule === null) return false;
  for (const [f, values] of Object.entries(rule))
    if (asSet(values).has(formatValue(v[f] as FieldValue))) return false;
  return true;
}

const textCache = new WeakMap<AppDefinition, Map<string, TextPart[]>>();

function render(app: AppDefinition, template: string, values: Record<string, string>): string {
  let byText = textCache.get(app);
  if (byText === undefined) {
    byText = new Map();
    textCache.set(app, byText);
  }
  let parts = byText.get(template);
  if (parts === undefined) {
    const t = parseTextTemplate(template, [...app.fieldNames, "app_name", "job_id"]);
    if ("problem" in t)
      throw new DispatchCloudError("pipeline.invalid", `apps.${app.name}.bundle: ${t.problem}`, {
        path: `apps.${app.name}.bundle`,
      });
    parts = t.parts;
    byText.set(template, parts);
  }
  return renderText(parts, values);
}

/**
 * The body of POST /api/v1/bundles (without dependencies) for a job: the app's bundle template with `{field}`,
 * `{app_name}` and `{job_id}` filled in. The name defaults to `<app>.<job id>`.
 */
export function renderBundle(def: PipelineDefinition, job: JobRef): Record<string, unknown> {
  const app = appOf(compile(def), job.app).def;
  const v = parseJobId(def, job.app, job.jobId);
  const values: Record<string, string> = { app_name: job.app, job_id: job.jobId };
  for (const [k, x] of Object.entries(v)) values[k] = formatValue(x);
  const b = app.bundle;
  const body: Record<string, unknown> = {
    name: b.name === undefined ? `${job.app}.${job.jobId}` : render(app, b.name, values),
    image: render(app, b.image, values),
    command: b.command.map((a) => render(app, a, values)),
  };
  if (b.env !== undefined)
    body["env"] = Object.fromEntries(Object.entries(b.env).map(([k, x]) => [k, render(app, x, values)]));
  if (b.resources !== undefined) body["resources"] = structuredClone(b.resources);
  if (b.limits !== undefined) body["limits"] = structuredClone(b.limits);
  return body;
}
