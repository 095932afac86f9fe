/**
 * `dispatch-cloud gahp` driven as HTCondor 9.x's gridmanager drives a BOINC GAHP (gahp-client.cpp, boincjob.cpp,
 * boincresource.cpp), against a real REST server running real bundles: `serve` on PGlite with a local VM behind
 * the embedded SSH server and real Docker. Request lines are built the gridmanager's way (escapeGahpString on
 * every argument except job names in BOINC_SUBMIT, paths with spaces, names with '#', empty arguments) and every
 * result's argument count is checked as the gridmanager checks it before it reads the values.
 */
import { mkdir, readFile, stat, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type BundleView, E2eSystem } from "./e2e-harness.ts";
import { esc, GahpProcess } from "./gahp-client.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";

const IMAGE = requireDockerImage();
const JOBS = 20;
const SCHEDD = "schedd@submit.example.org";
const STAMP = Math.floor(Date.now() / 1000);
const BATCH = `condor#${SCHEDD}#wordcount#${STAMP}`;
const SLEEP_BATCH = `condor#${SCHEDD}#sleeper#${STAMP}`;
const jobName = (batch: string, i: number) => `${batch}#42.${i}`;
const SHARED = "shared data.txt";
const SHARED_TEXT = "one\ntwo\nthree\n";
/** Stands for the submit directory in job specs made before it exists. */
const SUBMIT_DIR_MARK = "@SUBMIT@";

/** The result of BOINC_QUERY_BATCHES read as the gridmanager reads it. */
function readQuery(r: string[]): { time: string; batches: [string, string][][] } {
  expect(r.length, JSON.stringify(r)).toBeGreaterThanOrEqual(2);
  if (r[1] !== "NULL") throw new Error(`query failed: ${r[1]}`);
  expect(r.length).toBeGreaterThanOrEqual(3);
  const batches: [string, string][][] = [];
  let i = 3;
  while (i < r.length) {
    const n = Number(r[i]);
    expect(Number.isInteger(n)).toBe(true);
    i++;
    const jobs: [string, string][] = [];
    for (let j = 0; j < n; j++) {
      jobs.push([r[i] as string, r[i + 1] as string]);
      i += 2;
    }
    batches.push(jobs);
  }
  expect(i).toBe(r.length);
  return { time: r[2] as string, batches };
}

