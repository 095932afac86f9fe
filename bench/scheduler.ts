/**
 * `npm run bench:scheduler`: the time of one scheduler pass with 100,000 staged bundles and 10,000 instances.
 *
 * Set-up (not timed): a StubCloud with 10,000 VMs of mixed types (GPU types included), tagged as the pool's
 * own; stub runners on most of them for 20,000-odd running bundles; the REAL worker pool lists and probes them
 * all (runner deployment, `--list`), so it sees running, idle and booting instances; an in-memory queue view
 * holds the running bundles and 100,000 staged ones of mixed shapes (GPUs included) and priorities.
 *
 * Timed: N `runOnce()` passes of the real scheduler, twice. Neither the scheduler nor the pool reaches a
 * database, so status writes cost nothing. First every start is refused in the background (the pool drops the
 * runner), which keeps every pass at the same, largest, workload: 100,000 bundles to order, place or explain
 * ("at quota: 10000 of 10000"). Then starts are accepted as PostgreSQL would (the pool's Db returns the
 * `starting` row), the started bundles leave the queue, and the passes show the steady state at quota.
 *
 * Prints the median, p90 and maximum pass time, wall clock and the process's CPU time (user + system, which a
 * busy shared machine inflates less than wall time); how long the pool then takes to handle the answers to the
 * pass's starts (not part of the pass); and the process's peak RSS. Targets (issue 21): p90 and max
 * <= 100 ms in both phases, RSS <= 1 GiB. BENCH_BUNDLES, BENCH_INSTANCES and BENCH_PASSES shrink it;
 * BENCH_INPUTS=<share> gives that share of the staged bundles inputs and every instance a cache line (locality);
 * BENCH_CPU_PROFILE=<prefix> writes each phase's CPU profile. `npm run bench:scheduler` runs it with the young
 * generation bin/dispatch-cloud gives the dispatcher's process (`--max-semi-space-size=64`, docs/operations.md),
 * since the scheduler runs here, in the bench's own process. It also prints each pass's time in order.
 */

import { writeFileSync } from "node:fs";
import { Session } from "node:inspector/promises";
import { pino } from "pino";
import { Registry } from "prom-client";
import { mulberry32 } from "../cloud-drivers/stub/driver.ts";
import type { InstanceType } from "../cloud-drivers/types.ts";
import { createWorkerPool } from "../dispatcher/pool/pool.ts";
import { createBundleTransitions } from "../dispatcher/queue/transitions.ts";
import { artifactOf } from "../dispatcher/runner-artifact.ts";
import { demandOf, eligibleTypes } from "../dispatcher/scheduler/eligible.ts";
import { createScheduler } from "../dispatcher/scheduler/scheduler.ts";
import type { QueueView } from "../dispatcher/types.ts";
import type { Db } from "../store/db.ts";
import type { BundleRow } from "../store/queries.ts";
import type { Bundle, BundleResources } from "../store/types.ts";
import { FakeClock } from "../test/fake-clock.ts";
import { MemoryQueue } from "../test/stub-pool.ts";
import { benchBundle, benchConfig, benchEpoch, nullDb, openStubFleet } from "./stub-fleet.ts";

const BUNDLES = Number(process.env["BENCH_BUNDLES"] ?? 100_000);
const INSTANCES = Number(process.env["BENCH_INSTANCES"] ?? 10_000);
const PASSES = Number(process.env["BENCH_PASSES"] ?? 20);
/**
 * Locality: the share of staged bundles with inputs (1 to 3 trees of a set of 2,000 manifests), when every
 * instance's cache (its `--list` cache line) holds 256 of them. Default 0: no inputs, no cache lines.
 */
const INPUTS = Number(process.env["BENCH_INPUTS"] ?? 0);
const MANIFESTS = Array.from(
  { length: 2000 },
  (_, i) => `${i.toString(16).padStart(16, "0")}${"c".repeat(48)}/${1000 + i}`,
);
/** When set, each timed phase's CPU profile is written to <prefix>-<phase>.cpuprofile (open in DevTools). */
const PROFILE = process.env["BENCH_CPU_PROFILE"];
const GiB = 2 ** 30;

