import { chmod, mkdir, writeFile } from "node:fs/promises";
import { join, resolve } from "node:path";
import type { FastifyInstance } from "fastify";
import { Registry } from "prom-client";
import { loadConfig } from "../../config/load.ts";
import type { Config } from "../../config/schema.ts";
import { createDispatcher } from "../../dispatcher/main.ts";
import { instancePriceLookup } from "../../dispatcher/metrics.ts";
import { loadRunnerArtifact } from "../../dispatcher/runner-artifact.ts";
import { systemClock } from "../../lib/clock.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import { createLogger, type Logger } from "../../lib/logger.ts";
import { createManagementServer } from "../../management-api/server.ts";
import { createBundleManager } from "../../rest-server/bundle-manager.ts";
import { createRestServer } from "../../rest-server/server.ts";
import { hashToken, newUserToken, newUserUuid } from "../../rest-server/tokens.ts";
import type { Db } from "../../store/db.ts";
import { openDb } from "../../store/db.ts";
import { migrate } from "../../store/migrate.ts";
import { countUsers, createUser } from "../../store/queries.ts";
import { parse } from "../args.ts";
import { type CliIo, EXIT_OK } from "../io.ts";

const OPTIONS = { config: { type: "string", short: "c" } } as const;

/** The config file named by --config (or DISPATCH_CLOUD_CONFIG); undefined = the embedded defaults. */
function configPath(io: CliIo, argv: string[]): string | undefined {
  const { values } = parse(argv, OPTIONS, false);
  const path = values.config ?? io.env["DISPATCH_CLOUD_CONFIG"];
  return path === undefined || path === "" ? undefined : resolve(io.cwd, path);
}

/** Loads and validates the config named by --config (or DISPATCH_CLOUD_CONFIG); none = the embedded defaults. */
export function configFromArgs(io: CliIo, argv: string[]): Config {
  return loadConfig(configPath(io, argv));
}

/** Opens the database and brings its schema up to date, logging what was applied. */
export async function openMigrated(config: Config, logger: Logger): Promise<Db> {
  const db = await openDb(config.database.url, { maxConnections: config.database.maxConnections, logger });
  try {
    const { applied } = await migrate(db);
    if (applied.length > 0) logger.info({ applied }, "database migrations applied");
  } catch (err) {
    await db.close();
    throw err;
  }
  return db;
}

export async function migrateCommand(io: CliIo): Promise<number> {
  const config = configFromArgs(io, io.argv);
  const logger = createLogger(config.logging);
  const db = await openDb(config.database.url, { maxConnections: 1, logger });
  try {
    const { applied } = await migrate(db);
    io.out(applied.length === 0 ? "database is up to date" : `applied: ${applied.join(", ")}`);
  } finally {
    await db.close();
  }
  return EXIT_OK;
}

/**
 * The first start of a database creates an admin user and writes its token to `<dataDir>/admin-token`
 * (mode 0600), where the CLI looks by default. The token is never logged.
 */
export async function ensureAdmin(db: Db, config: Config, logger: Logger): Promise<void> {
  if ((await countUsers(db)) > 0) return;
  const token = newUserToken();
  const user = await createUser(db, {
    uuid: newUserUuid(config.clusterId),
    name: "admin",
    isAdmin: true,
    tokenHash: hashToken(token),
  });
  const dir = resolve(config.dataDir);
  await mkdir(dir, { recursive: true, mode: 0o700 });
  const file = join(dir, "admin-token");
  await writeFile(file, `${token}\n`, { mode: 0o600 });
  await chmod(file, 0o600);
  logger.info({ user: user.uuid, tokenFile: file }, "created the admin user; its token is in the token file");
}

export function splitListen(listen: string, key: string): { host: string; port: number } {
  const m = /^(.*):(\d+)$/.exec(listen);
  if (m === null)
    throw new DispatchCloudError("config.invalid_value", `${listen} is not host:port`, { path: key });
  return { host: m[1]!.replace(/^\[(.*)\]$/, "$1"), port: Number(m[2]) };
}

