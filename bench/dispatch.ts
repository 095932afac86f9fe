/**
 * bench:dispatch — how fast a submitted bundle reaches its runner. Starts `dispatch-cloud serve` (PGlite,
 * local driver with embedded SSH, the `process` runtime) as its own process, boots two VMs (10 bundle slots and
 * dispatcher.warmSupervisors 10 each) with a warm-up burst, then runs two phases:
 *
 * 1. back to back: N bundles (default 200) submitted one after another, each once the previous one has ended;
 * 2. bursts: B times (default 5), 20 bundles submitted at once (one batch request) to the two idle VMs, each
 *    burst once both VMs are quiet again: their warm spares ready and no other runner process (each phase starts
 *    so, after the warm-up too).
 *
 * For each phase it prints p50/p99 of the time from the submit request to crunch-run's `start` call (the
 * bundle's runningAt), the stages in between, and how many starts went to a warm spare; then, measured in the
 * same run, the SSH exec round trip to a VM and the time of one guarded UPDATE (a bundle transition on the same
 * PGlite database, after the server has stopped), the target (p50 <= 3 x (SSH round trip + guarded UPDATE),
 * p99 <= 2 x p50) and the load average. The floor is measured back to back, warm; for comparison it also measures
 * both its parts after IDLE_MS of idleness each, as a burst finds the machine (its VMs quiet for at least that
 * long), and prints the bursts' p50 against that floor beside the target: on some virtual machines every process
 * is much slower to answer after a rest (docs/performance.md). For the back-to-back phase it also prints, not
 * as targets, figures for reading its tail (printTail). For the bursts it also prints, not as a target, their p50
 * against a burst's own floor (burstFloor): the steps a burst's first bundles cannot skip, each measured alone.
 *
 * Usage: npm run bench:dispatch [-- --bundles N] [--bursts B] [--runner sea|cjs] [--db pglite|pg] [--probe-interval D]
 * --probe-interval: cloud.probeInterval of the server (default 2s); the warm path must not depend on it.
 * --db pg: the server on a fresh database of DISPATCH_CLOUD_TEST_PG_URL's PostgreSQL (scripts/test-services.sh).
 * BENCH_KEEP_DIR=1 keeps the run's directory; BENCH_SERVE_LOG=FILE copies the server's log there.
 */
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import {
  appendFileSync,
  existsSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  statSync,
  writeFileSync,
} from "node:fs";
import net from "node:net";
import { availableParallelism, cpus, loadavg, tmpdir, totalmem } from "node:os";
import path from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import ssh2 from "ssh2";
import { destroyLocalVms, withLocalVms } from "../cloud-drivers/local/driver.ts";
import { findPids, readCmdline } from "../cloud-drivers/local/procs.ts";
import { createLogger } from "../lib/logger.ts";
import { type Db, openDb } from "../store/db.ts";
import { insertBundle, insertBundles } from "../store/queries.ts";
import { markRunningByTokens, stageBundle, startBundles } from "../store/transitions.ts";
import { openTestDb, testBundleUuid, testNewBundle } from "../test/db.ts";
import { benchArgs } from "./args.ts";

const { values } = benchArgs(
  "Usage: npm run bench:dispatch [-- --bundles N] [--bursts B] [--runner sea|cjs] [--db pglite|pg] [--probe-interval D]",
  {
    options: {
      bundles: { type: "string", default: "200" },
      bursts: { type: "string", default: "5" },
      runner: { type: "string", default: "sea" },
      db: { type: "string", default: "pglite" },
      "probe-interval": { type: "string", default: "2s" },
    },
  },
);
if (values.runner !== "sea" && values.runner !== "cjs") throw new Error("--runner is sea or cjs");
if (values.db !== "pglite" && values.db !== "pg") throw new Error("--db is pglite or pg");
const PROBE_INTERVAL = values["probe-interval"] as string;
if (!/^[0-9]+(ms|s|m)$/.test(PROBE_INTERVAL))
  throw new Error("--probe-interval is a duration such as 2s or 1m");