const config = benchConfig(INSTANCES, { maxProbesPerSecond: 0 });

/**
 * The pool's Db. With `accept` off it refuses every start (no row); with it on, the start transition
 * (staged -> starting) answers the row PostgreSQL would return, so started bundles leave the queue as they do
 * for real. Nothing else is answered. Answers arrive on a later turn of the event loop (setImmediate), as a
 * database's answer arrives by I/O: the pool handles them between passes, as it would for real, not in the
 * microtasks of the pass that asked (the pool's handling is measured apart: "the pool between passes").
 */
function poolDb(queue: QueueView): Db & { accept: boolean } {
  const db = {
    ...nullDb,
    accept: false,
    async query(sql: string, params?: readonly unknown[]) {
      await new Promise((resolve) => setImmediate(resolve));
      const b = db.accept && sql.includes("'starting'") ? queue.get(String(params?.[0])) : undefined;
      if (b === undefined || b.state !== "staged") return { rows: [], rowCount: 0 };
      const row: BundleRow = {
        ...rowOf(b),
        state: "starting",
        attempt: b.attempt + 1,
        instance_id: String(params?.[6]),
        instance_type: String(params?.[7]),
        runner_token_hash: String(params?.[8]),
        gpu_devices: params?.[9] as number[],
        change_seq: b.changeSeq + 1,
      };
      return { rows: [row], rowCount: 1 };
    },
  };
  return db as Db & { accept: boolean };
}

function rowOf(b: Bundle): BundleRow {
  return {
    uuid: b.uuid,
    owner_uuid: b.ownerUuid,
    name: b.name,
    command: b.command,
    image: b.image,
    env: b.env,
    resources: b.resources,
    preemptible: b.preemptible,
    priority: b.priority,
    limits: b.limits,
    dependencies: b.dependencies,
    allow_failed_dependencies: b.allowFailedDependencies,
    max_attempts: b.maxAttempts,
    attempt: b.attempt,
    state: b.state,
    state_reason: b.stateReason,
    scheduling_status: b.schedulingStatus,
    instance_id: b.instanceId,
    instance_type: b.instanceType,
    gpu_devices: b.gpuDevices,
    exit_code: b.exitCode,
    resource_usage: b.resourceUsage,
    cost_dollars: b.costDollars,
    runner_token_hash: null,
    change_seq: b.changeSeq,
    created_at: b.createdAt,
    updated_at: b.updatedAt,
    staged_at: b.stagedAt,
    starting_at: b.startingAt,
    running_at: b.runningAt,
    finished_at: b.finishedAt,
  };
}

/** A small seeded PRNG, so every run builds the same world. */
const rng = mulberry32;

const SHAPES: Array<{ weight: number; resources: BundleResources }> = [
  { weight: 40, resources: { vcpus: 1, ram: 2 * GiB, scratch: 10 * GiB, gpu: null } },
  { weight: 20, resources: { vcpus: 2, ram: 3 * GiB, scratch: 20 * GiB, gpu: null } },
  { weight: 10, resources: { vcpus: 4, ram: 12 * GiB, scratch: 50 * GiB, gpu: null } },
  { weight: 8, resources: { vcpus: 8, ram: 48 * GiB, scratch: 100 * GiB, gpu: null } },
  { weight: 5, resources: { vcpus: 16, ram: 100 * GiB, scratch: 200 * GiB, gpu: null } },
  { weight: 2, resources: { vcpus: 0.5, ram: GiB / 2, scratch: GiB, gpu: null } },
  {
    weight: 8,
    resources: {
      vcpus: 4,
      ram: 16 * GiB,
      scratch: 50 * GiB,
      gpu: { stack: "cuda", deviceCount: 1, vram: 16 * GiB, driverVersion: "12.0", hardwareTarget: ["8.0"] },
    },
  },
  {
    weight: 4,
    resources: {
      vcpus: 16,
      ram: 64 * GiB,
      scratch: 100 * GiB,
      gpu: { stack: "cuda", deviceCount: 2, vram: 0, driverVersion: null, hardwareTarget: [] },
    },
  },
  {
    weight: 3,
    resources: {
      vcpus: 8,
      ram: 32 * GiB,
      scratch: 100 * GiB,
      gpu: {
        stack: "rocm",
        deviceCount: 1,
        vram: 32 * GiB,
        driverVersion: "6.0",
        hardwareTarget: ["gfx90a"],
      },
    },
  },
];
const TOTAL_WEIGHT = SHAPES.reduce((n, s) => n + s.weight, 0);

