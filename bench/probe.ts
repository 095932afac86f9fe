/**
 * `npm run bench:probe [-- --instances N] [--ssh N]`: how long the REAL worker pool takes to probe a large
 * fleet, and what it costs, on the system clock with the pool's own probe loop.
 *
 * Phase 1 (default 10,000 instances): stub VMs (the stub executor: no network), half of them with two running
 * bundles. Timed: the first round through the probe loop (every instance found by the cloud's list, so each
 * probe is the boot probe, the runner's checksum and deployment, `--version` and `--list`); then a round of
 * `--list` probes of every instance at once (probeNow, the same path as the loop's probes); then the loop's own
 * next round, probeInterval later (the longest gap between two probes of one instance, and the CPU it used).
 *
 * Phase 2 (default 500 instances): the same pool and executor factory as production (the real SSH executor,
 * its connect limits from the config) against stub VMs served by real SSH servers (embedded ssh2), which run
 * in a child process so that their work and memory are not the dispatcher's. Timed: the first round (every
 * connection set up: TCP, key exchange, authentication, identity check, then the boot probe as above), a round
 * of `--list` probes over the open connections at once, the same probes one at a time, the executor alone, and,
 * without the dispatcher, one plain SSH exec round trip of the same `--list` on one raw ssh2 connection and the
 * same command on raw connections to every server at once, with the ratios. Then, not as a target, each of those
 * instances gets a warm pool (poolPhase): probes that ask it, on channels the executor holds open ahead of them.
 *
 * Prints the dispatcher's RSS (and the memory per connected instance). BENCH_CPU_PROF=DIR writes a CPU profile of
 * phase 2's dispatcher process into DIR. Targets (issue 21): 10,000 instances
 * probed in <= 30 s; per-probe cost over SSH within 2x of one plain exec round trip; RSS <= 1.5 GiB at 10,000.
 */
import { type ChildProcess, fork } from "node:child_process";
import { once } from "node:events";
import { mkdtempSync, rmSync } from "node:fs";
import net from "node:net";
import { pino } from "pino";
import { Registry } from "prom-client";
import ssh2 from "ssh2";
import { StubCloud } from "../cloud-drivers/stub/driver.ts";
import { stubListing } from "../cloud-drivers/stub/executor.ts";
import type { Config } from "../config/schema.ts";
import { instanceTypesFromConfig } from "../dispatcher/instance-types.ts";
import { createWorkerPool, type WorkerPool } from "../dispatcher/pool/pool.ts";
import { runnerCommands } from "../dispatcher/pool/runner-commands.ts";
import { artifactOf } from "../dispatcher/runner-artifact.ts";
import { createConnectLimits } from "../dispatcher/sshexec/connect-limits.ts";
import { sshConnector } from "../dispatcher/sshexec/executor.ts";
import { systemClock } from "../lib/clock.ts";
import type { Executor } from "../lib/executor.ts";
import { LIST_REQUEST } from "../lib/runner-protocol.ts";
import { generateKeyPair } from "../lib/ssh-keys.ts";
import { MemoryQueue } from "../test/stub-pool.ts";
import { benchArgs } from "./args.ts";
import { benchBundle, benchConfig, nullDb, openStubFleet, peakRssMiB } from "./stub-fleet.ts";

const { values } = benchArgs("Usage: npm run bench:probe [-- --instances N] [--ssh N]", {
  options: {
    instances: { type: "string", default: "10000" },
    ssh: { type: "string", default: "500" },
    "serve-ssh": { type: "boolean", default: false },
    "ssh-phase": { type: "boolean", default: false },
  },
});

const GiB = 2 ** 30;
const MiB = 2 ** 20;
const logger = pino({ level: "silent" });
// Stub VMs never run what is deployed: any bytes will do (a real runner is tens of MiB: only the boot round
// would copy it, once per instance).
const runner = artifactOf(Buffer.from("#!/bin/sh\nexit 0\n"));
const say = (line: string) => console.log(line);
const ms = (x: number) => `${x.toFixed(x < 10 ? 2 : 0)} ms`;
const sec = (x: number) => `${(x / 1000).toFixed(2)} s`;
const mib = (bytes: number) => `${(bytes / MiB).toFixed(0)} MiB`;

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)] ?? Number.NaN;
}
function p99(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.ceil(0.99 * s.length) - 1)] ?? Number.NaN;
}