const COUNT = Number(values.bundles);
const BURSTS = Number(values.bursts);
const BURST = 20;
const SLOTS = 10;
const WARM = 10;
const ROOT = path.resolve(import.meta.dirname, "..");
const BIN = path.join(ROOT, "bin", "dispatch-cloud");
const PORT = 18_900 + Math.floor(Math.random() * 1000);
const API = `http://127.0.0.1:${PORT}/api/v1`;

interface View {
  uuid: string;
  state: string;
  stateReason: string | null;
  timings: {
    createdAt: string;
    stagedAt: string | null;
    startingAt: string | null;
    runningAt: string | null;
  };
}

const dir = mkdtempSync(path.join(tmpdir(), "dc-bench-dispatch-"));
const quiet = createLogger({ level: "silent", format: "json" });
const progress = (line: string) => process.stderr.write(`${line}\n`);

/**
 * What the dispatcher deploys: `sea`, the single executable (npm run build:sea; built here if missing, or older
 * than a source file, so that the VMs never run an earlier crunch-run than the server's), as a production
 * install would; or `cjs`, the one-file build the dispatcher makes of its sources when run from them.
 */
async function runnerBinaryFor(kind: string): Promise<string> {
  if (kind === "cjs") return "";
  const sea = path.join(ROOT, "dist", "dispatch-cloud");
  const stale = existsSync(sea) && statSync(sea).mtimeMs < newestSourceMs();
  if (!existsSync(sea) || stale) {
    progress(
      `bench:dispatch: building the single executable (npm run build:sea)${stale ? ": a source file is newer than it" : ""}`,
    );
    execFileSync("npm", ["run", "--silent", "build:sea"], {
      cwd: ROOT,
      stdio: ["ignore", "ignore", "inherit"],
    });
  }
  return sea;
}

/** The newest modification time of the files the single executable is built from (git's list; tests aside). */
function newestSourceMs(): number {
  const files = execFileSync("git", ["ls-files", "-z", "--", "*.ts", "*.sql", "*.json"], { cwd: ROOT })
    .toString("utf8")
    .split("\0")
    .filter((f) => f !== "" && !f.startsWith("test/") && !f.startsWith("bench/") && !f.endsWith(".test.ts"));
  let newest = 0;
  for (const f of files) {
    const file = path.join(ROOT, f);
    if (existsSync(file)) newest = Math.max(newest, statSync(file).mtimeMs);
  }
  return newest;
}

let runnerBinary = "";
let dbUrl = `pglite:${dir}/data/pglite`;
/** uuid -> how the pool started its runner ("spare" or "detach"), from the serve process's log. */
const startedVia = new Map<string, string>();

function startServe(): Promise<ChildProcess> {
  const config = path.join(dir, "config.yml");
  writeFileSync(
    config,
    [
      "clusterId: bench",
      `dataDir: ${dir}/data`,
      `database:\n  url: "${dbUrl}"`,
      `restServer:\n  listen: "127.0.0.1:${PORT}"`,
      // Not the default port: a dispatch-cloud of the user's (the README's first run) may hold it.
      `management:\n  listen: "127.0.0.1:${PORT + 1000}"`,
      // info: the pool's "runner started" lines say which way each runner was started.
      `logging:\n  level: ${process.env["BENCH_LOG_LEVEL"] ?? "info"}\n  format: json`,
      `dispatcher:\n  runtimeEngine: process\n  warmSupervisors: ${WARM}`,
      `cloud:\n  driver: local\n  driverParameters:\n    stateDir: ${dir}/vms\n  timeoutIdle: 1h\n  maxInstances: 2`,
      `  maxRunningBundlesPerInstance: ${SLOTS}\n  probeInterval: ${PROBE_INTERVAL}`,
      ...(runnerBinary === "" ? [] : [`  deployRunnerBinary: ${runnerBinary}`]),
      "instanceTypes:\n  bench.large:\n    vcpus: 64\n    ram: 256GiB\n    price: 1",
      "",
    ].join("\n"),
  );
  const child = spawn(BIN, ["serve", "--config", config], { cwd: dir, stdio: ["ignore", "ignore", "pipe"] });
  let err = "";
  let partial = "";
  return new Promise((resolve, reject) => {
    const keep = process.env["BENCH_SERVE_LOG"];
    child.stderr?.on("data", (d: Buffer) => {
      if (keep !== undefined) appendFileSync(keep, d);
      if (err.length < 100_000) err += d.toString();
      if (/REST API at/.test(err)) resolve(child);
      partial += d.toString();
      const lines = partial.split("\n");
      partial = lines.pop() ?? "";
      for (const line of lines) {
        if (!line.includes('"runner started"')) continue;
        try {
          const l = JSON.parse(line) as { uuid?: string; via?: string };
          if (l.uuid !== undefined && l.via !== undefined) startedVia.set(l.uuid, l.via);
        } catch {
          // not a log line
        }
      }
    });
    child.once("exit", (code) => reject(new Error(`serve exited ${code}:\n${err}`)));
  });
}

