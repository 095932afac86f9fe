/**
 * Pipeline definitions (lib/pipeline/definition.ts) and `pipeline check` (cli/commands/pipeline-check.ts): what a
 * valid definition becomes, and every kind of mistake refused with the key path that names it.
 */
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { parse as parseYamlValue } from "yaml";
import { pipelineCheck } from "../cli/commands/pipeline-check.ts";
import type { CliIo } from "../cli/io.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { checkPipeline, parsePipelineYaml, validatePipeline } from "../lib/pipeline/definition.ts";

const EXAMPLE = `
name: daily-models
description: features per client and day, then one model per day
fields:
  date: date
  client: { type: str }
  shard: int
apps:
  extract:
    job_id: "{date}_{client}"
    autofill_values: { client: [acme, globex, initech] }
    max_attempts: 2
    bundle:
      image: busybox
      command: [sh, -c, "echo {client} {date} > /out/rows"]
      env: { CLIENT: "{client}" }
      resources: { vcpus: 1, ram: 256MiB }
      limits: { time: 10m }
  train:
    job_id: "{date}"
    autofill_values: { date: "2024-06-01:2024-06-30" }
    depends_on: { app_name: extract, client: all }
    bundle: { image: busybox, command: [sh, -c, "cat /in/*/rows > /out/model"] }
`;

type Raw = Record<string, unknown>;
/** The example as a JSON body would carry it, so a test can change one key and check again. */
const base = (): Raw => parseYamlValue(EXAMPLE) as Raw;

/** A copy of `raw` with the value at a dotted path set (or deleted with undefined). */
function withValue(raw: Raw, path: string, value: unknown): Raw {
  const copy = structuredClone(raw);
  const keys = path.split(".");
  let obj = copy as Record<string, unknown>;
  for (const k of keys.slice(0, -1)) {
    if (obj[k] === undefined) obj[k] = {};
    obj = obj[k] as Record<string, unknown>;
  }
  const last = keys[keys.length - 1] as string;
  if (value === undefined) delete obj[last];
  else obj[last] = value;
  return copy;
}

function problemsOf(raw: unknown) {
  return checkPipeline(raw);
}

describe("a valid definition", () => {
  it("becomes apps with templates, expanded autofill values and groups", () => {
    const def = parsePipelineYaml(EXAMPLE);
    expect(def.name).toBe("daily-models");
    expect(def.fields).toEqual({ date: { type: "date" }, client: { type: "str" }, shard: { type: "int" } });
    const extract = def.apps["extract"];
    expect(extract).toMatchObject({
      name: "extract",
      jobId: "{date}_{client}",
      fieldNames: ["date", "client"],
      maxAttempts: 2,
      autofill: { client: ["acme", "globex", "initech"] },
      dependsOn: null,
      validIfOr: null,
    });
    const train = def.apps["train"];
    expect(train?.maxAttempts).toBe(1);
    expect(train?.autofill["date"]).toHaveLength(30);
    expect(train?.autofill["date"]?.[0]).toBe(20240601);
    expect(train?.autofill["date"]?.[29]).toBe(20240630);
    expect(train?.dependsOn).toEqual({
      groups: [{ name: "default", clauses: [{ apps: ["extract"], fields: { client: "all" } }] }],
    });
  });

  it("is the same from YAML and from JSON, and survives a JSON round trip", () => {
    const fromYaml = parsePipelineYaml(EXAMPLE);
    const fromJson = validatePipeline(base(), "definition");
    expect(fromJson).toEqual(fromYaml);
    expect(JSON.parse(JSON.stringify(fromYaml))).toEqual(fromYaml);
    expect(checkPipeline(base())).toEqual([]);
  });

  it("takes a top-level job_id as the default template, a list of clauses as one AND group, and named groups", () => {
    const def = parsePipelineYaml(`
name: forms
job_id: "{date}"
fields: { date: date, kind: str }
apps:
  a: { bundle: { image: i, command: [x] } }
  b: { bundle: { image: i, command: [x] } }
  c:
    depends_on: [{ app_name: a }, { app_name: [b] }]
    bundle: { image: i, command: [x] }
  d:
    job_id: "{date}.{kind}"
    depends_on:
      first: { app_name: [a], kind: [x, y] }
      second: [{ app_name: [b], kind: [z] }, { app_name: [c], kind: [z] }]
    bundle: { image: i, command: [x] }
`);
    expect(def.apps["a"]?.jobId).toBe("{date}");
    expect(def.apps["c"]?.dependsOn?.groups).toEqual([
      {
        name: "default",
        clauses: [
          { apps: ["a"], fields: {} },
          { apps: ["b"], fields: {} },
        ],
      },
    ]);
    expect(def.apps["d"]?.dependsOn?.groups.map((g) => [g.name, g.clauses.length])).toEqual([
      ["first", 1],
      ["second", 2],
    ]);
  });

  it("expands ranges with both ends included: integers by step, dates by days across months", () => {
    const def = parsePipelineYaml(`
name: ranges
fields: { n: int, day: date }
apps:
  a:
    job_id: "{n}.{day}"
    autofill_values: { n: "10:18:2", day: "20240227:20240302" }
    bundle: { image: i, command: [x] }
  b:
    job_id: "{day}"
    autofill_values: { day: "2024-01-30:2024-02-05:3" }
    bundle: { image: i, command: [x] }
`);
    expect(def.apps["a"]?.autofill).toEqual({
      n: [10, 12, 14, 16, 18],
      day: [20240227, 20240228, 20240229, 20240301, 20240302],
    });
    expect(def.apps["b"]?.autofill).toEqual({ day: [20240130, 20240202, 20240205] });
  });
});

