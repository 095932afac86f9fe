/**
 * Fixtures every kind of test needs, in one place (rather than rebuilt in each file): a silent logger and one
 * whose lines the test reads, instance
 * types with sensible defaults, and a config from YAML that fails the test with every problem when it is wrong.
 */
import { Writable } from "node:stream";
import type { InstanceType } from "../cloud-drivers/types.ts";
import { parseConfig } from "../config/load.ts";
import type { Config } from "../config/schema.ts";
import { createLogger, type Logger } from "../lib/logger.ts";
import type { RestServerOptions } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";

export const GiB = 2 ** 30;

/** A logger that writes nothing (pino at level silent). */
export const silentLogger: Logger = createLogger({ level: "silent", format: "json" });

/** A logger at `level` whose JSON lines the test reads back, parsed, from `lines`. */
export function capturingLogger(level: string): { logger: Logger; lines: Record<string, unknown>[] } {
  const lines: Record<string, unknown>[] = [];
  const destination = new Writable({
    write(chunk: Buffer, _enc, done) {
      for (const line of chunk.toString("utf8").split("\n")) if (line !== "") lines.push(JSON.parse(line));
      done();
    },
  });
  return { logger: createLogger({ level, format: "json", destination }), lines };
}

/**
 * An instance type: 2 vCPUs, 4 GiB, no scratch, $0.10/h, on demand, no GPU, provider type = name, unless `over`
 * says otherwise. `scratch` is includedScratch + addedScratch unless given.
 */
export function instanceType(name: string, over: Partial<InstanceType> = {}): InstanceType {
  const includedScratch = over.includedScratch ?? 0;
  const addedScratch = over.addedScratch ?? 0;
  return {
    name,
    providerType: name,
    vcpus: 2,
    ram: 4 * GiB,
    price: 0.1,
    preemptible: false,
    gpu: null,
    ...over,
    includedScratch,
    addedScratch,
    scratch: over.scratch ?? includedScratch + addedScratch,
  };
}

/** An instance type with sizes in GiB for brevity (scratch 100 GiB unless given). */
export function testInstanceType(
  name: string,
  opts: {
    vcpus: number;
    ramGiB: number;
    price: number;
    scratchGiB?: number;
    preemptible?: boolean;
    providerType?: string;
    gpu?: InstanceType["gpu"];
  },
): InstanceType {
  return instanceType(name, {
    providerType: opts.providerType ?? name,
    vcpus: opts.vcpus,
    ram: opts.ramGiB * GiB,
    includedScratch: (opts.scratchGiB ?? 100) * GiB,
    price: opts.price,
    preemptible: opts.preemptible ?? false,
    gpu: opts.gpu ?? null,
  });
}

/** The config of a YAML text; throws with every problem (key path and message) when it is not valid. */
export function configFrom(yaml: string): Config {
  const { config, problems } = parseConfig(yaml);
  if (config === undefined) {
    throw new Error(`test config: ${problems.map((p) => `${p.path}: ${p.message}`).join("; ")}`);
  }
  return config;
}

/** The options every test's REST server starts from: no logging, cluster zzzzz, 1 MiB bodies, 3 attempts. */
export function restServerBasics(db: Db, dataDir: string): RestServerOptions {
  return {
    db,
    logger: false,
    clusterId: "zzzzz",
    maxRequestBodySize: 2 ** 20,
    defaultMaxAttempts: 3,
    dataDir,
  };
}
