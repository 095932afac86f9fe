/**
 * What a worker (worker.ts) and its runners (remote-runner.ts) need of the fleet around them: the pool builds
 * one WorkerContext and hands it to every Worker.
 */
import type { Instance, InstanceType } from "../../cloud-drivers/types.ts";
import type { Config } from "../../config/schema.ts";
import type { Clock } from "../../lib/clock.ts";
import type { Executor } from "../../lib/executor.ts";
import type { Logger } from "../../lib/logger.ts";
import type { Bundle } from "../../store/types.ts";
import type { BundleTransitions } from "../queue/transitions.ts";
import type { PoolEvent, QueueView, WorkerView } from "../types.ts";
import type { PoolMetrics } from "./metrics.ts";
import type { RunnerCommands } from "./runner-commands.ts";

/** What a worker needs of the fleet around it. */
export interface WorkerContext {
  readonly config: Config;
  readonly clock: Clock;
  readonly metrics: PoolMetrics;
  /** The queue the dispatcher reads (a preempted runner's bundle, a starting runner's fate). */
  readonly queue: QueueView | undefined;
  readonly transitions: BundleTransitions;
  /** What a bundle is charged per hour of running on an instance of a type at a price (chargePerHour). */
  readonly chargePerHour: (bundle: Bundle, type: InstanceType, instancePrice: number) => number;
  readonly runner: { content: Buffer; sha256: string };
  readonly cmds: RunnerCommands;
  readonly runnerApiUrl: string;
  /**
   * Hand a warm pool its start document as the claim leaves rather than once it is back: only when a REST server in
   * this process waits for the claims in flight (lib/claims-in-flight.ts), so the pool's `start` call never comes
   * before the claim it needs (another REST process could only be asked again, against a deadline).
   */
  readonly handOffWithClaim: boolean;
  connect(instance: Instance, expectedSecret: string): Executor;
  emit(event: PoolEvent): void;
  /** Runs `p` in the background: tracked for the pool's settled(), errors logged. */
  track(p: Promise<unknown>, what: string, logger?: Logger): void;
  /** The pool still holds this worker (it is not forgotten). */
  holds(w: WorkerView): boolean;
  /** This worker, created by the pool, was shut down because the runner cannot run on it. */
  runnerFailed(w: WorkerView, message: string): void;
  /** This worker became ready (booted, runner in place). */
  ready(w: WorkerView & { readonly log: Logger }): void;
}