interface Case {
  name: string;
  raw: () => unknown;
  path: string;
  message: RegExp;
}

const app = (over: Raw = {}): Raw => ({
  job_id: "{date}_{client}",
  bundle: { image: "i", command: ["x"] },
  ...over,
});

const cases: Case[] = [
  { name: "not a mapping", raw: () => [1], path: "", message: /must be a mapping/ },
  { name: "no name", raw: () => withValue(base(), "name", undefined), path: "name", message: /missing/ },
  { name: "a bad name", raw: () => withValue(base(), "name", "9lives"), path: "name", message: /letter/ },
  {
    name: "an unknown top-level key",
    raw: () => withValue(base(), "aps", {}),
    path: "aps",
    message: /did you mean apps\?/,
  },
  { name: "no apps", raw: () => withValue(base(), "apps", {}), path: "apps", message: /at least one/ },
  {
    name: "an unknown field type",
    raw: () => withValue(base(), "fields.shard", "float"),
    path: "fields.shard",
    message: /one of int, str, date/,
  },
  {
    name: "a reserved field name",
    raw: () => withValue(base(), "fields.job_id", "str"),
    path: "fields.job_id",
    message: /reserved/,
  },
  {
    name: "a bad field name",
    raw: () => withValue(base(), "fields.Client", "str"),
    path: "fields.Client",
    message: /lower-case/,
  },
  {
    name: "an unknown app key",
    raw: () => withValue(base(), "apps.train.depend_on", {}),
    path: "apps.train.depend_on",
    message: /did you mean depends_on\?/,
  },
  {
    name: "a bad app name",
    raw: () => withValue(base(), "apps.1st", app()),
    path: "apps.1st",
    message: /app name/,
  },
  {
    name: "no job_id",
    raw: () => withValue(base(), "apps.train.job_id", undefined),
    path: "apps.train.job_id",
    message: /missing/,
  },
  {
    name: "an undeclared field in a template",
    raw: () => withValue(base(), "apps.train.job_id", "{day}"),
    path: "apps.train.job_id",
    message: /not a declared field/,
  },
  {
    name: "a field twice in a template",
    raw: () => withValue(base(), "apps.extract.job_id", "{client}_{client}"),
    path: "apps.extract.job_id",
    message: /twice/,
  },
  {
    name: "two fields with no text between",
    raw: () => withValue(base(), "apps.extract.job_id", "{client}{shard}"),
    path: "apps.extract.job_id",
    message: /literal text between/,
  },
  {
    name: "a str field followed by -",
    raw: () => withValue(base(), "apps.extract.job_id", "{client}-{shard}"),
    path: "apps.extract.job_id",
    message: /start with "_"/,
  },
  {
    name: "an int field followed by a digit",
    raw: () => withValue(base(), "apps.extract.job_id", "{shard}9x{client}"),
    path: "apps.extract.job_id",
    message: /split two ways/,
  },
  {
    name: "characters a job id cannot hold",
    raw: () => withValue(base(), "apps.extract.job_id", "{date}/{client}"),
    path: "apps.extract.job_id",
    message: /A-Z a-z 0-9/,
  },
  {
    name: "an unclosed brace",
    raw: () => withValue(base(), "apps.extract.job_id", "{date"),
    path: "apps.extract.job_id",
    message: /not closed/,
  },
  {
    name: "autofill for a field the job id lacks",
    raw: () => withValue(base(), "apps.train.autofill_values.client", ["acme"]),
    path: "apps.train.autofill_values.client",
    message: /not a field of this app's job id/,
  },
  {
    name: "an empty autofill list",
    raw: () => withValue(base(), "apps.extract.autofill_values.client", []),
    path: "apps.extract.autofill_values.client",
    message: /must not be empty/,
  },
  {
    name: "a value of the wrong type",
    raw: () => withValue(base(), "apps.extract.autofill_values.client", ["acme", "a_b"]),
    path: "apps.extract.autofill_values.client[1]",
    message: /is not 1-100 characters/,
  },
  {
    name: "a range that ends before it starts",
    raw: () => withValue(base(), "apps.train.autofill_values.date", "20240630:20240601"),
    path: "apps.train.autofill_values.date",
    message: /ends before it starts/,
  },
  {
    name: "a range with step 0",
    raw: () => withValue(base(), "apps.train.autofill_values.date", "20240601:20240630:0"),
    path: "apps.train.autofill_values.date",
    message: /step/,
  },
  {
    name: "a range of a str field",
    raw: () => withValue(base(), "apps.extract.autofill_values.client", "a:c"),
    path: "apps.extract.autofill_values.client",
    message: /not a range/,
  },
  {
    name: "a range over a day that does not exist",
    raw: () => withValue(base(), "apps.train.autofill_values.date", "20240601:20240631"),
    path: "apps.train.autofill_values.date",
    message: /not a calendar date/,
  },
  {
    name: "a range too large",
    raw: () => withValue(base(), "apps.train.autofill_values.date", "1000-01-01:9999-12-31"),
    path: "apps.train.autofill_values.date",
    message: /more than 100000/,
  },
  {
    name: "max_attempts 0",
    raw: () => withValue(base(), "apps.train.max_attempts", 0),
    path: "apps.train.max_attempts",
    message: /1 to 10/,
  },
  {
    name: "valid_if_or on a field the job id lacks",
    raw: () => withValue(base(), "apps.train.valid_if_or", { client: ["acme"] }),
    path: "apps.train.valid_if_or.client",
    message: /not a field/,
  },
  {
    name: "no bundle",
    raw: () => withValue(base(), "apps.train.bundle", undefined),
    path: "apps.train.bundle",
    message: /missing/,
  },
  {
    name: "an empty command",
    raw: () => withValue(base(), "apps.train.bundle.command", []),
    path: "apps.train.bundle.command",
    message: /non-empty list/,
  },
  {
    name: "a field the app's job id lacks in a command",
    raw: () => withValue(base(), "apps.train.bundle.command", ["x", "{client}"]),
    path: "apps.train.bundle.command[1]",
    message: /\{client\} is not one of \{date\}, \{app_name\}, \{job_id\}/,
  },
  {
    name: "a lone brace in env",
    raw: () => withValue(base(), "apps.extract.bundle.env.CLIENT", "a}b"),
    path: "apps.extract.bundle.env.CLIENT",
    message: /write "}}"/,
  },
  {
    name: "a bad env name",
    raw: () => withValue(base(), "apps.extract.bundle.env", { "1X": "y" }),
    path: "apps.extract.bundle.env.1X",
    message: /environment variable name/,
  },
  {
    name: "resources not a mapping",
    raw: () => withValue(base(), "apps.extract.bundle.resources", 3),
    path: "apps.extract.bundle.resources",
    message: /mapping/,
  },
  {
    name: "an unknown bundle key",
    raw: () => withValue(base(), "apps.extract.bundle.imgae", "x"),
    path: "apps.extract.bundle.imgae",
    message: /did you mean image\?/,
  },
  {
    name: "an unknown parent app",
    raw: () => withValue(base(), "apps.train.depends_on.app_name", ["extrakt"]),
    path: "apps.train.depends_on.app_name[0]",
    message: /not an app of this pipeline; did you mean extract\?/,
  },
  {
    name: "an unknown clause key",
    raw: () => withValue(base(), "apps.train.depends_on.clinet", "all"),
    path: "apps.train.depends_on.clinet",
    message: /did you mean client\?/,
  },
  {
    name: "a field neither app has",
    raw: () => withValue(base(), "apps.train.depends_on.shard", [1]),
    path: "apps.train.depends_on.shard",
    message: /selects nothing/,
  },
  {
    name: '"all" without the parent\'s autofill values',
    raw: () => withValue(base(), "apps.extract.autofill_values", undefined),
    path: "apps.train.depends_on.client",
    message: /"all" takes extract's autofill_values\.client/,
  },
  {
    name: "a clause value outside the parent's autofill values",
    raw: () => withValue(base(), "apps.train.depends_on.client", ["acme", "umbrella"]),
    path: "apps.train.depends_on.client[1]",
    message: /umbrella is not among extract's autofill_values\.client/,
  },
  {
    name: "a parent field nothing gives",
    raw: () =>
      withValue(withValue(base(), "apps.extract.autofill_values", undefined), "apps.train.depends_on", {
        app_name: ["extract"],
      }),
    path: "apps.train.depends_on",
    message: /extract's job id has \{client\}.*the parents of a train job cannot be listed/,
  },
  {
    name: "a child field nothing gives",
    raw: () =>
      withValue(
        withValue(base(), "apps.train.autofill_values", undefined),
        "apps.train.job_id",
        "{date}.{shard}",
      ),
    path: "apps.train.depends_on",
    message: /train's job id has \{shard\}.*the children of a extract job cannot be listed/,
  },
  {
    name: "a value taken from the child that the parent's autofill values limit, with no limit on the child",
    raw: () =>
      withValue(
        withValue(base(), "apps.extract.autofill_values.date", "2024-06-01:2024-06-30"),
        "apps.train.autofill_values",
        undefined,
      ),
    path: "apps.train.depends_on",
    message:
      /extract takes \{date\} from train's job id, and extract's autofill_values\.date limit it: give train autofill_values\.date within them/,
  },
  {
    name: "a value taken from the child, outside the parent's autofill values",
    raw: () => withValue(base(), "apps.extract.autofill_values.date", "2024-06-01:2024-06-29"),
    path: "apps.train.autofill_values.date",
    message:
      /^20240630 is not among extract's autofill_values\.date, and extract takes \{date\} from train's job id \(apps\.train\.depends_on\)$/,
  },
  {
    name: "too many children for one parent job",
    raw: () =>
      withValue(base(), "apps.fan", {
        job_id: "{client}_{shard}",
        autofill_values: { client: Array.from({ length: 200 }, (_, i) => `c${i}`), shard: "1:1000" },
        depends_on: { app_name: "train" },
        bundle: { image: "i", command: ["x"] },
      }),
    path: "apps.fan.depends_on",
    message: /^gives each train job 200000 children of fan; at most 100000$/,
  },
  {
    name: "a literal job id that is not the parent's",
    raw: () =>
      withValue(base(), "apps.train.depends_on", { app_name: "extract", job_id: ["20240601_umbrella"] }),
    path: "apps.train.depends_on.job_id[0]",
    message: /not a job of extract: client umbrella is not among its autofill_values/,
  },
  {
    name: '"all" with literal job ids',
    raw: () =>
      withValue(base(), "apps.train.depends_on", {
        app_name: "extract",
        job_id: ["20240601_acme"],
        client: "all",
      }),
    path: "apps.train.depends_on.client",
    message: /with job_id the parents are given/,
  },
  {
    name: "an empty group",
    raw: () => withValue(base(), "apps.train.depends_on", { g: [] }),
    path: "apps.train.depends_on.g",
    message: /at least one clause/,
  },
  {
    name: "a clause that is not a mapping",
    raw: () =>
      withValue(base(), "apps.train.depends_on", { g: [{ app_name: "extract", client: "all" }, "extract"] }),
    path: "apps.train.depends_on.g[1]",
    message: /must be a mapping with app_name/,
  },
  {
    name: "a cycle",
    raw: () =>
      withValue(
        withValue(base(), "apps.extract.depends_on", { app_name: "loop", client: ["acme"] }),
        "apps.loop",
        {
          job_id: "{date}_{client}",
          autofill_values: { client: ["acme"] },
          depends_on: { app_name: "extract" },
          bundle: { image: "i", command: ["x"] },
        },
      ),
    path: "apps.extract.depends_on",
    message: /a cycle of dependencies: extract -> loop -> extract/,
  },
  {
    name: "an app depending on itself",
    raw: () => withValue(base(), "apps.extract.depends_on", { app_name: "extract" }),
    path: "apps.extract.depends_on",
    message: /a cycle of dependencies: extract -> extract/,
  },
];

