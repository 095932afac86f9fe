/**
 * Run by test/local-driver.test.ts: creates one local VM, prints its id, then waits to be killed (the test
 * SIGKILLs it to show the VM outlives the process that created it).
 * Usage: node --import tsx test/local-driver-creator.ts <driverParameters JSON> <public key>
 */
import { Registry } from "prom-client";
import { localDriver } from "../cloud-drivers/local/driver.ts";
import { systemClock } from "../lib/clock.ts";
import { createLogger } from "../lib/logger.ts";
import { GiB, instanceType } from "./fixtures.ts";

const [params, publicKey] = process.argv.slice(2);
const logger = createLogger({ level: "warn", format: "json" });
const set = await localDriver.instanceSet(
  JSON.parse(params ?? "{}"),
  "test",
  {},
  {
    logger,
    clock: systemClock,
    registry: new Registry(),
  },
);
const type = instanceType("small", { providerType: "local.small", vcpus: 1, ram: GiB });
const instance = await set.create(type, "image", { Creator: "killed", Keep: "yes" }, "true", publicKey ?? "");
process.stdout.write(`${JSON.stringify({ id: instance.id, address: instance.address })}\n`);
setInterval(() => {}, 60_000);
