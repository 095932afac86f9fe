/**
 * A whole dispatcher on the stub cloud, driven by FakeClock: the config, the StubCloud (shared across
 * dispatchers, as a real cloud outlives them), a REST server and fake runners on the same database, bundle
 * fixtures, a drive loop that fails on 5 s of FakeClock without progress, and the checks the acceptance tests
 * make from the event log.
 */
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Registry } from "prom-client";
import { StubCloud, type StubCloudOptions } from "../cloud-drivers/stub/driver.ts";
import type { Config } from "../config/schema.ts";
import { createDispatcher, type Dispatcher, type DispatcherOptions } from "../dispatcher/main.ts";
import type { PoolEvent } from "../dispatcher/pool/pool.ts";
import { artifactOf } from "../dispatcher/runner-artifact.ts";
import type { Logger } from "../lib/logger.ts";
import { createRestServer } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";
import { type EventRow, eventFromRow } from "../store/queries.ts";
import { stageBundle } from "../store/transitions.ts";
import type { BundleEvent, BundleState, NewBundle } from "../store/types.ts";
import { createTestBundle, createTestUser } from "./db.ts";
import { FakeClock, flushMicrotasks } from "./fake-clock.ts";
import { attachFakeRunners, type FakeRunnerOptions, type FakeRunners } from "./fake-runner.ts";
import { configFrom } from "./fixtures.ts";

const STUB_RUNNER = artifactOf(Buffer.from("#!/bin/sh\n# never run: stub instances only pretend\n"));
export const GiB = 2 ** 30;

/** The stub cloud's config: small timeouts so a run takes minutes of FakeClock. `extra` is YAML appended. */
export function stubConfig(extra = ""): Config {
  const yaml = `clusterId: zzzzz
dataDir: /nonexistent/dispatch-cloud-test
logging: {level: silent}
dispatcher:
  pollInterval: 2s
  staleLockTimeout: 20s
  schedulingStatusInterval: 1s
  reserveExtraRam: 0
cloud:
  driver: stub
  probeInterval: 1s
  maxProbesPerSecond: 0
  maxCloudOpsPerSecond: 0
  maxConcurrentInstanceCreateOps: 4
  maxInstances: 0
  syncInterval: 3s
  timeoutIdle: 10s
  timeoutBooting: 15s
  timeoutProbe: 15s
  timeoutShutdown: 3s
  timeoutSignal: 1s
  timeoutTerm: 5s
  timeoutStaleRunLock: 3s
  deployPublicKey: false
instanceTypes:
  small: {vcpus: 2, ram: 4GiB, includedScratch: 50GiB, price: 0.1}
  medium: {vcpus: 4, ram: 8GiB, includedScratch: 100GiB, price: 0.2}
  big: {vcpus: 16, ram: 64GiB, includedScratch: 400GiB, price: 0.8}
  gpu: {vcpus: 8, ram: 32GiB, includedScratch: 200GiB, price: 1.2, gpu: {stack: cuda, driverVersion: "12.4", hardwareTarget: "8.0", deviceCount: 2, vram: 16GiB}}
${extra}`;
  return configFrom(yaml);
}

/** The config with `cloud.driverParameters: { cloud }` (the stub driver takes the object). */
export function withCloud(config: Config, cloud: StubCloud): Config {
  return { ...config, cloud: { ...config.cloud, driverParameters: { cloud } } } as Config;
}

export interface Harness {
  clock: FakeClock;
  cloud: StubCloud;
  db: Db;
  config: Config;
  runners: FakeRunners;
  owner: string;
  /** Pool events of every dispatcher started by this harness, and bundle events seen, as progress. */
  lastProgress: number;
  poolEvents: PoolEvent[];
  startDispatcher(over?: Partial<DispatcherOptions>): Promise<Dispatcher>;
  /** The active dispatcher, if any. */
  active(): Dispatcher | undefined;
  /** Creates and stages bundles. */
  submit(n: number, over?: (i: number) => Partial<NewBundle>): Promise<string[]>;
  /** Advances FakeClock in steps until `done()`; throws on `stallMs` of FakeClock without progress. */
  drive(
    done: () => Promise<boolean>,
    opts?: { step?: number; stallMs?: number; maxMs?: number },
  ): Promise<void>;
  events(): Promise<BundleEvent[]>;
  states(uuids: readonly string[]): Promise<Map<string, BundleState>>;
  close(): Promise<void>;
}