describe("mistakes are refused with their key path", () => {
  it.each(cases)("$name: $path", ({ raw, path, message }) => {
    const problems = problemsOf(raw());
    const hit = problems.find((p) => p.path === path && message.test(p.message));
    expect(hit, JSON.stringify(problems, null, 1)).toBeDefined();
  });

  it("the Stolos example all_test5 (a parent value outside the parent's autofill values) is refused", () => {
    // sailthru/stolos stolos/examples/tasks.json: all_test5 depends on all_test2's client_id 4; all_test2's
    // autofill_values are [2, 3]. Stolos runs all_test2 20140601_4 anyway; we refuse the definition.
    const problems = checkPipeline({
      name: "all-test",
      fields: { date: "date", client_id: "int" },
      apps: {
        all_test1: {
          job_id: "{date}_{client_id}",
          autofill_values: { client_id: [1, 2] },
          bundle: { image: "i", command: ["x"] },
        },
        all_test2: {
          job_id: "{date}_{client_id}",
          autofill_values: { client_id: [2, 3] },
          bundle: { image: "i", command: ["x"] },
        },
        all_test5: {
          job_id: "{date}",
          depends_on: {
            both_apps: [
              { app_name: ["all_test1"], client_id: "all" },
              { app_name: ["all_test2"], client_id: [4] },
            ],
          },
          bundle: { image: "i", command: ["x"] },
        },
      },
    });
    expect(problems).toEqual([
      {
        path: "apps.all_test5.depends_on.both_apps[1].client_id[0]",
        message: "4 is not among all_test2's autofill_values.client_id, so that parent job could never exist",
      },
    ]);
  });

  it("a wrong template is one problem, not one more for each clause that names its app", () => {
    expect(checkPipeline(withValue(base(), "apps.extract.job_id", "{dat}_{client}"))).toEqual([
      {
        path: "apps.extract.job_id",
        message: "{dat} is not a declared field (declared: date, client, shard)",
      },
    ]);
  });

  it("checkPipeline lists every problem; validatePipeline throws the first with the prefix and a count", () => {
    let raw = withValue(base(), "apps.train.max_attempts", 99);
    raw = withValue(raw, "apps.extract.bundle.command", "echo");
    raw = withValue(raw, "fields.shard", "float");
    expect(checkPipeline(raw).map((p) => p.path)).toEqual(
      expect.arrayContaining(["fields.shard", "apps.extract.bundle.command", "apps.train.max_attempts"]),
    );
    let err: unknown;
    try {
      validatePipeline(raw, "definition");
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(DispatchCloudError);
    expect((err as DispatchCloudError).code).toBe("pipeline.invalid");
    expect((err as DispatchCloudError).path).toBe("definition.fields.shard");
    expect((err as DispatchCloudError).message).toMatch(
      /^definition\.fields\.shard: .*\(and 2 more problems\)$/,
    );
  });

  it("YAML that does not parse, or has a key twice, is pipeline.invalid naming the line", () => {
    expect(() => parsePipelineYaml("name: x\napps: [\n")).toThrow(
      expect.objectContaining({
        code: "pipeline.invalid",
        message: expect.stringMatching(/not valid YAML: line \d+/),
      }),
    );
    expect(() => parsePipelineYaml("name: x\nname: y\n")).toThrow(
      expect.objectContaining({ code: "pipeline.invalid", message: expect.stringMatching(/line 2/) }),
    );
  });
});

describe("whatever a caller sends", () => {
  it("checkPipeline answers a list and validatePipeline throws only pipeline.invalid", () => {
    const keys = [
      "name",
      "fields",
      "apps",
      "job_id",
      "bundle",
      "depends_on",
      "app_name",
      "autofill_values",
      "all",
    ];
    const anyValue = fc.anything({ key: fc.oneof(fc.constantFrom(...keys), fc.string()), maxDepth: 4 });
    // Random values, and the example with one key replaced by a random value.
    const paths = [
      "name",
      "fields",
      "fields.date",
      "apps",
      "apps.train",
      "apps.train.depends_on",
      "apps.train.depends_on.client",
      "apps.extract.job_id",
      "apps.extract.autofill_values",
      "apps.extract.bundle",
      "apps.extract.bundle.command",
      "apps.train.valid_if_or",
    ];
    const input = fc.oneof(
      anyValue,
      fc.tuple(fc.constantFrom(...paths), anyValue).map(([path, v]) => withValue(base(), path, v)),
    );
    fc.assert(
      fc.property(input, (value) => {
        expect(Array.isArray(checkPipeline(value))).toBe(true);
        try {
          validatePipeline(value);
        } catch (err) {
          expect(err).toBeInstanceOf(DispatchCloudError);
          expect((err as DispatchCloudError).code).toBe("pipeline.invalid");
        }
      }),
      { numRuns: 1000, seed: 18 },
    );
  });
});

describe("pipeline check FILE", () => {
  const dir = mkdtempSync(join(tmpdir(), "pipeline-check-"));
  function io() {
    const out: string[] = [];
    const err: string[] = [];
    const value: CliIo = {
      argv: [],
      env: {},
      cwd: dir,
      out: (l) => out.push(l),
      err: (l) => err.push(l),
      progress: (l) => err.push(l),
    };
    return { io: value, out, err };
  }

  it("prints a summary and exits 0 for a valid file", async () => {
    writeFileSync(join(dir, "ok.yml"), EXAMPLE);
    const { io: cli, out, err } = io();
    expect(await pipelineCheck(cli, "ok.yml")).toBe(0);
    expect(out).toEqual(["ok.yml: pipeline daily-models is valid: 2 apps, 1 with dependencies"]);
    expect(err).toEqual([]);
  });

  it("prints every problem as FILE: path: message and exits 1", async () => {
    writeFileSync(
      join(dir, "bad.yml"),
      EXAMPLE.replace("max_attempts: 2", "max_attempts: 20").replace(
        "client: all }",
        "client: all, shard: [1] }",
      ),
    );
    const { io: cli, out, err } = io();
    expect(await pipelineCheck(cli, "bad.yml")).toBe(1);
    expect(out).toEqual([]);
    expect(err).toEqual([
      "bad.yml: apps.extract.max_attempts: must be a whole number from 1 to 10",
      "bad.yml: apps.train.depends_on.shard: shard is in neither train's job id nor that of any app in app_name, so it selects nothing",
      "bad.yml: 2 problems",
    ]);
  });

  it("says where YAML is broken, and when the file cannot be read", async () => {
    writeFileSync(join(dir, "broken.yml"), "name: x\napps: {\n");
    const a = io();
    expect(await pipelineCheck(a.io, "broken.yml")).toBe(1);
    expect(a.err[0]).toMatch(/^broken\.yml: not valid YAML: line \d+, column \d+: /);
    const b = io();
    expect(await pipelineCheck(b.io, "missing.yml")).toBe(1);
    expect(b.err[0]).toMatch(/^missing\.yml: cannot read: .*ENOENT/);
  });

  it("accepts the worked example of docs/pipelines.md", async () => {
    const doc = readFileSync(new URL("../docs/pipelines.md", import.meta.url), "utf8");
    const m = /<!-- example:start -->\s*```yaml\n([\s\S]*?)```/.exec(doc);
    expect(m, "docs/pipelines.md has the example between <!-- example:start --> markers").not.toBeNull();
    writeFileSync(join(dir, "doc.yml"), m?.[1] ?? "");
    const { io: cli, out, err } = io();
    expect(await pipelineCheck(cli, "doc.yml")).toBe(0);
    expect(err).toEqual([]);
    // docs/pipelines.md shows this line for daily-report.yml.
    expect(out).toEqual(["doc.yml: pipeline daily-report is valid: 3 apps, 2 with dependencies"]);
    expect(doc).toContain("daily-report.yml: pipeline daily-report is valid: 3 apps, 2 with dependencies");
  });
});