/** RSS after a full GC (when run with --expose-gc), so that deltas are live memory. */
function settledRss(): number {
  (globalThis as { gc?: () => void }).gc?.();
  return process.memoryUsage().rss;
}

/** Resolves once `done()` holds, checking every 10 ms. */
async function until(done: () => boolean): Promise<void> {
  while (!done()) await new Promise((r) => setTimeout(r, 10));
}

/**
 * Executors that record how long each `--list` took (on the open connection, as the executor sees it), and each
 * listing asked of a warm pool's socket (`exchanges`).
 */
function timingLists(connect: (i: never, s: string) => Executor, lists: number[], exchanges: number[]) {
  return (instance: never, secret: string): Executor => {
    const inner = connect(instance, secret);
    const wrapped: Executor = {
      async execute(command, opts) {
        const t = performance.now();
        const res = await inner.execute(command, opts);
        if (command.endsWith("--list")) lists.push(performance.now() - t);
        return res;
      },
      close: () => inner.close(),
    };
    const open = inner.connect;
    if (open !== undefined) wrapped.connect = () => open.call(inner);
    const exchange = inner.exchange;
    if (exchange !== undefined)
      wrapped.exchange = async (socketPath, payload, opts) => {
        const t = performance.now();
        const answer = await exchange.call(inner, socketPath, payload, opts);
        exchanges.push(performance.now() - t);
        return answer;
      };
    return wrapped;
  };
}

/** Probes every worker at once (probeNow, the loop's path); the time until the pool has settled again. */
async function probeAll(pool: WorkerPool): Promise<number> {
  const t = performance.now();
  for (const w of pool.workers()) pool.probeNow(w.id);
  await pool.settled();
  return performance.now() - t;
}

/** Probes the first `count` workers one after another; the time of each, to the pool settled again. */
async function oneAtATime(pool: WorkerPool, count: number): Promise<number[]> {
  const times: number[] = [];
  for (const w of pool.workers().slice(0, count)) {
    const t = performance.now();
    pool.probeNow(w.id);
    await pool.settled();
    times.push(performance.now() - t);
  }
  return times;
}

interface Rounds {
  first: number;
  all: number;
  cpuPerProbeAll: number;
}

/**
 * Starts the pool's loops, times the first round (every worker probed once), then a round of every worker at once
 * through probeNow. Returns the times.
 */
async function firstRounds(pool: WorkerPool, n: number, label: string): Promise<Rounds> {
  const t0 = performance.now();
  await pool.start();
  const listed = performance.now() - t0;
  await until(() => {
    let probed = 0;
    for (const w of pool.workers()) if (w.probedAt !== null) probed++;
    return probed >= n;
  });
  const first = performance.now() - t0;
  await pool.settled();
  const states: Record<string, number> = {};
  for (const w of pool.workers()) states[w.state] = (states[w.state] ?? 0) + 1;
  say(
    `  first round (probe loop; the list took ${ms(listed)}, then boot probe, checksum, deploy, --version, ` +
      `--list on each): ${sec(first)} -> ${JSON.stringify(states)}`,
  );
  const before = new Map(pool.workers().map((w) => [w.id, w.probedAt ?? 0]));
  const cpu0 = process.cpuUsage();
  const all = await probeAll(pool);
  const cpu = process.cpuUsage(cpu0);
  const again = pool.workers().filter((w) => (w.probedAt ?? 0) > (before.get(w.id) ?? 0)).length;
  if (again !== n) throw new Error(`${label}: only ${again} of ${n} instances were probed again`);
  const cpuPerProbeAll = (cpu.user + cpu.system) / 1000 / n;
  say(
    `  --list round, every instance at once: ${sec(all)} (${ms(all / n)} per probe; ` +
      `dispatcher CPU ${ms(cpuPerProbeAll)} per probe)`,
  );
  return { first, all, cpuPerProbeAll };
}

// --- phase 1: stub VMs -----------------------------------------------------------------------------------

