/**
 * The graph functions of lib/pipeline/graph.ts against worked examples: Stolos's own tests of its dag_tools
 * (sailthru/stolos, stolos/tests/test_dag_tools.py at commit 7b74da5, on the configuration in
 * test/fixtures/stolos-tasks.yml, restated from stolos/examples/tasks.json) and the examples of the Stolos README
 * (../shared/seeds/003_*.txt, "Configuration: Apps, Dependencies and Configuration"). Where we answer otherwise
 * on purpose the row says so. Then properties: parentsOf and childrenOf are inverse, on the examples and on
 * random pipelines.
 */
import { readFileSync } from "node:fs";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../lib/errors.ts";
import { checkPipeline, type PipelineDefinition, parsePipelineYaml } from "../lib/pipeline/definition.ts";
import {
  childrenOf,
  formatJobId,
  isSkipped,
  type JobRef,
  parentsOf,
  parseJobId,
  renderBundle,
} from "../lib/pipeline/graph.ts";

const STOLOS_TESTS = "sailthru/stolos stolos/tests/test_dag_tools.py";
const README = "Stolos README (../shared/seeds/003_*.txt)";

const stolos = parsePipelineYaml(
  readFileSync(new URL("./fixtures/stolos-tasks.yml", import.meta.url), "utf8"),
);

function refs(list: string[]): JobRef[] {
  return list.map((s) => {
    const [app, jobId] = s.split(" ") as [string, string];
    return { app, jobId };
  });
}
const sorted = (list: JobRef[]) =>
  [...list].sort((a, b) => `${a.app} ${a.jobId}`.localeCompare(`${b.app} ${b.jobId}`));

interface Row {
  source: string;
  fn: "parents" | "children";
  job: string;
  expected: string[];
  note?: string;
}