let token = "";
async function call<T>(method: string, url: string, body?: unknown): Promise<T> {
  const res = await fetch(`${API}${url}`, {
    method,
    headers: {
      authorization: `Bearer ${token}`,
      ...(body === undefined ? {} : { "content-type": "application/json" }),
    },
    ...(body === undefined ? {} : { body: JSON.stringify(body) }),
  });
  const text = await res.text();
  if (!res.ok) throw new Error(`${method} ${url}: ${res.status} ${text}`);
  return JSON.parse(text) as T;
}

const BUNDLE = { image: "none", command: ["true"], resources: { vcpus: 1, ram: "64MiB" } };

/**
 * How long after the submit's answer the first poll comes: past the starts being timed (8-30 ms here), so that
 * the benchmark's own requests do not share the server with them. Polling at once put one or two of its GETs
 * inside each burst (one took 16 ms, the server busy with the burst's `start` calls); alternately with and
 * without this wait, bursts p50 17-18 against 20-24 ms (docs/performance.md, 2026-11-28 10:58-11:12).
 */
const FIRST_POLL_MS = 50;

/**
 * Polls until the bundle has ended (ready). The figures come from the bundle's own timestamps, so the polling
 * only needs to be gentle: from FIRST_POLL_MS on, one request at a time, every 20 ms (polling each bundle every
 * 2 ms, as this benchmark once did, made its own requests a large part of the server's load).
 */
async function waitEnded(uuids: string[]): Promise<View[]> {
  const left = new Set(uuids);
  const done = new Map<string, View>();
  await sleep(FIRST_POLL_MS);
  for (;;) {
    for (const uuid of left) {
      const b = await call<View>("GET", `/bundles/${uuid}`);
      if (b.state === "failed" || b.state === "killed")
        throw new Error(`bundle ${uuid} ${b.state}: ${b.stateReason}`);
      if (b.state === "ready") {
        done.set(uuid, b);
        left.delete(uuid);
      }
    }
    if (left.size === 0) return uuids.map((u) => done.get(u) as View);
    await sleep(20);
  }
}

function percentile(sorted: number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]!;
}

function summary(xs: number[]): string {
  const s = [...xs].sort((a, b) => a - b);
  return `p50 ${percentile(s, 50).toFixed(1)} ms, p99 ${percentile(s, 99).toFixed(1)} ms`;
}

/** How long the machine rests before each of the "after a rest" SSH round trips (a burst waits >= 400 ms). */
const IDLE_MS = 500;

/** `n` SSH exec round trips over one connection, each `restMs` after the one before. */
async function sshRoundTrips(n: number, restMs = 0): Promise<number[]> {
  const vm = await withLocalVms(`${dir}/vms`, quiet, async ([first]) => first);
  if (vm === undefined) throw new Error("no VM");
  const [host, port] = [
    vm.address.slice(0, vm.address.lastIndexOf(":")),
    vm.address.slice(vm.address.lastIndexOf(":") + 1),
  ];
  // As the dispatcher's executor does: TCP_NODELAY, or Nagle and delayed ACKs add ~40 ms per command.
  const sock = net.connect({ host, port: Number(port) });
  sock.setNoDelay(true);
  const client = new ssh2.Client();
  await new Promise<void>((ok, fail) => {
    client.once("ready", ok).once("error", fail);
    client.connect({
      sock,
      username: vm.remoteUser,
      privateKey: readFileSync(`${dir}/data/dispatcher-ssh-key`),
    });
  });
  const times: number[] = [];
  for (let i = 0; i < n; i++) {
    if (restMs > 0) await sleep(restMs);
    const t0 = performance.now();
    await new Promise<void>((ok, fail) =>
      client.exec("true", (err, ch) => {
        if (err) return fail(err);
        ch.on("close", () => ok()).resume();
      }),
    );
    times.push(performance.now() - t0);
  }
  client.end();
  return times;
}