async function stubPhase(n: number): Promise<void> {
  const rss0 = settledRss();
  const config = benchConfig(n, { timeoutIdle: "1h", timeoutProbe: "1h" });
  const fleet = await openStubFleet(config, { clock: systemClock, logger });
  const queue = new MemoryQueue(systemClock);
  for (let i = 0; i < n; i++) {
    const type = fleet.types[i % fleet.types.length]!;
    const vm = await fleet.createVm(type);
    if (i % 2 === 0) {
      for (let j = 0; j < 2; j++) {
        const b = benchBundle("running", { vcpus: 1, ram: GiB, scratch: GiB, gpu: null }, 500, {
          instanceId: vm.id,
          instanceType: type.name,
          runningAt: new Date(),
        });
        queue.apply(b);
        vm.startRunner(b.uuid, { uuid: b.uuid });
      }
    }
  }
  const rssFleet = settledRss();
  const pool = createWorkerPool({
    config: fleet.config,
    instanceSet: fleet.instanceSet,
    instanceTypes: fleet.types,
    db: nullDb,
    clock: systemClock,
    logger,
    registry: new Registry(),
    queue,
    connect: (instance, secret) => fleet.cloud.executorFor(instance, { expectedSecret: secret }),
    runner,
    runnerApiUrl: "http://bench.invalid",
  });
  say(
    `phase 1: ${n} stub instances (half with 2 running bundles), the real pool and probe loop; ` +
      `maxConcurrentProbes ${config.cloud.maxConcurrentProbes}, maxProbesPerSecond ${config.cloud.maxProbesPerSecond}, ` +
      `probeInterval ${config.cloud.probeInterval / 1000} s`,
  );
  const rounds = await firstRounds(pool, n, "phase 1");

  // The loop's own next round: each instance is due probeInterval (+ up to 10 %) after its last probe.
  const last = new Map(pool.workers().map((w) => [w.id, w.probedAt ?? 0]));
  const cpu0 = process.cpuUsage();
  const t0 = performance.now();
  await until(() => pool.workers().every((w) => (w.probedAt ?? 0) > (last.get(w.id) ?? 0)));
  const loopRound = performance.now() - t0;
  const cpu = process.cpuUsage(cpu0);
  let gap = 0;
  for (const w of pool.workers()) gap = Math.max(gap, (w.probedAt ?? 0) - (last.get(w.id) ?? 0));
  say(
    `  the loop's next round: every instance probed again within ${sec(loopRound)}; longest gap between two ` +
      `probes of one instance ${sec(gap)} (probeInterval + up to 10 % jitter); dispatcher CPU over it ` +
      `${sec((cpu.user + cpu.system) / 1000)} (${ms((cpu.user + cpu.system) / 1000 / n)} per probe)`,
  );
  const rss = settledRss();
  say(
    `  dispatcher RSS ${mib(rss)} (peak ${peakRssMiB().toFixed(0)} MiB; ${mib(rss0)} before the fleet, ${mib(rssFleet)} with the ` +
      `stub cloud's ${n} VMs, so about ${((rss - rssFleet) / n / 1024).toFixed(1)} KiB per worker)`,
  );
  say(
    `  targets: ${n} instances probed in <= 30 s: first round ${sec(rounds.first)}, --list round ${sec(rounds.all)}; ` +
      `RSS <= 1.5 GiB: ${mib(rss)}`,
  );
  await pool.stop();
}

// --- phase 2: real SSH servers ---------------------------------------------------------------------------

