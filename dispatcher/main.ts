/**
 * The dispatcher's composition root (dispatcher/README.md, "Restart and standby"): takes the PostgreSQL
 * advisory lock `dispatch-cloud:<instanceSetId>` before doing anything (a standby retries every few seconds),
 * then builds the queue, the pool, the scheduler and sync and runs their loops:
 * - the scheduler: a pass on every queue change or pool event, and at least every dispatcher.pollInterval;
 * - the pool's own probe and list loops (started by pool.start(), whose first cloud list is the start-up
 *   recovery: every tagged instance comes back as `unknown` with its idle behaviour from its tags);
 * - sync: every cloud.probeInterval, and on pool events.
 * Nothing running is touched at start-up: probes rediscover runners, and sync requeues `starting` bundles that
 * run nowhere once staleLockTimeout has passed.
 */
import { Registry } from "prom-client";
import {
  createDefaultRegistry,
  type DriverRegistry,
  instanceSetId,
  openInstanceSet,
} from "../cloud-drivers/registry.ts";
import type { Instance, InstanceSet } from "../cloud-drivers/types.ts";
import type { Config } from "../config/schema.ts";
import type { ClaimsInFlight } from "../lib/claims-in-flight.ts";
import type { Clock } from "../lib/clock.ts";
import type { Executor } from "../lib/executor.ts";
import type { Logger } from "../lib/logger.ts";
import type { AdvisoryLock, Db } from "../store/db.ts";
import type { Bundle } from "../store/types.ts";
import { instanceTypesFromConfig } from "./instance-types.ts";
import { createDispatcherMetrics } from "./metrics.ts";
import { loadDispatcherKey } from "./pool/bootstrap.ts";
import { createWorkerPool, type PoolEvent, type WorkerPool } from "./pool/pool.ts";
import { type BundleQueue, createBundleQueue } from "./queue/queue.ts";
import { createBundleTransitions } from "./queue/transitions.ts";
import type { RunnerArtifact } from "./runner-artifact.ts";

export type { RunnerArtifact } from "./runner-artifact.ts";

import { createScheduler, type Scheduler } from "./scheduler/scheduler.ts";
import { createConnectLimits } from "./sshexec/connect-limits.ts";
import { sshConnector } from "./sshexec/executor.ts";
import { createSync, type Sync } from "./sync.ts";
import { createUserWorkers, type UserWorkers } from "./workers/user-workers.ts";

/** How often a standby tries to take the lock. */
export const LOCK_RETRY_INTERVAL_MS = 3000;

export interface DispatcherOptions {
  config: Config;
  db: Db;
  clock: Clock;
  logger: Logger;
  /** prom-client registry for the pool's and the driver's metrics; default a fresh one. */
  registry?: Registry;
  /** Cloud drivers by name (default: the built-in ones); unused when instanceSet is given. */
  drivers?: DriverRegistry;
  /** An instance set to use instead of opening the configured one (tests; the caller stops it). */
  instanceSet?: InstanceSet;
  /**
   * Opens an executor to an instance; default the real SSH executor with the dispatcher's key
   * (loadDispatcherKey, whose public key new instances then get).
   */
  connect?: (instance: Instance, expectedSecret: string) => Executor;
  /** With `connect`: the authorized_keys line new instances get (none when absent). */
  dispatcherPublicKey?: string;
  /**
   * What to deploy as crunch-run (the composition root decides: cli/runner-artifact.ts, cloud.deployRunnerBinary).
   */
  runner: RunnerArtifact;
  /** The REST server URL runners call (put in every start document). */
  runnerApiUrl: string;
  /** Where each claim is recorded until it answers, for a REST server in the same process (`serve`). */
  claimsInFlight?: ClaimsInFlight;
  /** Standby lock retry interval (ms); default LOCK_RETRY_INTERVAL_MS. */
  lockRetryInterval?: number;
}