function pickShape(r: () => number): BundleResources {
  let x = r() * TOTAL_WEIGHT;
  for (const s of SHAPES) {
    x -= s.weight;
    if (x < 0) return s.resources;
  }
  return SHAPES[0]!.resources;
}

const epoch = benchEpoch;
const bundle = benchBundle;

function percentile(sorted: number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))] ?? Number.NaN;
}

async function main(): Promise<void> {
  const t0 = performance.now();
  const logger = pino({ level: "silent" });
  const clock = new FakeClock(epoch);
  const r = rng(2026);
  const fleet = await openStubFleet(config, { clock, logger });
  const { cloud, instanceSet, types, config: cfg } = fleet;
  // Stub instances never run what is deployed: any bytes will do.
  const runner = artifactOf(Buffer.from("#!/bin/sh\nexit 0\n"));
  const queue = new MemoryQueue(clock);

  // 10,000 instances: 80 % busy, 15 % idle, 5 % still booting; types weighted towards the cheap ones.
  const typeWeights: Array<[InstanceType, number]> = types.map((t) => [
    t,
    t.gpu === null ? 10 / t.vcpus + 1 : 0.7,
  ]);
  const typeTotal = typeWeights.reduce((n, [, w]) => n + w, 0);
  const pickType = (): InstanceType => {
    let x = r() * typeTotal;
    for (const [t, w] of typeWeights) {
      x -= w;
      if (x < 0) return t;
    }
    return types[0]!;
  };
  let running = 0;
  for (let i = 0; i < INSTANCES; i++) {
    const type = pickType();
    const vm = await fleet.createVm(type);
    if (INPUTS > 0)
      vm.cachedManifests = Array.from({ length: 256 }, () => MANIFESTS[Math.floor(r() * MANIFESTS.length)]!);
    const roll = r();
    if (roll < 0.05) {
      vm.bootAt = Number.POSITIVE_INFINITY;
      continue;
    }
    if (roll < 0.2) continue;
    // Busy: fill it with running bundles that fit, up to its vCPUs.
    let free = type.vcpus;
    let gpus = type.gpu?.deviceCount ?? 0;
    const devices: number[] = [];
    for (let tries = 0; tries < 6 && free > 0; tries++) {
      const res = pickShape(r);
      const d = demandOf({ resources: res, preemptible: false } as Bundle, config.dispatcher);
      const ok = eligibleTypes(d, [type], { maximumPriceFactor: 1e9 });
      if (!ok.ok || res.vcpus > free || (res.gpu?.deviceCount ?? 0) > gpus) continue;
      const gpuDevices: number[] = [];
      for (let g = 0; g < (res.gpu?.deviceCount ?? 0); g++) gpuDevices.push(devices.length + g);
      devices.push(...gpuDevices);
      free -= res.vcpus;
      gpus -= gpuDevices.length;
      const b = bundle("running", res, 500, {
        instanceId: vm.id,
        instanceType: type.name,
        gpuDevices,
        runningAt: new Date(epoch),
      });
      queue.apply(b);
      vm.startRunner(b.uuid, { uuid: b.uuid });
      running++;
    }
  }
  for (let i = 0; i < BUNDLES; i++) {
    const inputs =
      INPUTS > 0 && r() < INPUTS
        ? Array.from({ length: 1 + Math.floor(r() * 3) }, () => ({
            digest: MANIFESTS[Math.floor(r() * MANIFESTS.length)]!,
            bytes: Math.floor(r() * 10 * GiB),
          }))
        : null;
    queue.apply(
      bundle(
        "staged",
        pickShape(r),
        Math.floor(r() * 10) * 100,
        inputs === null ? {} : { inputManifests: inputs },
      ),
    );
  }

  const db = poolDb(queue);
  const pool = createWorkerPool({
    config: cfg,
    instanceSet,
    instanceTypes: types,
    db,
    clock,
    logger,
    registry: new Registry(),
    queue,
    connect: (instance) => cloud.executorFor(instance),
    runner,
    runnerApiUrl: "http://bench.invalid",
  });
  await pool.syncOnce();
  await pool.probeOnce();
  await pool.settled();
  const states: Record<string, number> = {};
  let runners = 0;
  for (const w of pool.workers()) {
    states[w.state] = (states[w.state] ?? 0) + 1;
    runners += w.runners.size;
  }
  const scheduler = createScheduler({
    queue,
    pool,
    transitions: createBundleTransitions({ db: nullDb, queue, logger }),
    instanceTypes: types,
    config: cfg,
    db: nullDb,
    clock,
    logger,
  });
  const setupMs = performance.now() - t0;

  console.log(
    `set-up: ${BUNDLES} staged + ${running} running bundles; ${INSTANCES} instances (${types.length} types, ` +
      `${types.filter((t) => t.gpu !== null).length} with GPUs) as the pool sees them: ${JSON.stringify(states)}, ` +
      `${runners} runners listed; ${(setupMs / 1000).toFixed(1)} s`,
  );

  const first = performance.now();
  const result = await scheduler.runOnce();
  const firstMs = performance.now() - first;
  console.log(
    `first pass: ${firstMs.toFixed(1)} ms (started ${result.started.length}, planned ${result.planned}, ` +
      `created ${result.created.length}, shut down ${result.shutdown.length}, failed ${result.failed.length}, ` +
      `waiting ${result.waiting}); one status: "${scheduler.statusOf([...queue.all()].find((b) => b.state === "staged")?.uuid ?? "") ?? ""}"`,
  );

  const timePasses = async (label: string, name: string) => {
    const session = PROFILE === undefined ? null : new Session();
    if (session !== null) {
      session.connect();
      await session.post("Profiler.enable");
      await session.post("Profiler.start");
    }
    const times: number[] = [];
    const cpu: number[] = [];
    const between: number[] = [];
    for (let i = 0; i < PASSES; i++) {
      // Let the pool's background work (starts, refused or not) settle between passes, as the loop would.
      await pool.settled();
      await clock.advance(500);
      const c = process.cpuUsage();
      const t = performance.now();
      await scheduler.runOnce();
      times.push(performance.now() - t);
      const used = process.cpuUsage(c);
      cpu.push((used.user + used.system) / 1000);
      const s = performance.now();
      await pool.settled();
      between.push(performance.now() - s);
    }
    if (session !== null) {
      const { profile } = await session.post("Profiler.stop");
      writeFileSync(`${PROFILE}-${name}.cpuprofile`, JSON.stringify(profile));
      session.disconnect();
    }
    const inOrder = times.map((t) => t.toFixed(0)).join(", ");
    const figures = (xs: number[]) => {
      xs.sort((a, b) => a - b);
      return (
        `median ${percentile(xs, 0.5).toFixed(1)} ms, p90 ${percentile(xs, 0.9).toFixed(1)} ms, ` +
        `max ${(xs[xs.length - 1] ?? Number.NaN).toFixed(1)} ms`
      );
    };
    console.log(
      `${label}: runOnce over ${PASSES} passes: ${figures(times)} (target: p90 and max <= 100 ms)\n` +
        `  CPU time per pass: ${figures(cpu)}\n  the pool between passes (handling the answers to the pass's ` +
        `starts): ${figures(between)}\n  each pass, in order (ms): ${inOrder}`,
    );
  };
  // Worst case: every start is refused, so each pass places, and explains, the whole queue again.
  await timePasses("every start refused", "refused");
  // Steady state: starts succeed, the started bundles leave the queue, the rest wait at quota.
  db.accept = true;
  await pool.settled();
  const absorbed = await scheduler.runOnce();
  await pool.settled();
  console.log(`starts accepted: the next pass started ${absorbed.started.length}`);
  await timePasses("starts accepted (steady state at quota)", "accepted");
  const rssBytes = process.resourceUsage().maxRSS * 1024;
  console.log(`peak RSS: ${(rssBytes / 2 ** 20).toFixed(0)} MiB (target: <= 1024 MiB)`);
  process.exit(0);
}

await main();
