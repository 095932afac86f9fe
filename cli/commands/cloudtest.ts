import { Registry } from "prom-client";
import { createDefaultRegistry, openInstanceSet } from "../../cloud-drivers/registry.ts";
import { runCloudtest } from "../../dispatcher/cloudtest.ts";
import { loadDispatcherKey } from "../../dispatcher/pool/bootstrap.ts";
import { sshConnector } from "../../dispatcher/sshexec/executor.ts";
import { systemClock } from "../../lib/clock.ts";
import { createLogger } from "../../lib/logger.ts";
import { parse } from "../args.ts";
import { type CliIo, EXIT_FAILED, EXIT_OK } from "../io.ts";
import { configFromArgs } from "./serve.ts";

const USAGE = `usage: dispatch-cloud cloudtest [--config F] [--instance-type T] [--destroy-existing] [--command C]
Creates one instance with the configured driver, checks that it is listed with its tags, connects over SSH and
verifies its secret, waits for the boot probe, runs C (default: uname -a), destroys it and checks it is gone.`;

export async function cloudtestCommand(io: CliIo): Promise<number> {
  const { values } = parse(
    io.argv,
    {
      config: { type: "string", short: "c" },
      "instance-type": { type: "string" },
      "destroy-existing": { type: "boolean" },
      command: { type: "string" },
      help: { type: "boolean", short: "h" },
    },
    false,
  );
  if (values.help === true) {
    io.out(USAGE);
    return EXIT_OK;
  }
  const config = configFromArgs(io, values.config === undefined ? [] : ["--config", values.config]);
  const logger = createLogger(config.logging);
  const clock = systemClock;
  const registry = new Registry();
  const instanceSet = await openInstanceSet(config, {
    drivers: createDefaultRegistry(),
    logger,
    clock,
    registry,
  });
  const key = await loadDispatcherKey(config);
  try {
    const ok = await runCloudtest(
      {
        instanceType: values["instance-type"],
        destroyExisting: values["destroy-existing"] === true,
        command: values.command ?? "uname -a",
      },
      {
        config,
        instanceSet,
        clock,
        key,
        out: io.out,
        connect: sshConnector({ privateKey: key.privateKey, sshPort: config.cloud.sshPort, logger, clock }),
      },
    );
    return ok ? EXIT_OK : EXIT_FAILED;
  } finally {
    await instanceSet.stop();
  }
}