const stolosRows: Row[] = [
  // test_get_children
  {
    source: `${STOLOS_TESTS} test_get_children`,
    fn: "children",
    job: "depends_on2 20140601_876_profile",
    expected: ["depends_on1 20140601_testID2"],
  },
  {
    source: `${STOLOS_TESTS} test_get_children`,
    fn: "children",
    job: "bash2 20140601_9899_purchase",
    expected: [],
  },
  {
    source: `${STOLOS_TESTS} test_get_children`,
    fn: "children",
    job: "bash1 20140601_9899_purchase",
    expected: ["bash2 20140601_9899_purchase"],
  },
  {
    source: `${STOLOS_TESTS} test_get_children`,
    fn: "children",
    job: "app1 20140601_999_purchase",
    expected: ["depends_on1 20140601_testID1", "app2 20140601_999_purchase", "app4 20140601_999_purchase"],
  },
  {
    source: `${STOLOS_TESTS} test_get_children`,
    fn: "children",
    job: "app1 20140601_876_purchase",
    expected: ["depends_on1 20140601_testID1", "app2 20140601_876_purchase", "app4 20140601_876_purchase"],
  },
  // test_get_children_with_complicated_job_ids
  {
    source: `${STOLOS_TESTS} test_get_children_with_complicated_job_ids`,
    fn: "children",
    job: "valid1 20151015_2",
    expected: [
      "valid4 20151015_101",
      "valid3b 20151015_101",
      "valid3b 20151015_102",
      "valid3 20151015_101",
      "valid3 20151015_102",
    ],
  },
  {
    source: `${STOLOS_TESTS} test_get_children_with_complicated_job_ids`,
    fn: "children",
    job: "valid1 20151015_3",
    expected: [],
  },
  {
    source: `${STOLOS_TESTS} test_get_children_with_complicated_job_ids`,
    fn: "children",
    job: "valid2 20151015_101",
    expected: ["valid4 20151015_101", "valid3b 20151015_101", "valid3 20151015_101"],
  },
  {
    source: `${STOLOS_TESTS} test_get_children_with_complicated_job_ids`,
    fn: "children",
    job: "valid2 20151015_103",
    expected: [],
  },
  // test_get_parents_with_complicated_job_ids
  {
    source: `${STOLOS_TESTS} test_get_parents_with_complicated_job_ids`,
    fn: "parents",
    job: "valid3 20151015_101",
    expected: ["valid1 20151015_1", "valid1 20151015_2", "valid2 20151015_101"],
  },
  {
    source: `${STOLOS_TESTS} test_get_parents_with_complicated_job_ids (valid3b states valid3 another way)`,
    fn: "parents",
    job: "valid3b 20151015_101",
    expected: ["valid1 20151015_1", "valid1 20151015_2", "valid2 20151015_101"],
  },
  {
    source: `${STOLOS_TESTS} test_get_parents_with_complicated_job_ids`,
    fn: "parents",
    job: "valid4 20151015_102",
    expected: [],
  },
  {
    source: `${STOLOS_TESTS} test_get_parents_with_complicated_job_ids`,
    fn: "parents",
    job: "valid4 20151015_101",
    expected: ["valid1 20151015_1", "valid1 20151015_2", "valid2 20151015_101"],
  },
  // test_get_parents
  {
    source: `${STOLOS_TESTS} test_get_parents (no parents)`,
    fn: "parents",
    job: "app1 20140101_876_purchase",
    expected: [],
  },
  {
    source: `${STOLOS_TESTS} test_get_parents (basic inheritance)`,
    fn: "parents",
    job: "bash2 20140501_876_profile",
    expected: ["bash1 20140501_876_profile"],
  },
  {
    source: `${STOLOS_TESTS} test_get_parents (no group matches)`,
    fn: "parents",
    job: "depends_on1 20140101_999999",
    expected: [],
  },
  {
    source: `${STOLOS_TESTS} test_get_parents (no group matches)`,
    fn: "parents",
    job: "depends_on1 20140601_999",
    expected: [],
  },
  {
    source: `${STOLOS_TESTS} test_get_parents (one group)`,
    fn: "parents",
    job: "depends_on1 20140601_testID2",
    expected: [
      "depends_on2 20140601_1011_profile",
      "depends_on2 20140601_9020_profile",
      "depends_on2 20140601_876_profile",
    ],
  },
  {
    source: `${STOLOS_TESTS} test_get_parents (a group of two clauses, one of them literal job ids)`,
    fn: "parents",
    job: "depends_on1 20140601_testID1",
    expected: [
      "app1 20140601_1011_profile",
      "app1 20140601_1011_purchase",
      "app1 20140601_9020_profile",
      "app1 20140601_9020_purchase",
      "app1 20140601_876_profile",
      "app1 20140601_876_purchase",
      "app1 20140601_999_purchase",
      "app2 20140601_1011_profile",
      "app2 20140601_1011_purchase",
      "app2 20140601_9020_profile",
      "app2 20140601_9020_purchase",
      "app2 20140601_876_profile",
      "app2 20140601_876_purchase",
    ],
  },
  {
    source: `${STOLOS_TESTS} test_get_parents (two groups match: their parents together)`,
    fn: "parents",
    job: "depends_on1 20140601_testID3",
    expected: ["app1 20140601_444_profile", "app1 20140601_876_profile"],
  },
  // test_fan_out_tasks
  { source: `${STOLOS_TESTS} test_fan_out_tasks`, fn: "parents", job: "fanout1 20140715_8", expected: [] },
  {
    source: `${STOLOS_TESTS} test_fan_out_tasks`,
    fn: "parents",
    job: "fanout1 20140715_testID5",
    expected: ["app1 20140714_555_profile", "app1 20140715_555_profile"],
  },
  {
    source: `${STOLOS_TESTS} test_fan_out_tasks`,
    fn: "children",
    job: "app1 20140715_9_profile",
    expected: [
      "app2 20140715_9_profile",
      "app4 20140715_9_profile",
      "fanout1 20140715_testID1",
      "fanout1 20140715_testID2",
      "fanout1 20140715_testID3",
    ],
  },
  {
    source: `${STOLOS_TESTS} test_fan_out_tasks`,
    fn: "children",
    job: "app1 20140715_555_profile",
    expected: [
      "app2 20140715_555_profile",
      "app4 20140715_555_profile",
      "fanout1 20140714_testID5",
      "fanout1 20140714_testID6",
      "fanout1 20140715_testID1",
      "fanout1 20140715_testID2",
      "fanout1 20140715_testID3",
      "fanout1 20140715_testID5",
      "fanout1 20140715_testID6",
    ],
  },
  // test_topological_sort (the parents it sorts)
  {
    source: `${STOLOS_TESTS} test_topological_sort`,
    fn: "parents",
    job: "topological_sort1 20140601_testID1",
    expected: [
      "app1 20140601_101_profile",
      "app1 20140601_102_profile",
      "app2 20140601_101_profile",
      "app2 20140601_102_profile",
      "depends_on1 20140601_testID1",
      "bash2 20140601_101_profile",
      "bash2 20140601_102_profile",
    ],
  },
  // test_depends_on_all
  {
    source: `${STOLOS_TESTS} test_depends_on_all`,
    fn: "children",
    job: "all_test1 20140601_1",
    expected: [
      "all_test3 20140601_1",
      "all_test3 20140601_2",
      "all_test4 20140601",
      "all_test4b 20140601",
      "all_test5 20140601",
    ],
  },
  {
    source: `${STOLOS_TESTS} test_depends_on_all`,
    fn: "children",
    job: "all_test1 20140601_2",
    expected: [
      "all_test3 20140601_1",
      "all_test3 20140601_2",
      "all_test4 20140601",
      "all_test4b 20140601",
      "all_test5 20140601",
    ],
  },
  {
    source: `${STOLOS_TESTS} test_depends_on_all`,
    fn: "children",
    job: "all_test2 20140601_2",
    expected: ["all_test4 20140601", "all_test4b 20140601"],
  },
  {
    source: `${STOLOS_TESTS} test_depends_on_all`,
    fn: "children",
    job: "all_test2 20140601_3",
    expected: ["all_test4 20140601", "all_test4b 20140601", "all_test5 20140601"],
    note: "all_test5 adapted: it depends on all_test2's client 3 instead of 4 (see the fixture)",
  },
  { source: `${STOLOS_TESTS} test_depends_on_all`, fn: "parents", job: "all_test3 20140601_0", expected: [] },
  {
    source: `${STOLOS_TESTS} test_depends_on_all`,
    fn: "parents",
    job: "all_test3 20140601_1",
    expected: ["all_test1 20140601_1", "all_test1 20140601_2"],
  },
  {
    source: `${STOLOS_TESTS} test_depends_on_all`,
    fn: "parents",
    job: "all_test3 20140601_2",
    expected: ["all_test1 20140601_1", "all_test1 20140601_2"],
  },
  { source: `${STOLOS_TESTS} test_depends_on_all`, fn: "parents", job: "all_test3 20140601_3", expected: [] },
  {
    source: `${STOLOS_TESTS} test_depends_on_all`,
    fn: "parents",
    job: "all_test4 20140601",
    expected: [
      "all_test1 20140601_1",
      "all_test1 20140601_2",
      "all_test2 20140601_2",
      "all_test2 20140601_3",
    ],
  },
  {
    source: `${STOLOS_TESTS} test_depends_on_all`,
    fn: "parents",
    job: "all_test4b 20140601",
    expected: [
      "all_test1 20140601_1",
      "all_test1 20140601_2",
      "all_test2 20140601_2",
      "all_test2 20140601_3",
    ],
  },
  {
    source: `${STOLOS_TESTS} test_depends_on_all`,
    fn: "parents",
    job: "all_test5 20140601",
    expected: ["all_test1 20140601_1", "all_test1 20140601_2", "all_test2 20140601_3"],
    note: "adapted: all_test2 20140601_3 where Stolos has 20140601_4",
  },
  // test_autofill_all, test_autofill_get_parents
  {
    source: `${STOLOS_TESTS} test_autofill_all`,
    fn: "children",
    job: "autofill1 10",
    expected: [
      "autofill3 20150101",
      "autofill3 20150102",
      "autofill3 20150103",
      "autofill3 20150104",
      "autofill_getparents 20150101_10_10",
    ],
  },
  {
    source: `${STOLOS_TESTS} test_autofill_all`,
    fn: "children",
    job: "autofill2 20150101",
    expected: ["autofill3 20150101", "autofill_getparents 20150101_10_10"],
  },
  { source: `${STOLOS_TESTS} test_autofill_all`, fn: "children", job: "autofill3 20150101", expected: [] },
  {
    source: `${STOLOS_TESTS} test_autofill_all`,
    fn: "parents",
    job: "autofill3 20150101",
    expected: [
      "autofill1 10",
      "autofill1 12",
      "autofill1 14",
      "autofill1 16",
      "autofill1 18",
      "autofill2 20150101",
    ],
  },
  {
    source: `${STOLOS_TESTS} test_autofill_get_parents`,
    fn: "parents",
    job: "autofill_getparents 20150101_10_10",
    expected: ["autofill1 10", "autofill2 20150101"],
  },
];