/** The child process: stub VMs with the given init commands and keys, each behind its own embedded SSH server. */
async function serveSsh(): Promise<void> {
  const send = (m: unknown) => process.send?.(m);
  const cloud = new StubCloud({ clock: systemClock, seed: 2, callLogLimit: 1000 });
  const set = cloud.instanceSet("bench");
  const type = instanceTypesFromConfig(benchConfig(1))[0]!;
  // The warm pools' sockets (short paths: a socket's path holds at most 107 bytes).
  const poolDir = mkdtempSync("/tmp/bench-pools-");
  const ids: string[] = [];
  /** Connections open to the pools' sockets: the channels the dispatcher holds open ahead, once they are idle. */
  let poolConnections = 0;
  const openPools = async () => {
    for (const [i, id] of ids.entries()) {
      const vm = cloud.vm(id)!;
      const socket = `${poolDir}/${i}.sock`;
      const server = net.createServer((conn) => {
        poolConnections++;
        conn.on("close", () => poolConnections--);
        conn.on("error", () => {});
        let text = "";
        conn.on("data", (d) => {
          text += d.toString();
          if (text.length > LIST_REQUEST.length) conn.destroy();
        });
        // As crunch-run's pool: one exchange per connection, read to its end.
        conn.on("end", () => conn.end(text === LIST_REQUEST ? stubListing(vm) : ""));
      });
      await new Promise<void>((ok) => server.listen(socket, ok));
      vm.spareSocket = socket;
    }
  };
  process.on(
    "message",
    async (m: {
      vms?: Array<{ initCommand: string; publicKey: string }>;
      rss?: true;
      pools?: true;
      held?: true;
    }) => {
      if (m.rss) {
        send({ rss: settledRss() });
        return;
      }
      if (m.pools) {
        await openPools();
        send({ pools: ids.length });
        return;
      }
      if (m.held) {
        send({ held: poolConnections });
        return;
      }
      const addresses: string[] = [];
      for (const v of m.vms ?? []) {
        const inst = await set.create(type, "img", {}, v.initCommand, v.publicKey);
        const server = await cloud.startSshServer(inst.id, { streamLocalUnder: poolDir });
        ids.push(inst.id);
        addresses.push(`${server.host}:${server.port}`);
      }
      send({ addresses });
    },
  );
  process.on("disconnect", () => {
    rmSync(poolDir, { recursive: true, force: true });
    process.exit(0);
  });
  send({ ready: true });
}

async function request<T>(child: ChildProcess, message: unknown, key: string): Promise<T> {
  const answer = new Promise<T>((resolve) => {
    const on = (m: Record<string, unknown>) => {
      if (!(key in m)) return;
      child.off("message", on);
      resolve(m[key] as T);
    };
    child.on("message", on);
  });
  child.send(message as object);
  return answer;
}

/** A raw ssh2 connection (TCP_NODELAY, as the executor sets). */
async function plainClient(address: string, key: string): Promise<ssh2.Client> {
  const i = address.lastIndexOf(":");
  const client = new ssh2.Client();
  await new Promise<void>((ok, fail) => {
    client.once("ready", ok).once("error", fail);
    client.connect({
      host: address.slice(0, i),
      port: Number(address.slice(i + 1)),
      username: "root",
      privateKey: key,
      hostVerifier: () => true,
    });
    client.setNoDelay(true);
  });
  return client;
}

function plainExec(client: ssh2.Client, command: string): Promise<void> {
  return new Promise<void>((ok, fail) =>
    client.exec(command, (err, ch) => {
      if (err) return fail(err);
      ch.on("close", () => ok()).resume();
      ch.stderr.resume();
    }),
  );
}

/** Raw ssh2 connections to every address (set up 32 at a time), then one `command` on each, all at once. */
async function plainRound(addresses: string[], key: string, command: string): Promise<number> {
  const clients: ssh2.Client[] = [];
  for (let i = 0; i < addresses.length; i += 32) {
    clients.push(...(await Promise.all(addresses.slice(i, i + 32).map((a) => plainClient(a, key)))));
  }
  const t = performance.now();
  await Promise.all(clients.map((c) => plainExec(c, command)));
  const took = performance.now() - t;
  for (const c of clients) c.end();
  return took;
}

/** One plain exec round trip of `command` on one raw ssh2 connection (TCP_NODELAY, as the executor does). */
async function plainRoundTrips(address: string, key: string, command: string, n: number): Promise<number[]> {
  const client = await plainClient(address, key);
  const times: number[] = [];
  for (let j = 0; j < n; j++) {
    const t0 = performance.now();
    await plainExec(client, command);
    times.push(performance.now() - t0);
  }
  client.end();
  return times;
}