export interface Dispatcher {
  /**
   * Tries the lock once: active when it gets it (components started before this resolves), standby
   * otherwise (retrying in the background).
   */
  start(): Promise<void>;
  /** Graceful: stops the loops, writes pending statuses, stops the parts, releases the lock. */
  stop(): Promise<void>;
  /**
   * For tests: abandons everything as a crash would: the loops stop, nothing is flushed or waited for, the
   * lock's connection is dropped. Instances, runners and the database are left as they are.
   */
  kill(): Promise<void>;
  /** One queue refresh, scheduler pass and sync pass, now (serialised with the loops). */
  runOnce(): Promise<void>;
  /**
   * Committed rows from a REST server in the same process (new bundles, runners' transitions): applied to the
   * queue at once (while active), so the scheduler need not wait for their NOTIFY and the read it wakes. That
   * read still comes and changes nothing (rows are applied by change_seq).
   */
  bundlesWritten(bundles: readonly Bundle[]): void;
  /** Resolves when this dispatcher becomes active. */
  whenActive(): Promise<void>;
  readonly active: boolean;
  /** The parts, while active (tests and the management API). */
  readonly parts: Parts | null;
}

export interface Parts {
  queue: BundleQueue;
  pool: WorkerPool;
  scheduler: Scheduler;
  sync: Sync;
  instanceSet: InstanceSet;
  /** Users' own workers (docs/workers.md). */
  userWorkers: UserWorkers;
}

/** A loop around `body`: runs it, then waits `interval` or until woken; errors are logged, never fatal. */
function createLoop(clock: Clock, logger: Logger, name: string, interval: number, body: () => Promise<void>) {
  let stopped = false;
  let pending = false;
  let wakeup: (() => void) | null = null;
  const done = (async () => {
    while (!stopped) {
      pending = false;
      try {
        await body();
      } catch (err) {
        logger.error({ err }, `${name} failed`);
      }
      if (stopped || pending) continue;
      const abort = new AbortController();
      const woken = new Promise<void>((resolve) => {
        wakeup = resolve;
      });
      await Promise.race([clock.sleep(interval, abort.signal).catch(() => {}), woken]);
      wakeup = null;
      abort.abort();
    }
  })();
  return {
    wake() {
      pending = true;
      wakeup?.();
    },
    /** Stops after the current body; resolves when it is done. */
    stop(): Promise<void> {
      stopped = true;
      wakeup?.();
      return done;
    },
  };
}

type Loop = ReturnType<typeof createLoop>;