export async function createHarness(opts: {
  db: Db;
  logger: Logger;
  config?: Config;
  cloud?: Omit<StubCloudOptions, "clock">;
  runners?: Omit<FakeRunnerOptions, "cloud" | "api" | "clock">;
}): Promise<Harness> {
  const clock = new FakeClock();
  const cloud = new StubCloud({ clock, bootDelay: 2000, ...opts.cloud });
  const config = withCloud(opts.config ?? stubConfig(), cloud);
  const { db } = opts;
  const api = await createRestServer({
    db,
    logger: false,
    clusterId: config.clusterId,
    maxRequestBodySize: 2 ** 20,
    defaultMaxAttempts: 3,
    clock,
    // The fake runners upload no outputs: nothing is ever written there.
    dataDir: join(tmpdir(), "dispatch-cloud-fake-runners"),
  });
  const runners = attachFakeRunners({ cloud, api, clock, ...opts.runners });
  const owner = (await createTestUser(db)).uuid;
  const dispatchers: Dispatcher[] = [];
  let lastEventId = 0;

  const h: Harness = {
    clock,
    cloud,
    db,
    config,
    runners,
    owner,
    lastProgress: clock.now(),
    poolEvents: [],
    async startDispatcher(over = {}) {
      const d = await createDispatcher({
        config,
        db,
        clock,
        logger: opts.logger,
        registry: new Registry(),
        connect: (instance) => cloud.executorFor(instance),
        runnerApiUrl: "http://dispatch-cloud.invalid",
        // The stub cloud never runs what is deployed: a few bytes spare every test building the real artifact.
        runner: STUB_RUNNER,
        ...over,
      });
      dispatchers.push(d);
      let unsubscribe: (() => void) | null = null;
      const watch = () => {
        unsubscribe?.();
        unsubscribe =
          d.parts?.pool.subscribe((e) => {
            h.poolEvents.push(e);
            h.lastProgress = clock.now();
          }) ?? null;
      };
      await d.start();
      watch();
      void d.whenActive().then(watch);
      return d;
    },
    active: () => dispatchers.find((d) => d.active),
    async submit(n, over = () => ({})) {
      const uuids: string[] = [];
      for (let i = 0; i < n; i++) {
        const b = await createTestBundle(db, owner, over(i));
        const r = await stageBundle(db, b.uuid, { actor: "test" });
        if (!r.ok) throw new Error(`cannot stage ${b.uuid}: ${r.reason}`);
        uuids.push(b.uuid);
      }
      return uuids;
    },
    async drive(done, o = {}) {
      const step = o.step ?? 250;
      const stallMs = o.stallMs ?? 5000;
      const end = clock.now() + (o.maxMs ?? 3_600_000);
      h.lastProgress = clock.now();
      for (;;) {
        if (await done()) return;
        const { rows } = await db.query<{ id: number }>(
          "SELECT coalesce(max(id), 0)::bigint AS id FROM bundle_events",
        );
        const id = Number(rows[0]?.id ?? 0);
        if (id !== lastEventId) {
          lastEventId = id;
          h.lastProgress = clock.now();
        }
        if (clock.now() - h.lastProgress > stallMs) {
          throw new Error(
            `no progress for ${stallMs} ms of FakeClock (at +${clock.now() - Date.UTC(2026, 0, 1)} ms): ${await summary(h)}`,
          );
        }
        if (clock.now() >= end) throw new Error(`not done after ${o.maxMs} ms: ${await summary(h)}`);
        await clock.advance(step);
        // Let database round trips started by the step finish (real I/O, not microtasks).
        await settle();
      }
    },
    async events() {
      const { rows } = await db.query<EventRow>("SELECT * FROM bundle_events ORDER BY id");
      return rows.map(eventFromRow);
    },
    async states(uuids) {
      const { rows } = await db.query<{ uuid: string; state: BundleState }>(
        "SELECT uuid, state FROM bundles WHERE uuid = ANY($1::text[])",
        [uuids],
      );
      return new Map(rows.map((r) => [r.uuid, r.state]));
    },
    async close() {
      for (const d of dispatchers) await d.stop().catch(() => {});
      runners.detach();
      await api.close();
    },
  };
  return h;
}

/** Waits for pending I/O (database round trips) started by timers or events. */
export async function settle(): Promise<void> {
  for (let i = 0; i < 3; i++) {
    await new Promise((r) => setTimeout(r, 1));
    await flushMicrotasks(5);
  }
}