/**
 * Per VM root: its ready warm spares (crunch-run titles a spare `crunch-run spare` once it has loaded), and its
 * other processes besides the warm pool and the local VM's own (vm-main): a spare still loading, a supervisor on its
 * way back to the pool or being let go, a `--list`.
 */
function vmProcesses(): { ready: number; busy: number }[] {
  const vmsDir = `${dir}/vms`;
  const roots = existsSync(vmsDir)
    ? readdirSync(vmsDir)
        .map((id) => path.join(vmsDir, id, "root"))
        .filter((r) => existsSync(r))
    : [];
  return roots.map((root) => {
    const titles = findPids({ env: ["DISPATCH_VM_ROOT", root] }).map((pid) =>
      (readCmdline(pid) ?? []).join(" "),
    );
    return {
      ready: titles.filter((t) => t === "crunch-run spare").length,
      busy: titles.filter(
        (t) => t !== "crunch-run spare" && t !== "crunch-run warm-pool" && t !== "" && !t.includes("vm-main"),
      ).length,
    };
  });
}

/**
 * Waits (up to 60 s) until both VMs are quiet: their warm spares ready and no other crunch-run process (a spare
 * still starting takes hundreds of ms of CPU) in two looks 200 ms apart. Says so if they do not get there.
 */
async function sparesReady(): Promise<void> {
  const t0 = Date.now();
  const deadline = t0 + 60_000;
  let quietBefore = false;
  for (;;) {
    const vms = vmProcesses();
    const quiet = vms.length >= 2 && vms.every((v) => v.ready >= WARM && v.busy === 0);
    if (quiet && quietBefore) {
      progress(`bench:dispatch: VMs quiet after ${Date.now() - t0} ms`);
      return;
    }
    quietBefore = quiet;
    if (Date.now() > deadline) {
      const said = vms.map((v) => `${v.ready} ready, ${v.busy} other`).join("; ");
      progress(`bench:dispatch: VMs not quiet after 60 s (${said}; wanted ${WARM} ready, 0 other); going on`);
      return;
    }
    await sleep(200);
  }
}

interface Phase {
  total: number[];
  toStaged: number[];
  toStarting: number[];
  toRunning: number[];
  warm: number;
  count: number;
  /** submit -> start p50 of each group submitted together (each burst), in order. */
  groups: number[];
}

const newPhase = (): Phase => ({
  total: [],
  toStaged: [],
  toStarting: [],
  toRunning: [],
  warm: 0,
  count: 0,
  groups: [],
});

function record(p: Phase, t0: number, v: View): void {
  const at = (s: string | null) => Date.parse(s ?? "");
  p.total.push(at(v.timings.runningAt) - t0);
  p.toStaged.push(at(v.timings.stagedAt) - t0);
  p.toStarting.push(at(v.timings.startingAt) - at(v.timings.stagedAt));
  p.toRunning.push(at(v.timings.runningAt) - at(v.timings.startingAt));
  p.count++;
  if (startedVia.get(v.uuid) === "spare") p.warm++;
}

const p50of = (xs: number[]) =>
  percentile(
    [...xs].sort((a, b) => a - b),
    50,
  );
const p99of = (xs: number[]) =>
  percentile(
    [...xs].sort((a, b) => a - b),
    99,
  );

/**
 * `restedFloor`, for bursts: the same floor measured after IDLE_MS of rest, as a burst finds the machine. Its
 * ratio is printed beside the target's, not instead of it.
 */