async function sshPhase(n: number): Promise<void> {
  const key = generateKeyPair("bench");
  const config = benchConfig(n, { timeoutIdle: "1h", timeoutProbe: "1h" });
  const fleet = await openStubFleet(config, { clock: systemClock, logger });
  const vms = [];
  for (let i = 0; i < n; i++) vms.push(await fleet.createVm(fleet.types[0]!, { publicKey: key.publicKey }));
  const child = fork(new URL(import.meta.url).pathname, ["--serve-ssh"], {
    execArgv: ["--import", "tsx", "--expose-gc"],
    stdio: ["ignore", "inherit", "inherit", "ipc"],
  });
  try {
    await once(child, "message");
    const addresses = await request<string[]>(
      child,
      { vms: vms.map((vm) => ({ initCommand: vm.initCommand, publicKey: vm.publicKey })) },
      "addresses",
    );
    vms.forEach((vm, i) => {
      vm.address = addresses[i]!;
    });
    const cloud = fleet.config.cloud;
    const limits = createConnectLimits({
      maxPerSecond: cloud.maxSshConnectsPerSecond,
      maxConcurrent: cloud.maxConcurrentSshConnects,
      clock: systemClock,
    });
    const lists: number[] = [];
    const exchanges: number[] = [];
    const connect = timingLists(
      sshConnector({
        privateKey: key.privateKey,
        sshPort: 22,
        logger,
        clock: systemClock,
        connectLimits: limits,
      }),
      lists,
      exchanges,
    );
    const pool = createWorkerPool({
      config: fleet.config as Config,
      instanceSet: fleet.instanceSet,
      instanceTypes: fleet.types,
      db: nullDb,
      clock: systemClock,
      logger,
      registry: new Registry(),
      queue: new MemoryQueue(systemClock),
      connect,
      runner,
      runnerApiUrl: "http://bench.invalid",
    });
    say(
      `phase 2: ${n} stub instances behind real SSH servers (embedded ssh2, in a child process), the real pool, ` +
        `SSH executor and probe loop; maxSshConnectsPerSecond ${cloud.maxSshConnectsPerSecond}, ` +
        `maxConcurrentSshConnects ${cloud.maxConcurrentSshConnects}, maxConcurrentProbes ${cloud.maxConcurrentProbes}`,
    );
    const rss0 = settledRss();
    const cpu0 = process.cpuUsage();
    const rounds = await firstRounds(pool, n, "phase 2");
    const connectStats = limits.stats();
    const rss1 = settledRss();
    say(
      `    (first round: dispatcher CPU ${ms((process.cpuUsage(cpu0).user + process.cpuUsage(cpu0).system) / 1000 / n)} ` +
        `per instance, handshakes included; at most ${connectStats.peak} handshakes at once, ${connectStats.slow} slow)`,
    );
    const concurrentLists = lists.slice(-n);
    say(
      `    each --list on its open connection during that round: median ${ms(median(concurrentLists))}, ` +
        `p99 ${ms(p99(concurrentLists))} (they overlap)`,
    );
    // The same probes one at a time: each is the whole path (probe scheduler, worker, executor, --list, parse).
    // probeNow probes an instance at most once a second: let that second pass first.
    await new Promise((r) => setTimeout(r, 1100));
    const seqCount = Math.min(n, 200);
    const seq = await oneAtATime(pool, seqCount);
    const listCommand = runnerCommands(fleet.config.cloud.deployRunnerDirectory, runner.sha256).list;
    const plain = await plainRoundTrips(vms[0]!.address, key.privateKey, listCommand, 200);
    const plainP50 = median(plain);
    // The executor alone: the same command, one at a time, on one instance's open connection.
    const one = sshConnector({ privateKey: key.privateKey, sshPort: 22, logger, clock: systemClock })(
      { id: vms[1]!.id, address: vms[1]!.address, remoteUser: "root" },
      vms[1]!.tags[`${fleet.config.cloud.tagKeyPrefix}InstanceSecret`] ?? "",
    );
    await one.connect();
    const viaExecutor: number[] = [];
    for (let i = 0; i < 200; i++) {
      const t = performance.now();
      await one.execute(listCommand);
      viaExecutor.push(performance.now() - t);
    }
    await one.close();
    // The same round without the dispatcher: raw ssh2 connections to every server, one --list on each at once.
    const plainAll = await plainRound(
      vms.map((vm) => vm.address),
      key.privateKey,
      listCommand,
    );
    say(`  one probe at a time (${seqCount}): median ${ms(median(seq))}, p99 ${ms(p99(seq))}`);
    say(`  the SSH executor alone, one --list at a time: median ${ms(median(viaExecutor))}`);
    say(
      `  one plain SSH exec round trip of the same --list (raw ssh2, same run): median ${ms(plainP50)}, ` +
        `p99 ${ms(p99(plain))}`,
    );
    say(
      `  plain ssh2 without the dispatcher, the same --list on ${n} connections at once: ${sec(plainAll)} ` +
        `(${ms(plainAll / n)} per exec)`,
    );
    say(
      `  per-probe cost / plain round trip: ${(rounds.all / n / plainP50).toFixed(2)} at once (round time / ${n}), ` +
        `${(median(seq) / plainP50).toFixed(2)} one at a time (target: within 2x); at once against plain ssh2 at ` +
        `once: ${(rounds.all / plainAll).toFixed(2)}`,
    );
    const childRss = await request<number>(child, { rss: true }, "rss");
    say(
      `  dispatcher RSS ${mib(rss1)} with ${n} connections open (${mib(rss0)} before: about ` +
        `${((rss1 - rss0) / n / 1024).toFixed(0)} KiB per connected instance, so ${((((rss1 - rss0) / n) * 10_000) / GiB).toFixed(2)} GiB ` +
        `more at 10,000); the servers' process ${mib(childRss)}`,
    );
    await poolPhase(pool, n, child, { plainP50, rss1, exchanges });
    await pool.stop();
  } finally {
    child.disconnect();
    child.kill();
  }
}