async function summary(h: Harness): Promise<string> {
  const { rows } = await h.db.query<{ state: string; n: number }>(
    "SELECT state, count(*)::int AS n FROM bundles GROUP BY state ORDER BY state",
  );
  const vms = h.cloud
    .liveVms()
    .map(
      (vm) =>
        `${vm.id}(${vm.instanceType}${vm.broken ? ",broken" : ""}${vm.neverBoot ? ",noboot" : ""}:${vm.liveRunners().length})`,
    );
  const stuck = await h.db.query<{
    uuid: string;
    state: string;
    instance_id: string | null;
    attempt: number;
  }>("SELECT uuid, state, instance_id, attempt FROM bundles WHERE state IN ('starting', 'running') LIMIT 10");
  const pool = h.active()?.parts?.pool;
  const detail = stuck.rows.map((b) => {
    const w = b.instance_id === null ? undefined : pool?.worker(b.instance_id);
    const r = w?.runners.get(b.uuid);
    return `${b.uuid} ${b.state}#${b.attempt} on ${b.instance_id} (worker ${w === undefined ? "unknown" : `${w.state}/${w.idleBehavior} probed ${w.probedAt === null ? "never" : w.probedAt - h.clock.now()}`}, runner ${r === undefined ? "none" : `${r.state} since ${r.since - h.clock.now()}`})`;
  });
  // Why staged bundles wait, as the scheduler says it.
  const waiting = await h.db.query<{ uuid: string; resources: unknown; scheduling_status: string | null }>(
    "SELECT uuid, resources, scheduling_status FROM bundles WHERE state = 'staged' LIMIT 5",
  );
  const why = waiting.rows.map(
    (b) =>
      `${b.uuid} ${JSON.stringify(b.resources)}: ${h.active()?.parts?.scheduler.statusOf(b.uuid) ?? b.scheduling_status}`,
  );
  return `bundles ${rows.map((r) => `${r.state}=${r.n}`).join(" ")}; live VMs ${vms.join(" ")}; runners active ${h.runners.active}; active bundles: ${detail.join("; ")}; staged: ${why.join("; ")}`;
}

/** Per bundle, the running intervals of its attempts, from the event log: [enter running, leave running). */
export function runningIntervals(
  events: readonly BundleEvent[],
): Map<string, Array<{ attempt: number; from: number; to: number }>> {
  const out = new Map<string, Array<{ attempt: number; from: number; to: number }>>();
  const open = new Map<string, { attempt: number; from: number }>();
  for (const e of events) {
    if (e.toState === "running") open.set(e.bundleUuid, { attempt: e.attempt, from: e.id });
    else if (e.fromState === "running") {
      const o = open.get(e.bundleUuid);
      if (o === undefined)
        throw new Error(`bundle ${e.bundleUuid} left running without entering it (event ${e.id})`);
      open.delete(e.bundleUuid);
      const list = out.get(e.bundleUuid) ?? [];
      list.push({ ...o, to: e.id });
      out.set(e.bundleUuid, list);
    }
  }
  for (const [uuid, o] of open) {
    const list = out.get(uuid) ?? [];
    list.push({ ...o, to: Number.POSITIVE_INFINITY });
    out.set(uuid, list);
  }
  return out;
}

/** Records each stub runner's life per bundle ([detach, exit) in FakeClock ms, and its VM). */
export function recordRunnerLives(
  cloud: StubCloud,
): Map<string, Array<{ vm: string; from: number; to: number }>> {
  const lives = new Map<string, Array<{ vm: string; from: number; to: number }>>();
  cloud.on("runner:detach", (vm, r) => {
    const list = lives.get(r.uuid) ?? [];
    list.push({ vm: vm.id, from: r.startedAt, to: Number.POSITIVE_INFINITY });
    lives.set(r.uuid, list);
  });
  cloud.on("runner:exit", (vm, r) => {
    const life = lives.get(r.uuid)?.find((l) => l.vm === vm.id && l.to === Number.POSITIVE_INFINITY);
    if (life !== undefined) life.to = r.finishedAt ?? cloud.clock.now();
  });
  return lives;
}

/** Pairs of overlapping lives on different VMs, as messages (empty when none). */
export function overlaps(lives: Map<string, Array<{ vm: string; from: number; to: number }>>): string[] {
  const out: string[] = [];
  for (const [uuid, list] of lives) {
    for (let i = 0; i < list.length; i++) {
      for (let j = i + 1; j < list.length; j++) {
        const a = list[i]!;
        const b = list[j]!;
        if (a.vm !== b.vm && a.from < b.to && b.from < a.to) {
          out.push(`${uuid}: on ${a.vm} [${a.from}, ${a.to}) and ${b.vm} [${b.from}, ${b.to})`);
        }
      }
    }
  }
  return out;
}

/**
 * Losses (running -> staged or failed by the dispatcher) without a reason on the runner's side: the fake
 * runner of that attempt neither died nor was stopped (killed, or its VM destroyed). Empty when every loss
 * was real, i.e. nothing running was touched.
 */
export function unexplainedLosses(events: readonly BundleEvent[], runners: FakeRunners): string[] {
  const ended = new Set(
    runners.log
      .filter((e) => e.event === "died" || e.event === "stopped")
      .map((e) => `${e.uuid}/${e.attempt}`),
  );
  return events
    .filter(
      (e) =>
        e.fromState === "running" && e.actor === "dispatcher" && !ended.has(`${e.bundleUuid}/${e.attempt}`),
    )
    .map((e) => `${e.bundleUuid} attempt ${e.attempt}: ${e.toState} (${e.reason ?? ""})`);
}

export { useTestDb } from "./db.ts";