/** Stolos answers [] for these job ids outside their app's autofill_values; we refuse them as job ids. */
const refusedRows: { source: string; job: string }[] = [
  { source: `${STOLOS_TESTS} test_get_parents_with_complicated_job_ids`, job: "valid3 20151015_100" },
  { source: `${STOLOS_TESTS} test_get_parents_with_complicated_job_ids`, job: "valid4 20151015_100" },
  { source: `${STOLOS_TESTS} test_depends_on_all`, job: "all_test1 20140601_0" },
  { source: `${STOLOS_TESTS} test_depends_on_all`, job: "all_test2 20140601_1" },
  { source: `${STOLOS_TESTS} test_autofill_all`, job: "autofill1 9" },
  { source: `${STOLOS_TESTS} test_autofill_all`, job: "autofill1 11" },
  { source: `${STOLOS_TESTS} test_autofill_all`, job: "autofill1 20" },
  { source: `${STOLOS_TESTS} test_autofill_all`, job: "autofill2 20150128" },
  { source: `${STOLOS_TESTS} test_autofill_all`, job: "autofill3 20150128" },
];

function run(def: PipelineDefinition, row: Row): JobRef[] {
  const [job] = refs([row.job]) as [JobRef];
  return row.fn === "parents" ? parentsOf(def, job) : childrenOf(def, job);
}