/**
 * Not a target: the same instances with a warm pool each (a socket in the servers' process that answers a
 * listing as crunch-run's pool does): once a probe's `--list` has named the socket, each probe asks the pool over
 * a channel to it, and the executor keeps one channel to it open ahead of the next (exchangeAhead). Times rounds
 * at once and probes one at a time on that path, and counts the channels held open and what they cost in RSS.
 */
async function poolPhase(
  pool: WorkerPool,
  n: number,
  child: ChildProcess,
  { plainP50, rss1, exchanges }: { plainP50: number; rss1: number; exchanges: number[] },
): Promise<void> {
  const pause = () => new Promise((r) => setTimeout(r, 1100));
  await request<number>(child, { pools: true }, "pools");
  // A round of --list probes names each pool's socket; the next one asks the pools (each opening its channel).
  await pause();
  await probeAll(pool);
  await pause();
  const firstAsk = await probeAll(pool);
  await pause();
  const held = await request<number>(child, { held: true }, "held");
  const asked = exchanges.length;
  const all = await probeAll(pool);
  const viaPool = exchanges.length - asked;
  await pause();
  const seqCount = Math.min(n, 200);
  const seq = await oneAtATime(pool, seqCount);
  const rss2 = settledRss();
  const heldAfter = await request<number>(child, { held: true }, "held");
  say(`  with a warm pool on each instance (not a target; probes ask the pool, no process on the VM):`);
  say(
    `    first round asking the pools: ${sec(firstAsk)}; the next, with ${held} channels held open ahead of it: ` +
      `${sec(all)} (${ms(all / n)} per probe, ${viaPool} of ${n} through the pools; ` +
      `${(all / n / plainP50).toFixed(2)} x the plain round trip)`,
  );
  say(
    `    one probe at a time (${seqCount}): median ${ms(median(seq))}, p99 ${ms(p99(seq))} ` +
      `(${(median(seq) / plainP50).toFixed(2)} x the plain round trip)`,
  );
  say(
    `    channels held open ahead after those: ${heldAfter}; dispatcher RSS ${mib(rss2)} ` +
      `(${((rss2 - rss1) / n / 1024).toFixed(1)} KiB per instance more than after the --list rounds)`,
  );
}

async function main(): Promise<void> {
  if (values["serve-ssh"]) return serveSsh();
  const n = Number(values.instances);
  const s = Number(values.ssh);
  if (!(Number.isInteger(n) && n >= 0 && Number.isInteger(s) && s >= 0)) {
    throw new Error("--instances and --ssh take whole numbers");
  }
  if (values["ssh-phase"]) {
    await sshPhase(s);
    say(`  peak RSS of the dispatcher's process in phase 2: ${peakRssMiB().toFixed(0)} MiB`);
    process.exit(0);
  }
  if (n > 0) await stubPhase(n);
  if (s > 0) {
    // A process of its own, so that its memory figures are not phase 1's.
    const prof = process.env["BENCH_CPU_PROF"];
    const phase2 = fork(new URL(import.meta.url).pathname, ["--ssh-phase", "--ssh", String(s)], {
      execArgv: ["--import", "tsx", "--expose-gc", ...(prof ? ["--cpu-prof", `--cpu-prof-dir=${prof}`] : [])],
      stdio: "inherit",
    });
    const [code] = (await once(phase2, "exit")) as [number | null];
    if (code !== 0) throw new Error(`phase 2 exited ${code}`);
  }
  process.exit(0);
}

await main();
