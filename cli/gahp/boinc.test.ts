import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../../lib/errors.ts";
import {
  boincStatus,
  bundleRequest,
  expandCommand,
  fitQueryReply,
  parseFetch,
  parseSubmit,
  type QueriedJob,
} from "./boinc.ts";

const code = (fn: () => unknown) => {
  try {
    fn();
  } catch (err) {
    return err instanceof DispatchCloudError ? err.code : String(err);
  }
  return "no error";
};

describe("BOINC command arguments", () => {
  it("reads BOINC_SUBMIT as HTCondor 9.x builds it: jobs, then six bounds (NULL when unset)", () => {
    const req = parseSubmit([
      "condor#s#app#1",
      "app",
      "2",
      "condor#s#app#1#1.0",
      "2",
      "-n",
      "a b",
      "1",
      "/tmp/in put/data.txt",
      "data.txt",
      "condor#s#app#1#1.1",
      "0",
      "0",
      "NULL",
      "NULL",
      "5e8",
      "NULL",
      "3600",
      "NULL",
    ]);
    expect(req.jobs).toEqual([
      {
        name: "condor#s#app#1#1.0",
        args: ["-n", "a b"],
        inputs: [{ src: "/tmp/in put/data.txt", dst: "data.txt" }],
      },
      { name: "condor#s#app#1#1.1", args: [], inputs: [] },
    ]);
    expect(req.bounds).toEqual({ memory: 5e8, disk: null, delay: 3600 });
    // HTCondor 8.x: no bounds at all.
    expect(parseSubmit(["b", "app", "1", "j", "0", "0"]).bounds).toEqual({
      memory: null,
      disk: null,
      delay: null,
    });
  });

  it("refuses submits whose counts do not match the line", () => {
    expect(code(() => parseSubmit(["b", "app", "2", "j", "0", "0"]))).toBe("gahp.bad_arguments");
    expect(code(() => parseSubmit(["b", "app", "1", "j", "3", "x", "0"]))).toBe("gahp.bad_arguments");
    expect(code(() => parseSubmit(["b", "app", "1", "j", "0", "0", "NULL"]))).toBe("gahp.bad_arguments");
    expect(code(() => parseSubmit(["b", "app", "x", "j", "0", "0"]))).toBe("gahp.bad_arguments");
    expect(code(() => parseSubmit(["b", "app", "1", "j", "0", "1", "/a/b", "../b"]))).toBe(
      "gahp.bad_arguments",
    );
    expect(
      code(() =>
        parseSubmit(["b", "app", "1", "j", "0", "0", "NULL", "NULL", "lots", "NULL", "NULL", "NULL"]),
      ),
    ).toBe("gahp.bad_arguments");
    expect(code(() => parseSubmit(["", "app", "1", "j", "0", "0"]))).toBe("gahp.bad_arguments");
  });

  it("reads BOINC_FETCH_OUTPUT's mode and file specs", () => {
    expect(parseFetch(["j", "/d", "/d/err", "SOME", "1", "out.txt", "renamed.txt"])).toEqual({
      job: "j",
      dir: "/d",
      stderr: "/d/err",
      all: false,
      specs: [{ src: "out.txt", dst: "renamed.txt" }],
    });
    expect(code(() => parseFetch(["j", "/d", "/d/err", "MOST", "0"]))).toBe("gahp.bad_arguments");
    expect(code(() => parseFetch(["j", "/d", "/d/err", "ALL", "1", "a"]))).toBe("gahp.bad_arguments");
    expect(code(() => parseFetch(["j", "rel", "err", "ALL", "0"]))).toBe("gahp.bad_arguments");
  });

  it("expands an app's command pattern", () => {
    expect(
      expandCommand(
        ["sh", "-c", "cd {inputs} && run {job}", "{app}", "{args}"],
        { job: "j#1", batch: "b", app: "a" },
        ["x", "y z"],
      ),
    ).toEqual(["sh", "-c", "cd /in/inputs && run j#1", "a", "x", "y z"]);
  });

  it("maps bundle states to BOINC statuses", () => {
    const s = (state: string, exitCode: number | null = null) => boincStatus({ state, exitCode });
    expect(["created", "staged", "starting"].map((x) => s(x))).toEqual([
      "NOT_STARTED",
      "NOT_STARTED",
      "NOT_STARTED",
    ]);
    expect(s("running")).toBe("IN_PROGRESS");
    expect(s("ready", 0)).toBe("DONE");
    expect(s("failed", 3)).toBe("DONE");
    expect(s("failed")).toBe("ERROR");
    expect(s("killed")).toBe("ERROR");
  });

  it("shares out a query answer too long for one line: oldest changes first, then the next query continues", () => {
    const job = (i: number, mod: number): QueriedJob => ({ job: `b#1.${i}`, status: "DONE", mod });
    const jobs = [job(0, 100), job(1, 100), job(2, 101), job(3, 102), job(4, 103)];
    // Each job costs 2 * 5 + 4 + 2 = 16 bytes, the line 64 + 12; room for three.
    const budget = 76 + 3 * 16;
    expect(fitQueryReply([jobs], 200, () => undefined, 76 + 5 * 16)).toEqual({
      batches: [jobs],
      serverTime: 200,
    });
    const first = fitQueryReply([[...jobs].reverse()], 200, () => undefined, budget);
    expect(first.batches[0]?.map((j) => j.job).sort()).toEqual(["b#1.0", "b#1.1", "b#1.2"]);
    expect(first.serverTime).toBeCloseTo(102 - 0.000001, 6);
    // The next query, from that time, gets the rest.
    const rest = jobs.filter((j) => j.mod >= first.serverTime);
    expect(fitQueryReply([rest], 200, () => undefined, budget).batches[0]?.map((j) => j.job)).toEqual([
      "b#1.3",
      "b#1.4",
    ]);

    // Five jobs changed at the same moment, room for three: those not yet reported as they are go first.
    const same = [0, 1, 2, 3, 4].map((i) => job(i, 100));
    const seen = new Map<string, string>();
    const a = fitQueryReply([same], 200, (j) => seen.get(j), budget);
    expect(a.serverTime).toBeLessThan(100);
    for (const j of a.batches[0] ?? []) seen.set(j.job, j.status);
    const b = fitQueryReply([same], 200, (j) => seen.get(j), budget);
    for (const j of b.batches[0] ?? []) seen.set(j.job, j.status);
    expect([...seen.keys()].sort()).toEqual(same.map((j) => j.job));
  });

  it("turns the BOINC bounds into the bundle's resources and limits, over the template's", () => {
    const template = {
      image: "img",
      command: ["run", "{args}"],
      resources: { vcpus: 2, ram: "1GiB", scratch: "4GiB" },
      limits: { time: "2h", network: true },
    };
    const job = { name: "b#1.0", args: ["a"], inputs: [] };
    const req = (memory: number | null, disk: number | null, delay: number | null) => ({
      batch: "b",
      app: "app",
      jobs: [job],
      bounds: { memory, disk, delay },
    });
    expect(bundleRequest(req(null, null, null), template, job, null)).toMatchObject({
      command: ["run", "a"],
      resources: { vcpus: 2, ram: "1GiB", scratch: "4GiB" },
      limits: { time: "2h", network: true },
      env: { GAHP_BATCH: "b", GAHP_JOB: "b#1.0", GAHP_APP: "app" },
    });
    const bounded = bundleRequest(req(5e8, 2 ** 33, 3599.5), template, job, "e2e01-bndl-000000000000001");
    expect(bounded).toMatchObject({
      resources: { vcpus: 2, ram: 500_000_000, scratch: 2 ** 33 },
      limits: { time: "3600s", disk: 2 ** 33, network: true },
      dependencies: [{ bundle: "e2e01-bndl-000000000000001", name: "inputs" }],
    });
    // A disk bound below the template's scratch keeps the scratch.
    expect(bundleRequest(req(null, 2 ** 20, null), template, job, null)["resources"]).toMatchObject({
      scratch: 4 * 2 ** 30,
    });
  });
});