function printPhase(title: string, p: Phase, floor: number, restedFloor?: number): void {
  const p50 = p50of(p.total);
  const p99 = p99of(p.total);
  console.log(title);
  console.log(`  submit -> crunch-run start: ${summary(p.total)}`);
  console.log(`    submit -> staged:         ${summary(p.toStaged)}`);
  console.log(`    staged -> starting:       ${summary(p.toStarting)}   (queue, scheduler, guarded UPDATE)`);
  console.log(
    `    starting -> running:      ${summary(p.toRunning)}   (hand-off to a warm spare or --detach, start call)`,
  );
  console.log(`  started by a warm spare: ${p.warm} of ${p.count} (the rest by crunch-run --detach)`);
  if (p.groups.length > 0)
    console.log(`  p50 of each burst, in order: ${p.groups.map((g) => `${g} ms`).join(", ")}`);
  const ok = (b: boolean) => (b ? "met" : "NOT met");
  console.log(
    `  target p50 <= 3 x (SSH round trip + guarded UPDATE) = ${(3 * floor).toFixed(1)} ms: ${ok(p50 <= 3 * floor)} (p50 = ${(p50 / floor).toFixed(2)} x)`,
  );
  if (restedFloor !== undefined)
    console.log(
      `  against the floor after ${IDLE_MS} ms of rest (3 x ${restedFloor.toFixed(1)} = ${(3 * restedFloor).toFixed(1)} ms; not the target): ${(p50 / restedFloor).toFixed(2)} x`,
    );
  console.log(
    `  target p99 <= 2 x p50 = ${(2 * p50).toFixed(1)} ms: ${ok(p99 <= 2 * p50)} (p99 = ${(p99 / p50).toFixed(2)} x p50)`,
  );
}

/** The back-to-back phase's tail is also shown by blocks of this many starts, in submission order. */
const TAIL_BLOCK = 100;

/**
 * Not targets: figures for reading the back-to-back tail (docs/performance.md). The tail in milliseconds beside
 * the ratio; how many starts took more than 2 x the phase's p50 in each block of TAIL_BLOCK, in order (a fresh
 * server's JIT warm-up shows as higher counts in the first blocks); and p50/p99 without the phase's first half.
 */
function printTail(total: number[]): void {
  if (total.length < 2 * TAIL_BLOCK) return;
  const [p50, p99] = [p50of(total), p99of(total)];
  const over: number[] = [];
  for (let i = 0; i + TAIL_BLOCK <= total.length; i += TAIL_BLOCK)
    over.push(total.slice(i, i + TAIL_BLOCK).filter((t) => t > 2 * p50).length);
  const later = total.slice(Math.floor(total.length / 2));
  const [p50b, p99b] = [p50of(later), p99of(later)];
  console.log(`  not targets: p99 - p50 = ${(p99 - p50).toFixed(1)} ms`);
  console.log(`    starts over 2 x p50, per ${TAIL_BLOCK} in order: ${over.join(" ")}`);
  console.log(
    `    the phase's second half alone (${later.length} starts): p50 ${p50b.toFixed(1)} ms, p99 ${p99b.toFixed(1)} ms (${(p99b / p50b).toFixed(2)} x p50)`,
  );
}

/** BURST bundles in one batch request. */
async function submitBurst(): Promise<View[]> {
  const res = await call<{ items: View[] }>("POST", "/bundles/batch", {
    items: Array.from({ length: BURST }, () => BUNDLE),
  });
  return res.items;
}

/**
 * Times `n` guarded transitions (created -> staged: one guarded UPDATE with its event row and NOTIFY), each
 * `restMs` after the one before.
 */
async function guardedUpdates(n: number, restMs = 0): Promise<number[]> {
  return withServerDb(async (db, owner) => {
    const times: number[] = [];
    for (let i = 0; i < n; i++) {
      const uuid = testBundleUuid();
      await insertBundle(db, uuid, testNewBundle(owner), "created");
      if (restMs > 0) await sleep(restMs);
      const t0 = performance.now();
      const res = await stageBundle(db, uuid, { actor: "bench" });
      times.push(performance.now() - t0);
      if (!res.ok) throw new Error(`guarded UPDATE of ${uuid} did not apply: ${res.reason}`);
    }
    return times;
  });
}

/** Runs `fn` on the stopped server's database, with the uuid of a user of it (the owner of the bench's bundles). */
async function withServerDb<T>(fn: (db: Db, owner: string) => Promise<T>): Promise<T> {
  const db = await openDb(dbUrl);
  try {
    const { rows } = await db.query<{ uuid: string }>("SELECT uuid FROM users LIMIT 1");
    const owner = rows[0]?.uuid;
    if (owner === undefined) throw new Error("no user in the database");
    return await fn(db, owner);
  } finally {
    await db.close();
  }
}

