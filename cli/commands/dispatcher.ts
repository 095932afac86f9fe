import { Registry } from "prom-client";
import { createDispatcher } from "../../dispatcher/main.ts";
import { systemClock } from "../../lib/clock.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import { createLogger } from "../../lib/logger.ts";
import { parse } from "../args.ts";
import { type CliIo, EXIT_OK } from "../io.ts";
import { loadRunnerArtifact } from "../runner-artifact.ts";
import { configFromArgs, listenManagement, openMigrated } from "./serve.ts";

const USAGE = `usage: dispatch-cloud dispatcher [--config F]
Runs the dispatcher alone, on PostgreSQL (the REST server runs apart: dispatch-cloud rest-server). One dispatcher
per instance set is active; another one started against the same database waits as a standby and takes over
when the active one dies. It deploys itself as crunch-run (or cloud.deployRunnerBinary when set).`;

/** The URL runners call: restServer.publicUrl, or http://<restServer.listen>. */
export function runnerApiUrl(config: { restServer: { publicUrl: string; listen: string } }): string {
  return config.restServer.publicUrl !== ""
    ? config.restServer.publicUrl
    : `http://${config.restServer.listen}`;
}

/** `dispatch-cloud dispatcher`: runs until SIGINT or SIGTERM, or until io.signal aborts. */
export async function dispatcherCommand(io: CliIo): Promise<number> {
  const { values } = parse(
    io.argv,
    { config: { type: "string", short: "c" }, help: { type: "boolean", short: "h" } },
    false,
  );
  if (values.help === true) {
    io.out(USAGE);
    return EXIT_OK;
  }
  const config = configFromArgs(io, values.config === undefined ? [] : ["--config", values.config]);
  if (config.database.url.startsWith("pglite:")) {
    throw new DispatchCloudError(
      "config.invalid_value",
      "the dispatcher runs apart from the REST server and needs PostgreSQL (postgres://...); PGlite is for `serve` only",
      { path: "database.url" },
    );
  }
  const logger = createLogger(config.logging);
  const runner = await loadRunnerArtifact({ deployRunnerBinary: config.cloud.deployRunnerBinary, logger });
  const db = await openMigrated(config, logger);
  // One registry: the dispatcher's metrics, served by the management API at /metrics.
  const registry = new Registry();
  const dispatcher = await createDispatcher({
    config,
    db,
    clock: systemClock,
    logger,
    registry,
    runner,
    runnerApiUrl: runnerApiUrl(config),
  });
  let management: Awaited<ReturnType<typeof listenManagement>> | null = null;
  try {
    // A standby serves it too: /metrics and /_health/ping, and 503 management.not_active for the rest.
    management = await listenManagement(config, { dispatcher, db, registry, logger, env: io.env });
    io.progress(`dispatch-cloud dispatcher: management API at ${management.address}`);
    await dispatcher.start();
    io.progress(
      dispatcher.active
        ? "dispatch-cloud dispatcher: active (Ctrl-C stops it)"
        : "dispatch-cloud dispatcher: standby, another dispatcher is active (Ctrl-C stops it)",
    );
    void dispatcher.whenActive().then(() => io.progress("dispatch-cloud dispatcher: active"));
    await new Promise<void>((done) => {
      process.once("SIGINT", () => done());
      process.once("SIGTERM", () => done());
      io.signal?.addEventListener("abort", () => done(), { once: true });
    });
    logger.info("shutting down");
  } finally {
    await management?.app.close();
    await dispatcher.stop();
    await db.close();
  }
  return EXIT_OK;
}
