import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../../lib/errors.ts";
import { boincStatus, expandCommand, parseFetch, parseSubmit } from "./boinc.ts";

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
});