/** burstFloor's steps, each step's time in every round, in ms. */
interface BurstSteps {
  insert: number[];
  claim: number[];
  start: number[];
}

/**
 * A burst's own floor, its steps each timed in `rounds` rounds `restMs` apart (as a burst finds the machine): the
 * insert of BURST bundles (one statement, as the batch request makes it), the claim of all of them (one
 * statement, as a scheduling pass makes it) and one instance's `start` of SLOTS of them (one statement, as its
 * warm pool's call makes it). With the SSH round trip of the hand-off, these are what the first instance's
 * bundles wait for whatever the server does; HTTP, the pass and the processes on the VM come on top.
 */
async function burstFloor(rounds: number, restMs: number): Promise<BurstSteps> {
  return withServerDb(async (db, owner) => {
    const steps: BurstSteps = { insert: [], claim: [], start: [] };
    for (let r = 0; r < rounds; r++) {
      const items = Array.from({ length: BURST }, () => ({
        uuid: testBundleUuid(),
        bundle: testNewBundle(owner),
      }));
      const hashes = items.map(() => randomBytes(32).toString("hex"));
      await sleep(restMs);
      const t0 = performance.now();
      await insertBundles(db, owner, items, "submitted");
      const t1 = performance.now();
      const claimed = await startBundles(
        db,
        items.map((it, i) => ({
          uuid: it.uuid,
          instanceId: `bench-instance-${i % 2}`,
          instanceType: "bench",
          runnerTokenHash: hashes[i] as string,
          gpuDevices: [],
        })),
        "bench",
      );
      const t2 = performance.now();
      const running = await markRunningByTokens(db, hashes.slice(0, SLOTS), "bench");
      const t3 = performance.now();
      if (claimed.size !== BURST || running.size !== SLOTS)
        throw new Error(
          `burst floor: ${claimed.size} of ${BURST} claimed, ${running.size} of ${SLOTS} running`,
        );
      steps.insert.push(t1 - t0);
      steps.claim.push(t2 - t1);
      steps.start.push(t3 - t2);
    }
    return steps;
  });
}

/** Not a target: the bursts' p50 against a burst's own floor (burstFloor), the SSH round trip measured alike. */
function printBurstFloor(how: string, ssh: number[], own: BurstSteps, bursts: number[]): void {
  const parts = [p50of(ssh), p50of(own.insert), p50of(own.claim), p50of(own.start)];
  const floor = parts.reduce((a, b) => a + b, 0);
  const [rtt, insert, claim, start] = parts.map((x) => x.toFixed(1));
  console.log(
    `  not a target: a burst's own floor, ${how} = SSH round trip p50 ${rtt} + insert of ${BURST} p50 ${insert} + claim of ${BURST} p50 ${claim} + start of ${SLOTS} p50 ${start} = ${floor.toFixed(1)} ms; bursts p50 = ${(p50of(bursts) / floor).toFixed(2)} x it`,
  );
}