describe("the worked examples of Stolos's tests", () => {
  it.each(stolosRows)("$fn of $job ($source)", (row) => {
    const got = run(stolos, row);
    expect(sorted(got)).toEqual(sorted(refs(row.expected)));
    expect(new Set(got.map((r) => `${r.app} ${r.jobId}`)).size).toBe(got.length); // no duplicates
  });

  it.each(refusedRows)("$job is not a job id (Stolos: no parents or children; $source)", ({ job }) => {
    const [ref] = refs([job]) as [JobRef];
    for (const fn of [parentsOf, childrenOf]) {
      let err: unknown;
      try {
        fn(stolos, ref);
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(DispatchCloudError);
      expect((err as DispatchCloudError).code).toBe("pipeline.invalid_job_id");
      expect((err as DispatchCloudError).message).toMatch(/autofill_values/);
    }
  });

  it("parses a custom job id by its template and field types (test_missing_job_id_validations_okay)", () => {
    expect(parseJobId(stolos, "custom_job_id1", "20130101_876_equal2me")).toEqual({
      date: 20130101,
      client_id: 876,
      unvalidated_field: "equal2me",
    });
  });

  it.each(["20140606_1111_", "20140606_11aa_profile", "20149606_1111_profile", "20140606_1111_profile_x"])(
    "refuses the job id %s of app2 (test_job_id_validations)",
    (jobId) => {
      expect(() => parseJobId(stolos, "app2", jobId)).toThrow(
        expect.objectContaining({ code: "pipeline.invalid_job_id" }),
      );
    },
  );

  it("skips the jobs valid_if_or leaves out (test_passes_filter)", () => {
    expect(isSkipped(stolos, { app: "app2", jobId: "20140606_1111_content" })).toBe(true);
    expect(isSkipped(stolos, { app: "app2", jobId: "20140606_1111_profile" })).toBe(false);
    expect(isSkipped(stolos, { app: "app1", jobId: "20140606_1111_content" })).toBe(false);
  });
});

const readmeOneToMany = parsePipelineYaml(`
name: readme-one-to-many
fields: { date: date, client_id: int, target: str }
apps:
  preprocess:
    job_id: "{date}_{client_id}"
    bundle: { image: busybox, command: [preprocess] }
  modelBuild:
    job_id: "{date}_{client_id}_{target}"
    depends_on: { app_name: [preprocess], target: [purchaseRevenue, numberOfPageviews] }
    bundle: { image: busybox, command: [build] }
`);

const readmeManyToOne = parsePipelineYaml(`
name: readme-many-to-one
fields: { date: date, client_id: str, target: str }
apps:
  preprocess:
    job_id: "{date}_{client_id}"
    bundle: { image: busybox, command: [preprocess] }
  modelBuild:
    job_id: "{client_id}_{target}"
    depends_on:
      app_name: [preprocess]
      target: [purchaseRevenue, numberOfPageviews]
      date: [20140601, 20140501, 20140401]
    bundle: { image: busybox, command: [build] }
`);

const readmeOr = parsePipelineYaml(`
name: readme-or-groups
fields: { date: date, client_id: str, target: str }
apps:
  preprocess:
    job_id: "{date}_{client_id}"
    bundle: { image: busybox, command: [preprocess] }
  otherPreprocess:
    job_id: "{date}_{client_id}"
    bundle: { image: busybox, command: [preprocess] }
  modelBuild:
    job_id: "{client_id}_{target}"
    depends_on:
      dependency_group_1:
        - app_name: [preprocess]
          target: [purchaseRevenue, purchaseQuantity]
          date: [20140601, 20140501, 20140401]
        - app_name: [otherPreprocess]
          target: [purchaseRevenue, purchaseQuantity]
          date: [20120101, 20130101]
      dependency_group_2:
        app_name: [preprocess]
        target: [numberOfPageviews]
        date: [20140615]
    bundle: { image: busybox, command: [build] }
`);

describe("the worked examples of the Stolos README", () => {
  const rows: (Row & { def: PipelineDefinition })[] = [
    {
      def: readmeOneToMany,
      source: `${README}: preprocess 20140101_1234 enqueues two modelBuild jobs`,
      fn: "children",
      job: "preprocess 20140101_1234",
      expected: ["modelBuild 20140101_1234_purchaseRevenue", "modelBuild 20140101_1234_numberOfPageviews"],
    },
    {
      def: readmeOneToMany,
      source: `${README}: a modelBuild job depends on its own preprocess job`,
      fn: "parents",
      job: "modelBuild 20140101_1234_purchaseRevenue",
      expected: ["preprocess 20140101_1234"],
    },
    {
      def: readmeOneToMany,
      source: `${README}: a target the clause does not list selects no parent`,
      fn: "parents",
      job: "modelBuild 20140101_1234_other",
      expected: [],
    },
    {
      def: readmeManyToOne,
      source: `${README}: modelBuild client1_purchaseRevenue waits for preprocess of three dates`,
      fn: "parents",
      job: "modelBuild client1_purchaseRevenue",
      expected: ["preprocess 20140601_client1", "preprocess 20140501_client1", "preprocess 20140401_client1"],
    },
    {
      def: readmeManyToOne,
      source: `${README}: either modelBuild job of client1 may run first; both wait for the same jobs`,
      fn: "children",
      job: "preprocess 20140501_client1",
      expected: ["modelBuild client1_purchaseRevenue", "modelBuild client1_numberOfPageviews"],
    },
    {
      def: readmeManyToOne,
      source: `${README}: a date the clause does not list has no children`,
      fn: "children",
      job: "preprocess 20140502_client1",
      expected: [],
    },
    {
      def: readmeOr,
      source: `${README}: dependency_group_1 (preprocess AND otherPreprocess)`,
      fn: "parents",
      job: "modelBuild client1_purchaseRevenue",
      expected: [
        "preprocess 20140601_client1",
        "preprocess 20140501_client1",
        "preprocess 20140401_client1",
        "otherPreprocess 20120101_client1",
        "otherPreprocess 20130101_client1",
      ],
    },
    {
      def: readmeOr,
      source: `${README}: dependency_group_2, the alternative`,
      fn: "parents",
      job: "modelBuild client1_numberOfPageviews",
      expected: ["preprocess 20140615_client1"],
    },
    {
      def: readmeOr,
      source: `${README}: a preprocess job of group 1's dates has modelBuild children of group 1's targets`,
      fn: "children",
      job: "preprocess 20140501_client1",
      expected: ["modelBuild client1_purchaseRevenue", "modelBuild client1_purchaseQuantity"],
    },
  ];
  it.each(rows)("$fn of $job ($source)", (row) => {
    expect(sorted(run(row.def, row))).toEqual(sorted(refs(row.expected)));
  });
});

describe("OR groups: every group that matches gives parents", () => {
  // Our decision (docs/pipelines.md, docs/decisions.md): a job's parents are the union of the parents of every
  // group whose clauses all match it, as Stolos computes them.
  const def = parsePipelineYaml(`
name: or-groups
fields: { date: date, region: str }
apps:
  eu_feed: { job_id: "{date}", bundle: { image: busybox, command: [feed] } }
  us_feed: { job_id: "{date}", bundle: { image: busybox, command: [feed] } }
  report:
    job_id: "{date}_{region}"
    autofill_values: { region: [eu, us, global, asia] }
    depends_on:
      europe: { app_name: [eu_feed], region: [eu, global] }
      america: { app_name: [us_feed], region: [us, global] }
    bundle: { image: busybox, command: [report] }
`);
  it("one matching group gives its own parents only", () => {
    expect(parentsOf(def, { app: "report", jobId: "20240101_eu" })).toEqual([
      { app: "eu_feed", jobId: "20240101" },
    ]);
    expect(parentsOf(def, { app: "report", jobId: "20240101_us" })).toEqual([
      { app: "us_feed", jobId: "20240101" },
    ]);
  });
  it("two matching groups give the parents of both, in group order", () => {
    expect(parentsOf(def, { app: "report", jobId: "20240101_global" })).toEqual([
      { app: "eu_feed", jobId: "20240101" },
      { app: "us_feed", jobId: "20240101" },
    ]);
  });
  it("no matching group: no parents", () => {
    expect(parentsOf(def, { app: "report", jobId: "20240101_asia" })).toEqual([]);
  });
  it("within a group, every clause must match (AND), for parents and children alike", () => {
    const and = parsePipelineYaml(`
name: and-group
fields: { date: date, channel: str }
apps:
  a: { job_id: "{date}", bundle: { image: busybox, command: [a] } }
  b: { job_id: "{date}", bundle: { image: busybox, command: [b] } }
  report:
    job_id: "{date}_{channel}"
    autofill_values: { channel: [web, email] }
    depends_on:
      both:
        - { app_name: a, channel: [web, email] }
        - { app_name: b, channel: [web] }
    bundle: { image: busybox, command: [report] }
`);
    expect(parentsOf(and, { app: "report", jobId: "20240101_web" })).toEqual(
      refs(["a 20240101", "b 20240101"]),
    );
    expect(parentsOf(and, { app: "report", jobId: "20240101_email" })).toEqual([]);
    expect(childrenOf(and, { app: "a", jobId: "20240101" })).toEqual(refs(["report 20240101_web"]));
    expect(childrenOf(and, { app: "b", jobId: "20240101" })).toEqual(refs(["report 20240101_web"]));
  });
  it("children follow the same rule", () => {
    expect(childrenOf(def, { app: "eu_feed", jobId: "20240101" })).toEqual([
      { app: "report", jobId: "20240101_eu" },
      { app: "report", jobId: "20240101_global" },
    ]);
  });
});

describe("the worked example of docs/pipelines.md", () => {
  const doc = readFileSync(new URL("../docs/pipelines.md", import.meta.url), "utf8");
  const yaml = /<!-- example:start -->\s*```yaml\n([\s\S]*?)```/.exec(doc)?.[1] ?? "";
  const def = parsePipelineYaml(yaml);
  it("has the parents and children its table says", () => {
    expect(parentsOf(def, { app: "extract", jobId: "20240603_acme" })).toEqual([]);
    expect(parentsOf(def, { app: "summary", jobId: "20240603" })).toEqual(
      refs(["extract 20240603_acme", "extract 20240603_globex", "extract 20240603_initech"]),
    );
    expect(parentsOf(def, { app: "report", jobId: "20240603_web" })).toEqual(refs(["summary 20240603"]));
    expect(parentsOf(def, { app: "report", jobId: "20240603_email" })).toEqual(
      refs(["summary 20240603", "extract 20240603_acme"]),
    );
    expect(isSkipped(def, { app: "report", jobId: "20240603_print" })).toBe(true);
    expect(isSkipped(def, { app: "report", jobId: "20240603_email" })).toBe(false);
    expect(() => parentsOf(def, { app: "summary", jobId: "20240608" })).toThrow(/autofill_values\.date/);
    expect(childrenOf(def, { app: "extract", jobId: "20240603_acme" })).toEqual(
      refs(["summary 20240603", "report 20240603_email"]),
    );
    expect(childrenOf(def, { app: "extract", jobId: "20240603_globex" })).toEqual(refs(["summary 20240603"]));
  });
  it("renders the bundle it describes", () => {
    expect(renderBundle(def, { app: "report", jobId: "20240603_email" })).toEqual({
      name: "report.20240603_email",
      image: "busybox",
      command: ["sh", "-c", "ls /in > /out/inputs.txt && echo email report for 20240603"],
      env: { CHANNEL: "email" },
    });
  });
});

describe("job ids, one-job apps, literal parents and renderBundle", () => {
  const def = parsePipelineYaml(`
name: render
fields: { date: date, client: str }
apps:
  train:
    job_id: "{date}_{client}"
    max_attempts: 3
    bundle:
      image: "registry.example/train:{client}"
      command: [train, "--date={date}", "--out=/out/{app_name}/{job_id}", "{{literal}}"]
      env: { CLIENT: "{client}", PLAIN: "x" }
      resources: { vcpus: 2, ram: 1GiB }
      limits: { time: 1h }
`);
  it("fills {field}, {app_name} and {job_id}, keeps {{ }} as braces, and names the bundle <app>.<job id>", () => {
    expect(renderBundle(def, { app: "train", jobId: "20240229_acme" })).toEqual({
      name: "train.20240229_acme",
      image: "registry.example/train:acme",
      command: ["train", "--date=20240229", "--out=/out/train/20240229_acme", "{literal}"],
      env: { CLIENT: "acme", PLAIN: "x" },
      resources: { vcpus: 2, ram: "1GiB" },
      limits: { time: "1h" },
    });
    expect(def.apps["train"]?.maxAttempts).toBe(3);
  });
  it("refuses a job id that is not the app's", () => {
    expect(() => renderBundle(def, { app: "train", jobId: "20240230_acme" })).toThrow(
      expect.objectContaining({ code: "pipeline.invalid_job_id" }),
    );
    expect(() => renderBundle(def, { app: "nope", jobId: "x" })).toThrow(
      expect.objectContaining({ code: "pipeline.invalid_job_id" }),
    );
  });
  it("refuses job ids longer than 100 characters or with other characters", () => {
    expect(() => parseJobId(def, "train", `20240101_${"a".repeat(92)}`)).toThrow(/1-100 characters/);
    expect(parseJobId(def, "train", `20240101_${"a".repeat(91)}`)).toEqual({
      date: 20240101,
      client: "a".repeat(91),
    });
    expect(() => parseJobId(def, "train", "20240101_a b")).toThrow(/1-100 characters/);
  });
  it("literal parent job ids are parents of the child jobs that agree with them on shared fields", () => {
    const literal = parsePipelineYaml(`
name: literal
fields: { n: int, s: str }
apps:
  p: { job_id: "{n}_{s}", bundle: { image: i, command: [x] } }
  c: { job_id: "{n}", depends_on: { app_name: p, job_id: [1_x, 2_y, 2_z] }, bundle: { image: i, command: [x] } }
`);
    expect(parentsOf(literal, { app: "c", jobId: "1" })).toEqual(refs(["p 1_x"]));
    expect(parentsOf(literal, { app: "c", jobId: "2" })).toEqual(refs(["p 2_y", "p 2_z"]));
    expect(parentsOf(literal, { app: "c", jobId: "3" })).toEqual([]);
    expect(childrenOf(literal, { app: "p", jobId: "2_y" })).toEqual(refs(["c 2"]));
    expect(childrenOf(literal, { app: "p", jobId: "2_x" })).toEqual([]);
  });
  it("a template without fields has one job, which may gather every job of another app", () => {
    const single = parsePipelineYaml(`
name: single
fields: { date: date }
apps:
  daily: { job_id: "{date}", autofill_values: { date: "2024-01-01:2024-01-03" }, bundle: { image: i, command: [x] } }
  total: { job_id: all, depends_on: { app_name: daily, date: all }, bundle: { image: i, command: [x] } }
`);
    expect(parentsOf(single, { app: "total", jobId: "all" })).toEqual(
      refs(["daily 20240101", "daily 20240102", "daily 20240103"]),
    );
    expect(childrenOf(single, { app: "daily", jobId: "20240102" })).toEqual(refs(["total all"]));
    expect(() => parseJobId(single, "total", "alll")).toThrow(
      expect.objectContaining({ code: "pipeline.invalid_job_id" }),
    );
  });
  it("formats and parses job ids both ways", () => {
    expect(formatJobId(def, "train", { date: 20240101, client: "a.b-c" })).toBe("20240101_a.b-c");
    expect(parseJobId(def, "train", "20240101_a.b-c")).toEqual({ date: 20240101, client: "a.b-c" });
  });
});

// ---------------------------------------------------------------------------------------------------------------
// Properties: for every job J and every P in parentsOf(J), J is in childrenOf(P); and the other way round.

function jobsOf(def: PipelineDefinition, pools: Record<string, (string | number)[]>): JobRef[] {
  const out: JobRef[] = [];
  for (const app of Object.values(def.apps)) {
    let combos: Record<string, string | number>[] = [{}];
    for (const f of app.fieldNames) {
      const values = [...(pools[f] ?? []), ...(app.autofill[f] ?? [])];
      combos = combos.flatMap((c) => values.map((v) => ({ ...c, [f]: v })));
    }
    for (const c of combos) {
      const jobId = formatJobId(def, app.name, c);
      try {
        parseJobId(def, app.name, jobId);
        out.push({ app: app.name, jobId });
      } catch {
        // outside the app's autofill_values: not a job
      }
    }
  }
  return out;
}

const key = (r: JobRef) => `${r.app} ${r.jobId}`;

function checkInverse(def: PipelineDefinition, jobs: JobRef[]): number {
  let edges = 0;
  for (const j of jobs) {
    for (const p of parentsOf(def, j)) {
      edges++;
      expect(childrenOf(def, p).map(key), `${key(j)} is a child of its parent ${key(p)}`).toContain(key(j));
    }
    for (const c of childrenOf(def, j))
      expect(parentsOf(def, c).map(key), `${key(j)} is a parent of its child ${key(c)}`).toContain(key(j));
  }
  return edges;
}

describe("whatever job id a caller sends", () => {
  it("the graph functions answer, or throw pipeline.invalid_job_id", () => {
    const apps = Object.keys(stolos.apps);
    const jobId = fc.oneof(
      fc.string({ maxLength: 120 }),
      fc.stringMatching(/^[0-9]{8}_[0-9a-zA-Z_.-]{0,20}$/),
      fc.stringMatching(/^-?[0-9]{1,20}$/),
    );
    fc.assert(
      fc.property(fc.oneof(fc.constantFrom(...apps), fc.string()), jobId, (app, id) => {
        for (const fn of [parentsOf, childrenOf, isSkipped, renderBundle, parseJobId] as const) {
          try {
            fn === parseJobId
              ? parseJobId(stolos, app, id)
              : (fn as typeof parentsOf)(stolos, { app, jobId: id });
          } catch (err) {
            expect(err).toBeInstanceOf(DispatchCloudError);
            expect((err as DispatchCloudError).code).toBe("pipeline.invalid_job_id");
          }
        }
      }),
      { numRuns: 2000, seed: 18 },
    );
  });
});

describe("parentsOf and childrenOf are inverse", () => {
  it("on Stolos's examples, for jobs over every value they mention", () => {
    const jobs = jobsOf(stolos, {
      date: [20140601, 20140714, 20140715, 20151015, 20150101, 20150102],
      client_id: [1, 2, 3, 9, 10, 101, 102, 444, 555, 876, 999],
      collection_name: ["profile", "purchase", "content"],
      test_id: ["1", "2", "testID1", "testID2", "testID3", "testID5", "10"],
      unvalidated_field: ["x"],
    });
    expect(jobs.length).toBeGreaterThan(500);
    expect(checkInverse(stolos, jobs)).toBeGreaterThan(1000);
  });

  it("on random pipelines", () => {
    const POOLS = { a: [1, 2, 3], b: ["x", "y", "z"], d: [20140101, 20140102, 20140103] };
    const FIELDS = ["a", "b", "d"] as const;
    const subsetOf = <T>(xs: readonly T[]) => fc.subarray([...xs], { minLength: 1 });
    const clauseArb = (earlier: string[]) =>
      fc.record({
        app_name: subsetOf(earlier),
        // Sometimes literal parent job ids: indices into the combinations of the first parent's fields.
        literal: fc.oneof(
          { arbitrary: fc.constant(undefined), weight: 2 },
          { arbitrary: fc.array(fc.nat(26), { minLength: 1, maxLength: 3 }), weight: 1 },
        ),
        a: fc.oneof(
          { arbitrary: fc.constant(undefined), weight: 2 },
          { arbitrary: subsetOf(POOLS.a), weight: 2 },
          { arbitrary: fc.constant("all" as const), weight: 1 },
        ),
        b: fc.oneof(
          { arbitrary: fc.constant(undefined), weight: 2 },
          { arbitrary: subsetOf(POOLS.b), weight: 2 },
          { arbitrary: fc.constant("all" as const), weight: 1 },
        ),
        d: fc.oneof(
          { arbitrary: fc.constant(undefined), weight: 2 },
          { arbitrary: subsetOf(POOLS.d), weight: 2 },
          { arbitrary: fc.constant("all" as const), weight: 1 },
        ),
      });
    const appArb = (i: number) =>
      fc.record({
        fields: fc.subarray([...FIELDS]),
        autofill: fc.record({
          a: fc.option(subsetOf(POOLS.a), { nil: undefined, freq: 5 }),
          b: fc.option(subsetOf(POOLS.b), { nil: undefined, freq: 5 }),
          d: fc.option(subsetOf(POOLS.d), { nil: undefined, freq: 5 }),
        }),
        groups: fc.array(
          fc.array(clauseArb(Array.from({ length: Math.max(i, 1) }, (_, k) => `app${k}`)), {
            minLength: 1,
            maxLength: 2,
          }),
          { maxLength: i === 0 ? 0 : 2 },
        ),
      });
    const pipelineArb = fc
      .integer({ min: 2, max: 4 })
      .chain((n) => fc.tuple(...Array.from({ length: n }, (_, i) => appArb(i))));
    let valid = 0;
    let edges = 0;
    let withLiterals = 0;
    fc.assert(
      fc.property(pipelineArb, (apps) => {
        const raw = {
          name: "random",
          fields: { a: "int", b: "str", d: "date" },
          apps: Object.fromEntries(
            apps.map((app, i) => {
              const strip = ({
                literal,
                ...o
              }: Record<string, unknown> & { literal?: number[] | undefined }) => {
                const clause = Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined));
                if (literal === undefined) return clause;
                const first = Number(String((clause["app_name"] as string[])[0]).slice(3));
                const pFields = apps[first]?.fields ?? [];
                let combos: string[] = [""];
                for (const f of pFields)
                  combos = combos.flatMap((c) => POOLS[f].map((v) => (c === "" ? String(v) : `${c}_${v}`)));
                const ids = literal.map((n) =>
                  pFields.length === 0 ? "all" : (combos[n % combos.length] as string),
                );
                // With job_id the other keys select children only: keep the child's fields, and no "all".
                const kept = Object.entries(clause).filter(
                  ([k, v]) => k === "app_name" || (app.fields.includes(k as "a") && v !== "all"),
                );
                return { ...Object.fromEntries(kept), job_id: ids };
              };
              const autofill = Object.fromEntries(
                Object.entries(app.autofill).filter(
                  ([k, v]) => v !== undefined && app.fields.includes(k as "a"),
                ),
              );
              return [
                `app${i}`,
                {
                  job_id: app.fields.length === 0 ? "all" : app.fields.map((f) => `{${f}}`).join("_"),
                  bundle: { image: "busybox", command: ["true"] },
                  ...(Object.keys(autofill).length > 0 ? { autofill_values: autofill } : {}),
                  ...(app.groups.length > 0
                    ? { depends_on: Object.fromEntries(app.groups.map((g, k) => [`g${k}`, g.map(strip)])) }
                    : {}),
                },
              ];
            }),
          ),
        };
        if (checkPipeline(raw).length > 0) return; // not a valid pipeline: nothing to check
        valid++;
        if (JSON.stringify(raw).includes('"job_id":[')) withLiterals++;
        const def = parsePipelineYaml(JSON.stringify(raw));
        edges += checkInverse(def, jobsOf(def, POOLS));
      }),
      { numRuns: 500, seed: 18 },
    );
    expect(valid).toBeGreaterThan(30);
    expect(edges).toBeGreaterThan(300);
    expect(withLiterals).toBeGreaterThan(5);
  });
});
