/**
 * The SSH command latency histogram: an Executor wrapper observing every command and socket exchange, by
 * operation and outcome, so any executor (the SSH one, the stub cloud's) is measured the same way.
 */
import { Histogram, type Registry } from "prom-client";
import type { Instance } from "../../cloud-drivers/types.ts";
import type { Clock } from "../../lib/clock.ts";
import type { Executor } from "../../lib/executor.ts";

export const SSH_METRIC = "dispatchcloud_ssh_command_duration_seconds";
export const SSH_OPERATIONS = ["execute", "exchange"] as const;
/** `success`: exit status 0 (or the exchange answered); `nonzero`: the command ran and failed; `error`: transport. */
export const SSH_OUTCOMES = ["success", "nonzero", "error"] as const;
type Outcome = (typeof SSH_OUTCOMES)[number];
type Operation = (typeof SSH_OPERATIONS)[number];

export type Connect = (instance: Instance, expectedSecret: string) => Executor;

/** Registers the histogram (once per registry) and returns a wrapper for an executor factory. */
export function createSshMetrics(registry: Registry, clock: Clock): (connect: Connect) => Connect {
  const histogram =
    (registry.getSingleMetric(SSH_METRIC) as Histogram<"operation" | "outcome"> | undefined) ??
    new Histogram({
      name: SSH_METRIC,
      help: "Latency of commands and socket exchanges on instances (SSH executor), in seconds, by operation and outcome.",
      labelNames: ["operation", "outcome"],
      buckets: [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300],
      registers: [registry],
    });
  for (const operation of SSH_OPERATIONS) {
    for (const outcome of SSH_OUTCOMES) histogram.zero({ operation, outcome });
  }
  const timed = async <T>(operation: Operation, call: () => Promise<T>, outcome: (r: T) => Outcome) => {
    const start = clock.now();
    const observe = (o: Outcome) =>
      histogram.observe({ operation, outcome: o }, (clock.now() - start) / 1000);
    let result: T;
    try {
      result = await call();
    } catch (err) {
      observe("error");
      throw err;
    }
    observe(outcome(result));
    return result;
  };
  return (connect) => (instance, secret) => {
    const inner = connect(instance, secret);
    const exchange = inner.exchange;
    const wrapped: Executor = {
      execute: (command, opts) =>
        timed(
          "execute",
          () => inner.execute(command, opts),
          (r) => (r.exitCode === 0 ? "success" : "nonzero"),
        ),
      close: () => inner.close(),
    };
    const open = inner.connect;
    if (open !== undefined) wrapped.connect = () => open.call(inner);
    if (exchange !== undefined) {
      wrapped.exchange = (socketPath, payload, opts) =>
        timed(
          "exchange",
          () => exchange.call(inner, socketPath, payload, opts),
          () => "success",
        );
    }
    return wrapped;
  };
}