describe("dispatch-cloud gahp: HTCondor's gridmanager against real bundles", () => {
  let sys: E2eSystem;
  let gahp: GahpProcess;
  let dir: string;
  let config: string;
  let authFile: string;
  let token: string;

  beforeAll(async () => {
    sys = await E2eSystem.start({
      database: "pglite",
      sshServer: "embedded",
      runtimeEngine: "docker",
      maxInstances: 1,
    });
    dir = join(sys.dir, "submit node");
    await mkdir(join(dir, "in put"), { recursive: true });
    await writeFile(join(dir, "in put", SHARED), SHARED_TEXT);
    token = (await readFile(join(sys.dir, "data", "admin-token"), "utf8")).trim();
    // The gridmanager reads the authenticator from the job's BoincAuthenticatorFile and sends it.
    authFile = join(dir, "authenticator");
    await writeFile(authFile, `${token}\n`);
    config = join(dir, "gahp.yml");
    const script = [
      'cd "$0"',
      'n=$(cat "shared data.txt" | wc -l)',
      'echo "$GAHP_JOB $n $*" > /out/result.txt',
      "mkdir -p /out/sub",
      'cp "shared data.txt" /out/sub/copy.txt',
      'echo "to-stderr $2" >&2',
    ].join(" && ");
    await writeFile(
      config,
      [
        // Not the server: BOINC_SELECT_PROJECT names it, with the token as the authenticator.
        "apiUrl: http://127.0.0.1:9",
        "apps:",
        "  wordcount:",
        `    image: ${IMAGE}`,
        `    command: ["sh", "-c", ${JSON.stringify(script)}, "{inputs}", "{args}"]`,
        "    resources: {vcpus: 0.5, ram: 128MiB}",
        "  sleeper:",
        `    image: ${IMAGE}`,
        '    command: ["sleep", "600"]',
        "    resources: {vcpus: 0.5, ram: 128MiB}",
        "",
      ].join("\n"),
    );
    gahp = await startLikeGridmanager();
  }, 180_000);

  afterAll(async () => {
    await gahp?.close();
    await sys?.stop();
  }, 120_000);

  /** Start-up as the gridmanager does it: banner, COMMANDS, ASYNC_MODE_ON, then the project. */
  async function startLikeGridmanager(): Promise<GahpProcess> {
    const g = GahpProcess.start(["--config", config]);
    expect(await g.line()).toMatch(/^\$GahpVersion: /);
    const commands = await g.send("COMMANDS");
    expect(commands[0]).toBe("S");
    for (const c of ["BOINC_SUBMIT", "BOINC_QUERY_BATCHES", "BOINC_FETCH_OUTPUT", "BOINC_SELECT_PROJECT"])
      expect(commands).toContain(c);
    expect(await g.send("ASYNC_MODE_ON")).toEqual(["S"]);
    const auth = (await readFile(authFile, "utf8")).trim();
    expect(await g.send(`BOINC_SELECT_PROJECT ${esc(sys.apiUrl)} ${esc(auth)}`)).toEqual(["S"]);
    return g;
  }

  /** BOINC_SUBMIT's arguments as GahpClient::boinc_submit builds them. */
  function submitLine(
    batch: string,
    app: string,
    jobs: { name: string; args: string[]; inputs: [string, string][] }[],
    bounds: string[],
  ): string {
    let line = `${esc(batch)} ${esc(app)} ${jobs.length}`;
    for (const j of jobs) {
      line += ` ${j.name} ${j.args.length}`;
      for (const a of j.args) line += ` ${esc(a)}`;
      line += ` ${j.inputs.length}`;
      for (const [src, dst] of j.inputs) line += ` ${esc(src.replace(SUBMIT_DIR_MARK, dir))} ${esc(dst)}`;
    }
    return `${line} ${bounds.map(esc).join(" ")}`;
  }

  const wordcountJobs = Array.from({ length: JOBS }, (_, i) => ({
    name: jobName(BATCH, i),
    // An empty last argument: the gridmanager sends it as two spaces.
    args: ["-n", `item ${i}`, ""],
    inputs: [[`${SUBMIT_DIR_MARK}/in put/${SHARED}`, SHARED] as [string, string]],
  }));
  // rsc_fpops_est rsc_fpops_bound rsc_memory_bound rsc_disk_bound delay_bound app_version_num
  const BOUNDS = ["NULL", "NULL", "268435456", "NULL", "3600", "NULL"];

  const single = async (g: GahpProcess, command: string, args: string): Promise<string[]> => {
    const r = await g.result(await g.request(command, args));
    // Every BOINC command but QUERY and FETCH answers exactly one value (NULL or the error).
    expect(r, `${command}: ${JSON.stringify(r)}`).toHaveLength(2);
    return r;
  };

  const bundlesOf = async (): Promise<BundleView[]> => {
    const out: BundleView[] = [];
    let cursor: string | null = null;
    do {
      const page: { items: BundleView[]; nextCursor: string | null } = await sys.json(
        "GET",
        `/bundles?limit=500${cursor === null ? "" : `&cursor=${encodeURIComponent(cursor)}`}`,
      );
      out.push(...page.items);
      cursor = page.nextCursor;
    } while (cursor !== null);
    return out;
  };
  const envOf = (b: BundleView) => (b["env"] ?? {}) as Record<string, string>;

  it("pings, submits a batch of 20 jobs sharing one input file (uploaded once), and resubmits it idempotently", async () => {
    expect(await single(gahp, "BOINC_PING", "")).toEqual([expect.any(String), "NULL"]);
    const line = submitLine(BATCH, "wordcount", wordcountJobs, BOUNDS);
    expect((await single(gahp, "BOINC_SUBMIT", line))[1]).toBe("NULL");
    expect(gahp.stderr).toMatch(/submit .*: 20 jobs, 1 input files, 1 uploaded/);

    const all = await bundlesOf();
    const jobs = all.filter((b) => envOf(b)["GAHP_BATCH"] === BATCH);
    expect(jobs.map((b) => envOf(b)["GAHP_JOB"]).sort()).toEqual(wordcountJobs.map((j) => j.name).sort());
    // One tree of inputs for all 20, uploaded once as one ready bundle they all depend on.
    const trees = new Set(jobs.map((b) => JSON.stringify(b["dependencies"])));
    expect(trees.size).toBe(1);
    const [dep] = JSON.parse([...trees][0] as string) as { bundle: string; name: string }[];
    expect(dep?.name).toBe("inputs");
    expect(all.filter((b) => b.uuid === dep?.bundle).map((b) => b.state)).toEqual(["ready"]);
    // The BOINC bounds: memory -> RAM, delay_bound -> the time limit.
    expect(jobs[0]?.["resources"]).toMatchObject({ ram: 268435456, vcpus: 0.5 });
    expect(jobs[0]?.["limits"]).toMatchObject({ time: 3_600_000 });

    // The gridmanager resubmits a batch it is unsure of; a GAHP started afresh knows it from the bundles.
    const again = await startLikeGridmanager();
    try {
      expect((await single(again, "BOINC_SUBMIT", line))[1]).toBe("NULL");
    } finally {
      expect(await again.close()).toBe(0);
    }
    const after = await bundlesOf();
    expect(after.filter((b) => envOf(b)["GAHP_BATCH"] === BATCH)).toHaveLength(JOBS);
    expect(after).toHaveLength(all.length);
  }, 180_000);

  it("polls the batch until every job is DONE, and says which batch it does not know", async () => {
    const seen = new Set<string>();
    let done = 0;
    const until = Date.now() + 400_000;
    while (done < JOBS) {
      if (Date.now() > until)
        throw new Error(`only ${done} of ${JOBS} DONE; output:\n${sys.output().slice(-4000)}`);
      const q = readQuery(await gahp.result(await gahp.request("BOINC_QUERY_BATCHES", `0 1 ${esc(BATCH)}`)));
      expect(q.batches).toHaveLength(1);
      const jobs = q.batches[0] as [string, string][];
      expect(jobs.map(([n]) => n).sort()).toEqual(wordcountJobs.map((j) => j.name).sort());
      for (const [, s] of jobs) {
        expect(["NOT_STARTED", "IN_PROGRESS", "DONE"]).toContain(s);
        seen.add(s);
      }
      done = jobs.filter(([, s]) => s === "DONE").length;
      if (done < JOBS) await new Promise((ok) => setTimeout(ok, 1000));
    }
    expect(seen).toContain("DONE");
    // Only jobs changed since min_mod_time: none after the far future.
    const later = readQuery(
      await gahp.result(await gahp.request("BOINC_QUERY_BATCHES", `${STAMP + 10_000_000} 1 ${esc(BATCH)}`)),
    );
    expect(later.batches).toEqual([[]]);
    expect(Number(later.time)).toBeGreaterThan(STAMP - 60);

    const missing = `${BATCH}#nope`;
    const r = await single(gahp, "BOINC_QUERY_BATCHES", `0 2 ${esc(BATCH)} ${esc(missing)}`);
    // boincresource.cpp finds "no batch named " and takes the rest as the batch's name.
    const msg = r[1] as string;
    expect(msg.slice(msg.indexOf("no batch named ") + 15)).toBe(missing);
  }, 420_000);

  it("fetches every job's outputs at once, results in any order, into a directory with spaces", async () => {
    const iwd = join(dir, "iwd dir");
    await mkdir(iwd, { recursive: true });
    // transfer_output_files = result.txt with a remap, and the job's error file: all fetches in flight together.
    const reqids = new Map<number, number>();
    for (let i = 0; i < JOBS; i++) {
      // BuildOutputInfo: the transfer_output_files (remapped), then the error file as (its base name, itself).
      const err = join(iwd, `job ${i}.err`);
      const args = `${wordcountJobs[i]?.name} ${esc(iwd)} ${esc(err)} SOME 2 result.txt ${esc(`result ${i}.txt`)} ${esc(`job ${i}.err`)} ${esc(err)}`;
      reqids.set(await gahp.request("BOINC_FETCH_OUTPUT", args), i);
    }
    for (const [reqid, i] of reqids) {
      const r = await gahp.result(reqid);
      // NULL <exit status> <wall clock> <cpu>: exactly 5 arguments with the request id.
      expect(r, JSON.stringify(r)).toHaveLength(5);
      expect(r[1]).toBe("NULL");
      expect(r[2]).toBe("0");
      expect(Number(r[3])).toBeGreaterThanOrEqual(0);
      expect(Number(r[4])).toBeGreaterThanOrEqual(0);
      expect(await readFile(join(iwd, `result ${i}.txt`), "utf8")).toBe(
        `${jobName(BATCH, i)} 3 -n item ${i} \n`,
      );
      expect(await readFile(join(iwd, `job ${i}.err`), "utf8")).toContain(`to-stderr item ${i}`);
    }

    // ALL: every output file, directories made; a spec renames one of them.
    const allDir = join(dir, "all outputs");
    await mkdir(allDir);
    const r = await gahp.result(
      await gahp.request(
        "BOINC_FETCH_OUTPUT",
        `${wordcountJobs[3]?.name} ${esc(allDir)} ${esc("/dev/null")} ALL 1 result.txt ${esc("renamed result.txt")}`,
      ),
    );
    expect(r).toHaveLength(5);
    expect(await readFile(join(allDir, "sub", "copy.txt"), "utf8")).toBe(SHARED_TEXT);
    expect(await readFile(join(allDir, "renamed result.txt"), "utf8")).toBe(
      `${jobName(BATCH, 3)} 3 -n item 3 \n`,
    );
    await expect(stat(join(allDir, "result.txt"))).rejects.toThrow();

    // A file the job did not write: one error argument.
    const bad = await single(
      gahp,
      "BOINC_FETCH_OUTPUT",
      `${wordcountJobs[0]?.name} ${esc(iwd)} ${esc("/dev/null")} SOME 1 nothing.txt nothing.txt`,
    );
    expect(bad[1]).toMatch(/^gahp\.output_failed: .* has no output file nothing\.txt/);
  }, 180_000);

  it("aborts a job, lets an expired lease clean up its batch, and retires the finished batch", async () => {
    const sleepers = [0, 1].map((i) => ({ name: jobName(SLEEP_BATCH, i), args: [], inputs: [] }));
    expect(
      (await single(gahp, "BOINC_SUBMIT", submitLine(SLEEP_BATCH, "sleeper", sleepers, BOUNDS)))[1],
    ).toBe("NULL");
    expect((await single(gahp, "BOINC_ABORT_JOBS", esc(sleepers[0]?.name as string)))[1]).toBe("NULL");
    const q = readQuery(
      await gahp.result(await gahp.request("BOINC_QUERY_BATCHES", `0 1 ${esc(SLEEP_BATCH)}`)),
    );
    const status = new Map(q.batches[0]);
    expect(status.get(sleepers[0]?.name as string)).toBe("ERROR");
    expect(status.get(sleepers[1]?.name as string)).not.toBe("ERROR");
    const unknown = await single(gahp, "BOINC_ABORT_JOBS", esc(`${SLEEP_BATCH}#9.9`));
    expect(unknown[1]).toMatch(/^gahp\.unknown_job: no job named /);

    // A lease that has already ended: the batch's jobs are aborted and the batch is gone.
    const sleeper = (await bundlesOf()).find((b) => envOf(b)["GAHP_JOB"] === sleepers[1]?.name) as BundleView;
    expect((await single(gahp, "BOINC_SET_LEASE", `${esc(SLEEP_BATCH)} ${STAMP - 1}`))[1]).toBe("NULL");
    expect((await sys.waitState(sleeper.uuid, ["killed"], 60_000)).state).toBe("killed");

    expect((await single(gahp, "BOINC_RETIRE_BATCH", esc(BATCH)))[1]).toBe("NULL");
    for (const batch of [BATCH, SLEEP_BATCH]) {
      const gone = await single(gahp, "BOINC_QUERY_BATCHES", `0 1 ${esc(batch)}`);
      expect(gone[1]).toBe(`gahp.unknown_batch: no batch named ${batch}`);
    }
    // Retiring leaves finished jobs as they were.
    const finished = (await bundlesOf()).filter((b) => envOf(b)["GAHP_BATCH"] === BATCH);
    expect(finished.map((b) => b.state)).toEqual(Array(JOBS).fill("ready"));
    expect(await gahp.send("QUIT")).toEqual(["S"]);
    expect(await gahp.exited).toBe(0);
  }, 180_000);
});