/**
 * `serve` (everything in one process, the embedded default) and `rest-server` (the users' API alone, on
 * PostgreSQL). Runs until SIGINT or SIGTERM, or until io.signal aborts.
 */
export async function serveCommand(io: CliIo, mode: "serve" | "rest-server"): Promise<number> {
  let config = configFromArgs(io, io.argv);
  // The embedded default is for trying dispatch-cloud on one machine, which may have no docker.
  if (mode === "serve" && configPath(io, io.argv) === undefined)
    config = { ...config, dispatcher: { ...config.dispatcher, runtimeEngine: "auto" } };
  if (mode === "rest-server" && config.database.url.startsWith("pglite:")) {
    throw new DispatchCloudError(
      "config.invalid_value",
      "rest-server runs apart from the dispatcher and needs PostgreSQL (postgres://...); PGlite is for `serve` only",
      { path: "database.url" },
    );
  }
  const logger = createLogger(config.logging);
  // Before anything starts: a missing cloud.deployRunnerBinary is a config error.
  const runner =
    mode === "serve"
      ? await loadRunnerArtifact({ deployRunnerBinary: config.cloud.deployRunnerBinary, logger })
      : null;
  const db = await openMigrated(config, logger);
  await ensureAdmin(db, config, logger);
  const app = await createRestServer({
    db,
    logger,
    clusterId: config.clusterId,
    maxRequestBodySize: config.restServer.maxRequestBodySize,
    defaultMaxAttempts: config.dispatcher.defaultMaxAttempts,
    dataDir: resolve(config.dataDir),
    maxOutputSize: config.restServer.maxOutputSize,
    instancePrice: instancePriceLookup(config),
    quotas: config.quotas,
  });
  const manager = createBundleManager({
    db,
    logger,
    pollInterval: config.dispatcher.pollInterval,
  });
  await manager.start();
  const { host, port } = splitListen(config.restServer.listen, "restServer.listen");
  const address = await app.listen({ host, port });
  // `serve` runs the dispatcher in-process; it deploys this program as crunch-run. One registry holds the
  // dispatcher's metrics, which the management API serves at /metrics.
  const registry = new Registry();
  const dispatcher =
    mode === "serve"
      ? await createDispatcher({
          config,
          db,
          clock: systemClock,
          logger,
          registry,
          runner: runner!,
          runnerApiUrl: config.restServer.publicUrl !== "" ? config.restServer.publicUrl : address,
        })
      : null;
  let management: { app: FastifyInstance; address: string } | null = null;
  if (dispatcher !== null) {
    try {
      management = await listenManagement(config, { dispatcher, db, registry, logger, env: io.env });
    } catch (err) {
      await app.close();
      await manager.stop();
      await db.close();
      throw err;
    }
  }
  await dispatcher?.start();
  logger.info({ address, mode, database: config.database.url.split(":")[0] }, "dispatch-cloud is serving");
  io.progress(`dispatch-cloud ${mode}: REST API at ${address}/api/v1 (Ctrl-C stops it)`);
  if (management !== null) io.progress(`dispatch-cloud ${mode}: management API at ${management.address}`);

  await new Promise<void>((done) => {
    const stop = () => done();
    process.once("SIGINT", stop);
    process.once("SIGTERM", stop);
    io.signal?.addEventListener("abort", stop, { once: true });
  });
  logger.info("shutting down");
  await management?.app.close();
  await dispatcher?.stop();
  await app.close();
  await manager.stop();
  await db.close();
  return EXIT_OK;
}

/**
 * The management API (management-api/server.ts) on management.listen, for the process that runs the
 * dispatcher. Throws before listening when management.token cannot be read.
 */
export async function listenManagement(
  config: Config,
  parts: Omit<Parameters<typeof createManagementServer>[0], "config">,
): Promise<{ app: FastifyInstance; address: string }> {
  const app = await createManagementServer({ config, ...parts });
  const { host, port } = splitListen(config.management.listen, "management.listen");
  try {
    const address = await app.listen({ host, port });
    return { app, address };
  } catch (err) {
    await app.close();
    throw err;
  }
}