async function main(): Promise<void> {
  runnerBinary = await runnerBinaryFor(values.runner as string);
  // PostgreSQL: a fresh migrated database on DISPATCH_CLOUD_TEST_PG_URL's server (scripts/test-services.sh).
  const pgDb = values.db === "pg" ? await openTestDb("pg") : null;
  if (pgDb !== null) dbUrl = pgDb.url;
  progress(`bench:dispatch: starting serve in ${dir}; crunch-run is ${runnerBinary || "the one-file build"}`);
  const load0 = loadavg();
  const serve = await startServe();
  const backToBack = newPhase();
  const burst = newPhase();
  let ssh: number[] = [];
  let sshRested: number[] = [];
  let serveStopped = false;
  try {
    token = readFileSync(`${dir}/data/admin-token`, "utf8").trim();
    progress(`bench:dispatch: booting two VMs with a warm-up burst of ${BURST} bundles`);
    await waitEnded((await submitBurst()).map((b) => b.uuid));
    await sparesReady();
    for (let i = 0; i < COUNT; i++) {
      const t0 = Date.now();
      const b = await call<View>("POST", "/bundles", BUNDLE);
      // The next bundle comes to an idle VM again: this one has ended.
      const [v] = await waitEnded([b.uuid]);
      record(backToBack, t0, v as View);
      if ((i + 1) % 50 === 0) progress(`bench:dispatch: back to back: ${i + 1}/${COUNT} bundles started`);
    }
    for (let i = 0; i < BURSTS; i++) {
      await sparesReady();
      const t0 = Date.now();
      const batch = await submitBurst();
      const from = burst.total.length;
      for (const v of await waitEnded(batch.map((b) => b.uuid))) record(burst, t0, v);
      burst.groups.push(p50of(burst.total.slice(from)));
      progress(`bench:dispatch: burst ${i + 1}/${BURSTS} started`);
    }
    ssh = await sshRoundTrips(COUNT);
    progress(`bench:dispatch: 20 SSH round trips, each after ${IDLE_MS} ms of rest`);
    sshRested = await sshRoundTrips(20, IDLE_MS);
  } finally {
    serve.kill("SIGTERM");
    await new Promise((r) => serve.once("exit", r));
    serveStopped = true;
  }
  try {
    const updates = await guardedUpdates(Math.max(50, COUNT));
    progress(`bench:dispatch: 20 guarded UPDATEs, each after ${IDLE_MS} ms of rest`);
    const updatesRested = await guardedUpdates(20, IDLE_MS);
    progress(
      `bench:dispatch: a burst's own floor, back to back, then 20 rounds each after ${IDLE_MS} ms of rest`,
    );
    const ownWarm = await burstFloor(Math.max(50, BURSTS * 10), 0);
    const own = await burstFloor(20, IDLE_MS);
    const load1 = loadavg();
    const sshP50 = p50of(ssh);
    const updP50 = p50of(updates);
    const floor = sshP50 + updP50;
    const restedFloor = p50of(sshRested) + p50of(updatesRested);
    console.log(
      `bench:dispatch: ${availableParallelism()} CPUs (${cpus()[0]?.model ?? "?"}), ${(totalmem() / 2 ** 30).toFixed(0)} GiB; load average ${load0.map((x) => x.toFixed(2)).join(" ")} at the start, ${load1.map((x) => x.toFixed(2)).join(" ")} at the end`,
    );
    console.log(
      `  crunch-run deployed from ${values.runner === "sea" ? "the single executable" : "the one-file .cjs"}; two local VMs, ${SLOTS} bundle slots and ${WARM} warm spare supervisors each; probes every ${PROBE_INTERVAL}`,
    );
    console.log(`  SSH exec round trip (same VM, same run): ${summary(ssh)}`);
    console.log(
      `  the same after ${IDLE_MS} ms of rest each (as a burst finds the machine; not in the floor): ${summary(sshRested)}`,
    );
    console.log(
      `  one guarded UPDATE (created -> staged, same ${values.db === "pg" ? "PostgreSQL" : "PGlite"} database): ${summary(updates)}`,
    );
    console.log(`  the same after ${IDLE_MS} ms of rest each (not in the floor): ${summary(updatesRested)}`);
    console.log(`  floor = p50 SSH round trip + p50 guarded UPDATE = ${floor.toFixed(1)} ms`);
    console.log(`  the same after a rest = ${restedFloor.toFixed(1)} ms (bursts are also compared with it)`);
    printPhase(
      `back to back: ${COUNT} bundles, each submitted once the previous one has ended`,
      backToBack,
      floor,
    );
    printTail(backToBack.total);
    printPhase(
      `bursts: ${BURSTS} x ${BURST} bundles submitted at once to the two idle VMs`,
      burst,
      floor,
      restedFloor,
    );
    printBurstFloor("back to back, warm", ssh, ownWarm, burst.total);
    printBurstFloor(`after ${IDLE_MS} ms of rest each`, sshRested, own, burst.total);
  } finally {
    if (!serveStopped) serve.kill("SIGTERM");
    await destroyLocalVms(`${dir}/vms`, quiet);
    await pgDb?.close().catch(() => {});
    // BENCH_KEEP_DIR=1 keeps the run's directory (the runners' logs on the VMs) for a look afterwards.
    if (process.env["BENCH_KEEP_DIR"] === undefined) rmSync(dir, { recursive: true, force: true });
    else progress(`bench:dispatch: kept ${dir}`);
  }
}

await main();
