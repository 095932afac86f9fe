/**
 * `dispatch-cloud cloudtest`: one instance through its whole life against the configured cloud — create, see it
 * listed with its tags, connect and prove its identity, wait for the boot probe, run a command, destroy it, and
 * see it gone. Each step prints its duration; the first failure names its step, and the instance is destroyed
 * on the way out whatever happened.
 */
import type { Instance, InstanceSet } from "../cloud-drivers/types.ts";
import type { Config } from "../config/schema.ts";
import type { Clock } from "../lib/clock.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import type { Executor } from "../lib/executor.ts";
import { formatDuration } from "../lib/units.ts";
import { instanceTypesFromConfig } from "./instance-types.ts";
import { type DispatcherKey, initScript, instanceTags, newInstanceSecret } from "./pool/bootstrap.ts";

export interface CloudtestOptions {
  instanceType?: string | undefined;
  destroyExisting: boolean;
  command: string;
}

export interface CloudtestDeps {
  config: Config;
  instanceSet: InstanceSet;
  clock: Clock;
  key: DispatcherKey;
  /** Opens an executor to the instance that proves the given secret before any other command. */
  connect(instance: Instance, secret: string): Executor;
  out(line: string): void;
  /** Interval between retries while waiting (SSH, boot probe, disappearance). */
  pollIntervalMs?: number;
}

class StepFailed extends Error {}

/** Returns true when every step passed. */
export async function runCloudtest(opts: CloudtestOptions, deps: CloudtestDeps): Promise<boolean> {
  const { config, instanceSet, clock, out } = deps;
  const poll = deps.pollIntervalMs ?? 1000;
  const prefix = config.cloud.tagKeyPrefix;
  let n = 0;
  let instance: Instance | undefined;
  let executor: Executor | undefined;

  const step = async <T>(name: string, fn: () => Promise<T>): Promise<T> => {
    n++;
    const started = clock.now();
    out(`[${n}] ${name} ...`);
    try {
      const result = await fn();
      out(`[${n}] ${name}: ok (${formatDuration(clock.now() - started)})`);
      return result;
    } catch (err) {
      const reason = err instanceof Error ? err.message : String(err);
      out(`[${n}] ${name}: FAILED after ${formatDuration(clock.now() - started)}: ${reason}`);
      throw new StepFailed(`step ${n} (${name}) failed: ${reason}`);
    }
  };

  /** Retries `attempt` until it returns a value or the deadline passes, printing progress every 10 s. */
  const waitFor = async <T>(
    what: string,
    timeoutMs: number,
    attempt: () => Promise<T | undefined>,
  ): Promise<T> => {
    const started = clock.now();
    let lastReport = started;
    let last = "";
    for (;;) {
      try {
        const v = await attempt();
        if (v !== undefined) return v;
      } catch (err) {
        // A host that is not ours will not become ours by waiting.
        if (err instanceof DispatchCloudError && err.code === "ssh.host_mismatch") throw err;
        last = err instanceof Error ? err.message : String(err);
      }
      const now = clock.now();
      if (now - started >= timeoutMs) {
        throw new Error(
          `gave up waiting for ${what} after ${formatDuration(timeoutMs)}${last ? ` (last: ${last})` : ""}`,
        );
      }
      if (now - lastReport >= 10_000) {
        out(
          `    still waiting for ${what} (${formatDuration(now - started)}${last ? `; last: ${last}` : ""})`,
        );
        lastReport = now;
      }
      await clock.sleep(poll);
    }
  };

  try {
    const types = instanceTypesFromConfig(config);
    const type = opts.instanceType === undefined ? types[0] : types.find((t) => t.name === opts.instanceType);
    if (type === undefined) {
      throw new StepFailed(
        `no instance type "${opts.instanceType}" in the config (have: ${types.map((t) => t.name).join(", ")})`,
      );
    }
    if (opts.destroyExisting) {
      await step("destroy existing instances of this instance set", async () => {
        const existing = await instanceSet.instances({});
        await Promise.all(existing.map((i) => i.destroy()));
        out(`    destroyed ${existing.length}`);
      });
    }
    const secret = newInstanceSecret();
    const created = await step(`create an instance of type ${type.name} (${type.providerType})`, () =>
      instanceSet.create(
        type,
        config.cloud.imageId,
        instanceTags(config, type.name, "run", secret),
        initScript(secret, config.cloud.instanceInitCommand),
        deps.key.publicKey,
      ),
    );
    instance = created;
    out(`    instance ${created.id} at ${created.address} (user ${created.remoteUser})`);

    await step("see it listed with its tags", () =>
      waitFor("the instance in the list", config.cloud.timeoutBooting, async () => {
        const listed = (await instanceSet.instances({})).find((i) => i.id === created.id);
        if (listed === undefined) throw new Error("not listed yet");
        for (const [k, v] of Object.entries(instanceTags(config, type.name, "run", secret))) {
          if (listed.tags[k] !== v) throw new Error(`tag ${k} is ${JSON.stringify(listed.tags[k] ?? null)}`);
        }
        const setId = listed.tags[`${prefix}InstanceSetID`];
        if (setId === undefined) throw new Error(`tag ${prefix}InstanceSetID is missing`);
        return listed;
      }),
    );

    executor = deps.connect(created, secret);
    const ssh = executor;
    await step("connect over SSH and verify the instance secret", () =>
      waitFor("SSH and the secret file", config.cloud.timeoutBooting, async () => {
        const r = await ssh.execute("true");
        return r.exitCode === 0 ? true : undefined;
      }),
    );

    const probe = config.cloud.bootProbeCommand;
    await step(`wait for the boot probe (${probe})`, () =>
      waitFor("the boot probe to pass", config.cloud.timeoutBooting, async () => {
        const r = await ssh.execute(probe);
        if (r.exitCode === 0) return true;
        throw new Error(
          `exit code ${r.exitCode}${r.stderr.length ? `: ${r.stderr.toString().trim().slice(0, 200)}` : ""}`,
        );
      }),
    );

    await step(`run the command: ${opts.command}`, async () => {
      const r = await ssh.execute(opts.command);
      for (const line of r.stdout.toString().trimEnd().split("\n")) if (line !== "") out(`    | ${line}`);
      if (r.exitCode !== 0) {
        throw new Error(
          `exit code ${r.exitCode}${r.stderr.length ? `: ${r.stderr.toString().trim().slice(0, 200)}` : ""}`,
        );
      }
    });

    await ssh.close();
    executor = undefined;
    await step("destroy the instance", () => created.destroy());
    instance = undefined;
    await step("see it gone from the list", () =>
      waitFor("the instance to disappear", Math.max(config.cloud.timeoutShutdown, 60_000), async () => {
        const listed = await instanceSet.instances({});
        if (listed.some((i) => i.id === created.id)) throw new Error("still listed");
        return true;
      }),
    );
    out("cloudtest passed");
    return true;
  } catch (err) {
    if (!(err instanceof StepFailed)) throw err;
    out(`cloudtest failed: ${err.message}`);
    return false;
  } finally {
    await executor?.close().catch(() => {});
    if (instance !== undefined) {
      const leftover = instance;
      out(`    cleaning up: destroying ${leftover.id}`);
      await leftover
        .destroy()
        .catch((e: unknown) => out(`    could not destroy ${leftover.id}: ${String(e)}`));
    }
  }
}
