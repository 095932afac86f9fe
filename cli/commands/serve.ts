import { randomBytes } from "node:crypto";
import { chmod, mkdir, readFile, writeFile } from "node:fs/promises";
import { join, resolve } from "node:path";
import type { FastifyInstance } from "fastify";
import { Registry } from "prom-client";
import { loadConfig } from "../../config/load.ts";
import type { Config } from "../../config/schema.ts";
import { createDispatcher } from "../../dispatcher/main.ts";
import { ClaimsInFlight } from "../../lib/claims-in-flight.ts";
import { systemClock } from "../../lib/clock.ts";
import { lockDataDir, preparePrivateDir } from "../../lib/data-dir.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import { createLogger, type Logger } from "../../lib/logger.ts";
import { hashToken, newUserToken, newUserUuid } from "../../lib/tokens.ts";
import { createManagementServer } from "../../management-api/server.ts";
import { createBundleManager } from "../../rest-server/bundle-manager.ts";
import { createS3Backend } from "../../rest-server/cas/backend-s3.ts";
import { createCasBackend } from "../../rest-server/cas/factory.ts";
import { createRegistryResolver } from "../../rest-server/image-registry.ts";
import { storeImageResolver } from "../../rest-server/image-resolve.ts";
import { createPipelineManager } from "../../rest-server/pipelines/manager.ts";
import { createRestServer } from "../../rest-server/server.ts";
import type { Db } from "../../store/db.ts";
import { openDb } from "../../store/db.ts";
import { migrate } from "../../store/migrate.ts";
import { countUsers, createUser } from "../../store/queries.ts";
import type { Bundle } from "../../store/types.ts";
import { parse } from "../args.ts";
import { type CliIo, EXIT_OK } from "../io.ts";
import { loadRunnerArtifact, runningFromSources } from "../runner-artifact.ts";

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
  const db = await openDb(config.database.url, {
    maxConnections: config.database.maxConnections,
    maintenanceInterval: config.database.embeddedMaintenanceInterval,
    logger,
  });
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

/** Where `serve` on the embedded default keeps the management API's token (like admin-token). */
export const MANAGEMENT_TOKEN_FILE = "management-token";

/**
 * The embedded default's management token: `<dataDir>/management-token` (mode 0600), made on the first start
 * and read on later ones; the CLI's operator commands find it there as the users' commands find admin-token.
 * Returns the config with management.token pointing at the file.
 */
export async function ensureManagementToken(
  config: Config,
  dataDir: string,
  logger: Logger,
): Promise<Config> {
  const file = join(dataDir, MANAGEMENT_TOKEN_FILE);
  let token = await readFile(file, "utf8").then(
    (t) => t.trim(),
    () => "",
  );
  if (token === "") {
    token = `dcm_${randomBytes(24).toString("base64url")}`;
    await writeFile(file, `${token}\n`, { mode: 0o600 });
    await chmod(file, 0o600);
    logger.info({ tokenFile: file }, "created the management API's token; it is in the token file");
  }
  return { ...config, management: { ...config.management, token: `file://${file}` } };
}

/** Listens, turning "address in use" and the like into serve.cannot_listen naming the config key. */
export async function listenOn(app: FastifyInstance, listen: string, key: string): Promise<string> {
  const { host, port } = splitListen(listen, key);
  try {
    return await app.listen({ host, port });
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    const why =
      code === "EADDRINUSE"
        ? "the address is in use by another process"
        : code === "EACCES"
          ? "not allowed (ports below 1024 need privileges)"
          : code === "EADDRNOTAVAIL"
            ? "no such address on this machine"
            : (err as Error).message;
    throw new DispatchCloudError("serve.cannot_listen", `cannot listen on ${listen} (${key}): ${why}`, {
      path: key,
      cause: err,
    });
  }
}

/**
 * `serve` (everything in one process, the embedded default) and `rest-server` (the users' API alone, on
 * PostgreSQL). Runs until SIGINT or SIGTERM, or until io.signal aborts. The data directory is made private
 * first; `serve` then takes it for itself (lib/data-dir.ts: a second `serve` on it exits at once, naming this
 * one) before it opens the database. Whatever fails on the way, everything opened so far is closed again, so
 * the process ends (non-zero) instead of hanging.
 */
