/**
 * bench:dispatch — how fast a submitted bundle reaches its runner. Starts `dispatch-cloud serve` (PGlite,
 * local driver with embedded SSH, the `process` runtime) as its own process, boots one VM with a warm-up
 * bundle, then submits 200 bundles one after another (each once the previous one has ended, so each finds
 * the VM idle) and prints
 * p50/p99 of the time from the submit request to crunch-run's `start` call (the bundle's runningAt), the
 * stages in between, and the SSH exec round trip to the same VM measured in the same run, with the ratio.
 *
 * Usage: npm run bench:dispatch [-- --bundles N] [--runner sea|cjs]
 */
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { appendFileSync, existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { parseArgs } from "node:util";
import ssh2 from "ssh2";
import { destroyLocalVms, withLocalVms } from "../cloud-drivers/local/driver.ts";
import { createLogger } from "../lib/logger.ts";

const { values } = parseArgs({
  options: { bundles: { type: "string", default: "200" }, runner: { type: "string", default: "sea" } },
});
if (values.runner !== "sea" && values.runner !== "cjs") throw new Error("--runner is sea or cjs");
const COUNT = Number(values.bundles);
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
 * What the dispatcher deploys: `sea`, the single executable (npm run build:sea; built here if missing), as a
 * production install would; or `cjs`, the one-file build the dispatcher makes of its sources when run from them.
 */
async function runnerBinaryFor(kind: string): Promise<string> {
  if (kind === "cjs") return "";
  const sea = path.join(ROOT, "dist", "dispatch-cloud");
  if (!existsSync(sea)) {
    progress("bench:dispatch: building the single executable (npm run build:sea)");
    execFileSync("npm", ["run", "--silent", "build:sea"], {
      cwd: ROOT,
      stdio: ["ignore", "ignore", "inherit"],
    });
  }
  return sea;
}

let runnerBinary = "";

function startServe(): Promise<ChildProcess> {
  const config = path.join(dir, "config.yml");
  writeFileSync(
    config,
    [
      "clusterId: bench",
      `dataDir: ${dir}/data`,
      `database:\n  url: "pglite:${dir}/data/pglite"`,
      `restServer:\n  listen: "127.0.0.1:${PORT}"`,
      `logging:\n  level: ${process.env["BENCH_LOG_LEVEL"] ?? "warn"}`,
      "dispatcher:\n  runtimeEngine: process",
      `cloud:\n  driver: local\n  driverParameters:\n    stateDir: ${dir}/vms\n  timeoutIdle: 1h\n  maxInstances: 1\n  probeInterval: 2s`,
      ...(runnerBinary === "" ? [] : [`  deployRunnerBinary: ${runnerBinary}`]),
      "instanceTypes:\n  bench.large:\n    vcpus: 64\n    ram: 256GiB\n    price: 1",
      "",
    ].join("\n"),
  );
  const child = spawn(BIN, ["serve", "--config", config], { cwd: dir, stdio: ["ignore", "ignore", "pipe"] });
  let err = "";
  return new Promise((resolve, reject) => {
    const keep = process.env["BENCH_SERVE_LOG"];
    child.stderr?.on("data", (d: Buffer) => {
      if (keep !== undefined) appendFileSync(keep, d);
      err += d.toString();
      if (/REST API at/.test(err)) resolve(child);
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

async function waitStarted(uuid: string, final = false): Promise<View> {
  for (;;) {
    const b = await call<View>("GET", `/bundles/${uuid}`);
    if (b.state === "failed" || b.state === "killed")
      throw new Error(`bundle ${uuid} ${b.state}: ${b.stateReason}`);
    if (b.state === "ready" || (!final && b.state === "running")) return b;
    await new Promise((r) => setTimeout(r, final ? 50 : 2));
  }
}

function percentile(sorted: number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]!;
}

function summary(xs: number[]): string {
  const s = [...xs].sort((a, b) => a - b);
  return `p50 ${percentile(s, 50).toFixed(1)} ms, p99 ${percentile(s, 99).toFixed(1)} ms`;
}

async function sshRoundTrips(n: number): Promise<number[]> {
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

async function main(): Promise<void> {
  runnerBinary = await runnerBinaryFor(values.runner as string);
  progress(`bench:dispatch: starting serve in ${dir}; crunch-run is ${runnerBinary || "the one-file build"}`);
  const serve = await startServe();
  try {
    token = readFileSync(`${dir}/data/admin-token`, "utf8").trim();
    progress("bench:dispatch: booting one VM with a warm-up bundle");
    const warm = await call<View>("POST", "/bundles", BUNDLE);
    await waitStarted(warm.uuid, true);
    const total: number[] = [];
    const toStaged: number[] = [];
    const toStarting: number[] = [];
    const toRunning: number[] = [];
    for (let i = 0; i < COUNT; i++) {
      const t0 = Date.now();
      const b = await call<View>("POST", "/bundles", BUNDLE);
      const v = await waitStarted(b.uuid);
      // The next bundle comes to an idle VM again: this one has ended.
      await waitStarted(b.uuid, true);
      const at = (s: string | null) => Date.parse(s ?? "");
      total.push(at(v.timings.runningAt) - t0);
      toStaged.push(at(v.timings.stagedAt) - t0);
      toStarting.push(at(v.timings.startingAt) - at(v.timings.stagedAt));
      toRunning.push(at(v.timings.runningAt) - at(v.timings.startingAt));
      if ((i + 1) % 50 === 0) progress(`bench:dispatch: ${i + 1}/${COUNT} bundles started`);
    }
    const ssh = await sshRoundTrips(COUNT);
    const p50 = percentile(
      [...total].sort((a, b) => a - b),
      50,
    );
    const sshP50 = percentile(
      [...ssh].sort((a, b) => a - b),
      50,
    );
    console.log(
      `bench:dispatch: ${COUNT} bundles submitted one after another to one idle local VM; crunch-run deployed from ${values.runner === "sea" ? "the single executable" : "the one-file .cjs"}`,
    );
    console.log(`  submit -> crunch-run start: ${summary(total)}   (target: p50 <= 150 ms)`);
    console.log(`    submit -> staged:         ${summary(toStaged)}`);
    console.log(`    staged -> starting:       ${summary(toStarting)}   (queue, scheduler, guarded UPDATE)`);
    console.log(
      `    starting -> running:      ${summary(toRunning)}   (SSH --detach, supervisor start, start call)`,
    );
    console.log(`  SSH exec round trip (same VM, same run): ${summary(ssh)}`);
    console.log(`  ratio p50 dispatch / p50 SSH round trip: ${(p50 / sshP50).toFixed(1)}`);
  } finally {
    serve.kill("SIGTERM");
    await new Promise((r) => serve.once("exit", r));
    await destroyLocalVms(`${dir}/vms`, quiet);
    rmSync(dir, { recursive: true, force: true });
  }
}

await main();
