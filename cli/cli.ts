import { runConfigCheck, runConfigDefaults } from "../config/check.ts";
import { bundlesCommand } from "./commands/bundles.ts";
import { cloudtestCommand } from "./commands/cloudtest.ts";
import { dispatcherCommand } from "./commands/dispatcher.ts";
import { gahpCommand } from "./commands/gahp.ts";
import { imagesCommand } from "./commands/images.ts";
import { instanceCommand } from "./commands/instance.ts";
import { pipelineCommand } from "./commands/pipeline.ts";
import { queueCommand } from "./commands/queue.ts";
import { migrateCommand, serveCommand } from "./commands/serve.ts";
import { submitCommand } from "./commands/submit.ts";
import { tokensCommand } from "./commands/tokens.ts";
import { uploadCommand } from "./commands/upload.ts";
import { usersCommand } from "./commands/users.ts";
import { workerCommand } from "./commands/worker.ts";
import { workersCommand } from "./commands/workers.ts";
import { type CliIo, type Command, EXIT_OK, reportError, usageError } from "./io.ts";

const USAGE = `dispatch-cloud — runs batch containers ("bundles") on cloud VMs it creates and destroys on demand

usage: dispatch-cloud COMMAND [ARGS]

processes:
  serve [--config F]            REST server + dispatcher in one process (embedded default: PGlite, local VMs)
  rest-server [--config F]      the users' REST API alone (PostgreSQL)
  dispatcher [--config F]       the dispatcher alone (PostgreSQL; a second one waits as a standby)
  migrate [--config F]          bring the database schema up to date
  cloudtest [--config F]        create, reach, probe and destroy one instance with the configured cloud
configuration:
  config check FILE             validate a config file; every problem with its key path
  config defaults               print the annotated defaults
users and bundles (clients of the REST server: --api-url URL, token from DISPATCH_CLOUD_TOKEN,
--token-file F, or <data dir>/admin-token):
  users create NAME [--admin]   create a user (admin only); prints its token once
  tokens create|list|revoke     your API tokens: make another (--ttl, --expires-at), list them, revoke one
  submit [FILE] [flags] -- CMD  submit a bundle; --wait follows it until it is final
  bundles list|show|kill|events
  upload DIR [--name N]         a directory into the content-addressed store, as a ready bundle to depend on
  images push|list|rm           container images in the content-addressed store (docker save; no registry)
  workers token create|list|disable|enable  your own machines as workers (docs/workers.md); --all: admins
  worker --api-url URL --token-file F --worker-id ID [--tag T]...  run bundles on this machine (a worker)
  gahp [--config F]             a BOINC GAHP on stdin/stdout, so HTCondor 9.x submits to us (docs/htcondor.md)
  pipeline check|apply|list|run|rerun|status  pipelines of apps and job ids (docs/pipelines.md): run APP JOB_ID
                                creates the job and every parent job not yet done, each as a bundle
operators (clients of the management API: --management-url URL, default http://127.0.0.1:8901; token from
DISPATCH_CLOUD_MANAGEMENT_TOKEN, --token-file F, or <data dir>/management-token):
  instance list [--header]      every instance as the dispatcher sees it
  instance hold|drain|run|kill ID...  change an instance's idle behaviour, or destroy it
  queue [--header]              the queue in scheduler order, with why each bundle is not running

'dispatch-cloud COMMAND --help' tells more where a command has options.`;

const config: Command = async (io) => {
  const [sub, ...rest] = io.argv;
  if (sub === "check" && rest.length === 1) return runConfigCheck(rest[0]!, io.out);
  if (sub === "defaults" && rest.length === 0) return runConfigDefaults(io.out);
  throw usageError("usage: dispatch-cloud config check FILE | dispatch-cloud config defaults");
};

export const COMMANDS: Record<string, Command> = {
  serve: (io) => serveCommand(io, "serve"),
  "rest-server": (io) => serveCommand(io, "rest-server"),
  dispatcher: dispatcherCommand,
  migrate: migrateCommand,
  config,
  cloudtest: cloudtestCommand,
  users: usersCommand,
  tokens: tokensCommand,
  submit: submitCommand,
  bundles: bundlesCommand,
  upload: uploadCommand,
  images: imagesCommand,
  gahp: (io) => gahpCommand(io),
  pipeline: pipelineCommand,
  instance: instanceCommand,
  queue: queueCommand,
  workers: workersCommand,
  worker: workerCommand,
};

/** Runs one command line; returns the exit code. Every error is printed with its stable code. */
export async function runCli(io: CliIo): Promise<number> {
  const [name, ...rest] = io.argv;
  if (name === undefined || name === "help" || name === "--help" || name === "-h") {
    io.out(USAGE);
    return name === undefined ? 2 : EXIT_OK;
  }
  const command = COMMANDS[name];
  try {
    if (command === undefined)
      throw usageError(`unknown command "${name}"; 'dispatch-cloud help' lists them`);
    return await command({ ...io, argv: rest });
  } catch (err) {
    return reportError(io, err);
  }
}