export async function serveCommand(io: CliIo, mode: "serve" | "rest-server"): Promise<number> {
  let config = configFromArgs(io, io.argv);
  const embedded = mode === "serve" && configPath(io, io.argv) === undefined;
  // The embedded default is for trying dispatch-cloud on one machine, which may have no docker.
  if (embedded) config = { ...config, dispatcher: { ...config.dispatcher, runtimeEngine: "auto" } };
  if (mode === "rest-server" && config.database.url.startsWith("pglite:")) {
    throw new DispatchCloudError(
      "config.invalid_value",
      "rest-server runs apart from the dispatcher and needs PostgreSQL (postgres://...); PGlite is for `serve` only",
      { path: "database.url" },
    );
  }
  const logger = createLogger(config.logging);
  /** What to close, in the reverse order of opening. */
  const opened: Array<{ what: string; close: () => Promise<unknown> }> = [];
  try {
    const dataDir = await preparePrivateDir(config.dataDir, logger);
    if (mode === "serve") {
      const lock = await lockDataDir(dataDir, { command: mode });
      opened.push({ what: "the data directory lock", close: () => lock.release() });
    }
    if (embedded && config.management.token === "") {
      config = await ensureManagementToken(config, dataDir, logger);
    }
    // Before anything starts: a missing cloud.deployRunnerBinary is a config error. `serve` deploys it to
    // instances; both modes offer it to users' workers to upgrade to (docs/workers.md). A rest-server running
    // from sources with no cloud.deployRunnerBinary has none (it does not build one): its workers never upgrade.
    const runner =
      mode === "serve" || config.cloud.deployRunnerBinary !== "" || !runningFromSources()
        ? await loadRunnerArtifact({ deployRunnerBinary: config.cloud.deployRunnerBinary, logger })
        : null;
    const db = await openMigrated(config, logger);
    opened.push({ what: "the database", close: () => db.close() });
    await ensureAdmin(db, config, logger);
    await mkdir(join(dataDir, "outputs"), { recursive: true, mode: 0o700 });
    // One registry holds the REST server's metrics (refused tokens, the content-addressed store) and (serve) the
    // dispatcher's, which the management API serves at /metrics.
    const registry = new Registry();
    const casBackend = await createCasBackend(config.cas, dataDir, {
      s3: (c) =>
        createS3Backend({
          bucket: c.bucket,
          region: c.region,
          prefix: c.prefix,
          forcePathStyle: c.forcePathStyle,
          ...(c.endpoint === "" ? {} : { endpoint: c.endpoint }),
        }),
    });
    // Tags of images in the configured registries are pinned to digests at submit time (docs/images.md).
    const registryResolvers =
      Object.keys(config.containers.registries).length === 0
        ? []
        : [
            createRegistryResolver({
              registries: config.containers.registries,
              configuredOnly: true,
              log: logger,
            }),
          ];
    // The dispatcher `serve` starts below learns of new bundles from the REST server at once (no NOTIFY wait).
    let bundlesWritten: ((bundles: readonly Bundle[]) => void) | null = null;
    // Its runners' `start` calls wait for the dispatcher's claims in flight (lib/claims-in-flight.ts).
    const claimsInFlight = mode === "serve" ? new ClaimsInFlight() : undefined;
    const app = await createRestServer({
      db,
      logger,
      onBundlesWritten: (bundles) => bundlesWritten?.(bundles),
      ...(claimsInFlight === undefined ? {} : { claimsInFlight }),
      clusterId: config.clusterId,
      maxRequestBodySize: config.restServer.maxRequestBodySize,
      maxBatchRequestBodySize: config.restServer.maxBatchRequestBodySize,
      defaultMaxAttempts: config.dispatcher.defaultMaxAttempts,
      dataDir,
      maxOutputSize: config.restServer.maxOutputSize,
      maxOutputFiles: config.restServer.maxOutputFiles,
      maxLogBytesPerStream: config.restServer.maxLogBytesPerStream,
      headersTimeout: config.restServer.headersTimeout,
      requestTimeout: config.restServer.requestTimeout,
      minUploadRate: config.restServer.minUploadRate,
      trustedProxies: config.restServer.trustedProxies,
      bundleMinimums: { ram: config.restServer.minBundleRam, vcpus: config.restServer.minBundleVcpus },
      quotas: config.quotas,
      unavailableImageRequeues: config.containers.unavailableImageRequeues,
      imageResolvers: registryResolvers,
      workers: {
        longPoll: config.workers.longPoll,
        runtimeEngine: config.dispatcher.runtimeEngine,
        artifact: runner,
      },
      metricsRegistry: registry,
      cas: {
        backend: casBackend,
        retention: config.cas.retention,
        gcInterval: config.cas.gcInterval,
        maxBatchBytes: config.cas.maxBatchBytes,
        metricsRegistry: registry,
      },
    });
    opened.push({ what: "the REST server", close: () => app.close() });
    const manager = createBundleManager({
      db,
      logger,
      pollInterval: config.dispatcher.pollInterval,
    });
    await manager.start();
    opened.push({ what: "the bundle manager", close: () => manager.stop() });
    // Pipelines' bubble down (docs/pipelines.md "Running"), in every process that serves the REST API.
    const pipelines = createPipelineManager({
      db,
      logger,
      clusterId: config.clusterId,
      defaultMaxAttempts: config.dispatcher.defaultMaxAttempts,
      bundleMinimums: { ram: config.restServer.minBundleRam, vcpus: config.restServer.minBundleVcpus },
      // As the REST server resolves: our store first, then the configured registries.
      imageResolvers: registryResolvers.length === 0 ? [] : [storeImageResolver(db), ...registryResolvers],
      pollInterval: config.dispatcher.pollInterval,
      submitLimits: config.quotas,
    });
    await pipelines.start();
    opened.push({ what: "the pipeline manager", close: () => pipelines.stop() });
    const address = await listenOn(app, config.restServer.listen, "restServer.listen");
    // `serve` runs the dispatcher in-process; it deploys this program as crunch-run.
    let management: { app: FastifyInstance; address: string } | null = null;
    if (mode === "serve") {
      const dispatcher = await createDispatcher({
        config,
        db,
        clock: systemClock,
        logger,
        registry,
        runner: runner!,
        runnerApiUrl: config.restServer.publicUrl !== "" ? config.restServer.publicUrl : address,
        ...(claimsInFlight === undefined ? {} : { claimsInFlight }),
      });
      opened.push({ what: "the dispatcher", close: () => dispatcher.stop() });
      bundlesWritten = (bundles) => dispatcher.bundlesWritten(bundles);
      const m = await listenManagement(config, { dispatcher, db, registry, logger, env: io.env });
      management = m;
      opened.push({ what: "the management API", close: () => m.app.close() });
      await dispatcher.start();
    }
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
  } finally {
    for (const { what, close } of opened.reverse()) {
      await close().catch((err: unknown) => logger.warn({ err }, `closing ${what} failed`));
    }
  }
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
  try {
    const address = await listenOn(app, config.management.listen, "management.listen");
    return { app, address };
  } catch (err) {
    await app.close();
    throw err;
  }
}