export async function createDispatcher(opts: DispatcherOptions): Promise<Dispatcher> {
  const { config, db, clock } = opts;
  const logger = opts.logger.child({ component: "dispatcher" });
  const registry = opts.registry ?? new Registry();
  const lockKey = `dispatch-cloud:${instanceSetId(config)}`;
  const retryInterval = opts.lockRetryInterval ?? LOCK_RETRY_INTERVAL_MS;
  const runner = opts.runner;
  // Registered now, so every series exists (at zero) on a standby too.
  const metrics = createDispatcherMetrics({ registry, config, clock, logger: opts.logger });

  let lock: AdvisoryLock | null = null;
  let parts: Parts | null = null;
  let loops: Loop[] = [];
  let unsubscribe: Array<() => void> = [];
  let ownedInstanceSet = false;
  let state: "new" | "standby" | "activating" | "active" | "stopped" = "new";
  const standbyAbort = new AbortController();
  let standby: Promise<void> | null = null;
  let activation: Promise<void> | null = null;
  let becameActive!: () => void;
  const activeOnce = new Promise<void>((resolve) => {
    becameActive = resolve;
  });
  /** Serialises passes of the loops and runOnce(). */
  let passTail: Promise<unknown> = Promise.resolve();
  const serial = <T>(fn: () => Promise<T>): Promise<T> => {
    const run = passTail.then(fn, fn);
    passTail = run.catch(() => {});
    return run;
  };

  /** The executor factory and the public key new instances get. */
  const connectWith = async (): Promise<{
    connect: (instance: Instance, secret: string) => Executor;
    publicKey: string | undefined;
  }> => {
    if (opts.connect !== undefined) return { connect: opts.connect, publicKey: opts.dispatcherPublicKey };
    const key = await loadDispatcherKey(config);
    const connect = sshConnector({
      privateKey: key.privateKey,
      sshPort: config.cloud.sshPort,
      logger: opts.logger,
      clock,
      connectLimits: createConnectLimits({
        maxPerSecond: config.cloud.maxSshConnectsPerSecond,
        maxConcurrent: config.cloud.maxConcurrentSshConnects,
        clock,
      }),
    });
    return { connect, publicKey: key.publicKey };
  };

  /** Builds and starts the parts (the lock is held). */
  const activate = async (): Promise<void> => {
    const startedAt = clock.now();
    const instanceSet =
      opts.instanceSet ??
      (await openInstanceSet(config, {
        drivers: opts.drivers ?? createDefaultRegistry(),
        logger: opts.logger,
        clock,
        registry,
      }));
    ownedInstanceSet = opts.instanceSet === undefined;
    const instanceTypes = instanceTypesFromConfig(config);
    const { connect: rawConnect, publicKey } = await connectWith();
    const connect = metrics.timeConnect(rawConnect);
    const queue = createBundleQueue({
      db,
      clock,
      logger: opts.logger,
      pollInterval: config.dispatcher.pollInterval,
    });
    const transitions = createBundleTransitions({
      db,
      queue,
      logger: opts.logger,
      claimsInFlight: opts.claimsInFlight,
    });
    const pool = createWorkerPool({
      config,
      instanceSet,
      instanceTypes,
      db,
      clock,
      logger: opts.logger,
      registry,
      queue,
      transitions,
      connect,
      runner,
      runnerApiUrl: opts.runnerApiUrl,
      handOffWithClaim: opts.claimsInFlight !== undefined && config.dispatcher.handOffWithClaim,
      ...(publicKey === undefined ? {} : { dispatcherPublicKey: publicKey }),
    });
    const userWorkers = createUserWorkers({ db, queue, transitions, clock, logger: opts.logger, config });
    const scheduler = createScheduler({
      queue,
      pool,
      userWorkers,
      transitions,
      instanceTypes,
      config,
      db,
      clock,
      logger: opts.logger,
    });
    const sync = createSync({ queue, pool, transitions, clock, logger: opts.logger, config, startedAt });
    try {
      await queue.start();
      await userWorkers.start();
      await pool.start();
    } catch (err) {
      await pool.stop().catch(() => {});
      await userWorkers.stop().catch(() => {});
      await queue.stop().catch(() => {});
      if (ownedInstanceSet) await instanceSet.stop().catch(() => {});
      throw err;
    }
    parts = { queue, pool, scheduler, sync, instanceSet, userWorkers };

    const schedulerLoop = createLoop(clock, logger, "scheduler pass", config.dispatcher.pollInterval, () =>
      serial(async () => {
        await scheduler.runOnce();
      }),
    );
    const syncLoop = createLoop(clock, logger, "sync pass", config.cloud.probeInterval, () =>
      serial(() => sync.syncOnce()),
    );
    const workersLoop = createLoop(
      clock,
      logger,
      "users' workers sweep",
      Math.min(config.workers.longPoll, 2000),
      () => userWorkers.sweepOnce(),
    );
    loops = [schedulerLoop, syncLoop, workersLoop];
    unsubscribe = [
      queue.subscribe(() => schedulerLoop.wake()),
      metrics.watch({ queue, pool, userWorkers }),
      userWorkers.subscribe(() => schedulerLoop.wake()),
      pool.subscribe((event: PoolEvent) => {
        schedulerLoop.wake();
        if (event.type !== "create:error") syncLoop.wake();
      }),
    ];
    logger.info({ lockKey, instanceSetId: instanceSetId(config), startedAt }, "dispatcher is active");
  };

  /** Stops the parts; graceful waits for the current passes and writes pending statuses. */
  const deactivate = async (graceful: boolean): Promise<void> => {
    for (const u of unsubscribe) u();
    unsubscribe = [];
    const current = loops;
    loops = [];
    const p = parts;
    parts = null;
    if (!graceful) {
      for (const loop of current) void loop.stop();
      if (p !== null) {
        void p.userWorkers.stop().catch(() => {});
        void p.pool.stop().catch(() => {});
        void p.queue.stop().catch(() => {});
      }
      return;
    }
    await Promise.all(current.map((loop) => loop.stop()));
    if (p === null) return;
    await p.scheduler.flushStatuses().catch((err: unknown) => logger.warn({ err }, "cannot write statuses"));
    await p.userWorkers.stop();
    await p.pool.stop();
    await p.queue.stop();
    if (ownedInstanceSet) await p.instanceSet.stop();
  };

  const onLost = async (held: AdvisoryLock): Promise<void> => {
    if (lock !== held || state !== "active") return;
    logger.error({ lockKey }, "lost the dispatcher lock; stopping at once and waiting as a standby");
    lock = null;
    await deactivate(false);
    state = "standby";
    standby = runStandby();
  };

  /** Takes the lock and activates; false when another dispatcher holds it. */
  const tryActivate = async (): Promise<boolean> => {
    let got: AdvisoryLock | null;
    try {
      got = await db.tryAdvisoryLock(lockKey);
    } catch (err) {
      logger.warn({ err }, "cannot try the dispatcher lock");
      return false;
    }
    if (got === null) return false;
    if (state === "stopped") {
      await got.release();
      return false;
    }
    lock = got;
    state = "activating";
    activation = activate();
    try {
      await activation;
    } catch (err) {
      logger.error({ err }, "cannot start the dispatcher");
      await deactivate(true).catch(() => {});
      lock = null;
      await got.release();
      if (state === "activating") state = "standby";
      throw err;
    } finally {
      activation = null;
    }
    if (state !== "activating") return true; // stopped while activating: shutdown() cleans up
    state = "active";
    void got.lost.then(() => onLost(got));
    becameActive();
    return true;
  };

  const runStandby = async (): Promise<void> => {
    logger.info({ lockKey }, "another dispatcher holds the lock; waiting as a standby");
    while (state === "standby") {
      try {
        await clock.sleep(retryInterval, standbyAbort.signal);
      } catch {
        return;
      }
      if (state !== "standby") return;
      try {
        if (await tryActivate()) return;
      } catch {
        // Logged by tryActivate; try again later.
      }
    }
  };

  const shutdown = async (graceful: boolean): Promise<void> => {
    state = "stopped";
    standbyAbort.abort(new Error("dispatcher stopped"));
    await activation?.catch(() => {});
    if (!graceful) {
      await deactivate(false);
      const held = lock;
      lock = null;
      await held?.release();
      return;
    }
    await standby?.catch(() => {});
    await deactivate(true);
    const held = lock;
    lock = null;
    await held?.release();
    logger.info("dispatcher stopped");
  };

  return {
    async start() {
      if (state !== "new") throw new Error("dispatcher already started");
      state = "standby";
      if (await tryActivate()) return;
      standby = runStandby();
    },
    stop: () => shutdown(true),
    kill: () => shutdown(false),
    async runOnce() {
      const p = parts;
      if (p === null) throw new Error("the dispatcher is not active");
      await p.queue.refresh();
      await serial(async () => {
        await p.scheduler.runOnce();
        await p.sync.syncOnce();
      });
    },
    bundlesWritten(bundles) {
      parts?.queue.applyAll(bundles);
    },
    whenActive: () => activeOnce,
    get active() {
      return state === "active";
    },
    get parts() {
      return parts;
    },
  };
}
