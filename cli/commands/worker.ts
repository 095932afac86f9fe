/**
 * `dispatch-cloud worker`: runs this machine as one of the user's workers (cli/worker/worker.ts,
 * docs/workers.md). Ctrl-C or SIGTERM stops it as --on-stop says; a second one hands the bundles back. After
 * an upgrade it starts the new program with the same arguments and exits with its exit code.
 */
import { readFile } from "node:fs/promises";
import { resolve } from "node:path";
import { DispatchCloudError } from "../../lib/errors.ts";
import { createLogger } from "../../lib/logger.ts";
import { RUNTIME_ENGINES, type RuntimeEngine } from "../../lib/runner-protocol.ts";
import { WORKER_ID_PATTERN, WORKER_TOKEN_PREFIX } from "../../lib/tokens.ts";
import { MAX_SLOTS, MAX_TAGS, TAG_PATTERN } from "../../lib/worker-protocol.ts";
import { parse } from "../args.ts";
import { type CliIo, EXIT_OK, usageError } from "../io.ts";
import { relaunch } from "../worker/upgrade.ts";
import { type StopMode, startWorker } from "../worker/worker.ts";

const USAGE = `usage: dispatch-cloud worker --api-url URL --token-file F --worker-id ID [--tag T]... [--slots N]
         [--work-dir D] [--runtime docker|process|auto] [--on-stop finish|hand-back] [--verbose]
Runs your bundles on this machine (docs/workers.md). 'dispatch-cloud workers token create' makes the id and token.
  --work-dir D     where bundles run, their logs and the input cache (default ./dispatch-cloud-worker)
  --slots N        bundles at once (default: the number of CPUs)
  --tag T          a tag bundles can ask for (resources.tag); repeat for more
  --runtime R      the container runtime for every bundle (default: the server's)
  --on-stop M      Ctrl-C: finish (default: finish the running bundles first) or hand-back (requeue them now);
                   a second Ctrl-C hands back
  --verbose        log every check-in`;

export async function workerCommand(io: CliIo): Promise<number> {
  const { values, positionals } = parse(io.argv, {
    "api-url": { type: "string" },
    "token-file": { type: "string" },
    "worker-id": { type: "string" },
    tag: { type: "string", multiple: true },
    slots: { type: "string" },
    "work-dir": { type: "string" },
    runtime: { type: "string" },
    "on-stop": { type: "string" },
    verbose: { type: "boolean" },
    help: { type: "boolean", short: "h" },
  });
  if (values.help === true) {
    io.out(USAGE);
    return EXIT_OK;
  }
  if (positionals.length > 0) throw usageError(`worker takes no arguments (got ${positionals[0]})\n${USAGE}`);
  const apiUrl = values["api-url"] ?? io.env["DISPATCH_CLOUD_API_URL"];
  if (apiUrl === undefined) throw usageError(`--api-url is required\n${USAGE}`);
  try {
    new URL(apiUrl);
  } catch {
    throw usageError(`--api-url ${JSON.stringify(apiUrl)} is not a URL`);
  }
  const workerId = values["worker-id"];
  if (workerId === undefined || !new RegExp(WORKER_ID_PATTERN).test(workerId))
    throw usageError(`--worker-id must be a worker id (xxxxx-wrkr-...)\n${USAGE}`);
  const tokenFile = values["token-file"] ?? io.env["DISPATCH_CLOUD_WORKER_TOKEN_FILE"];
  if (tokenFile === undefined) throw usageError(`--token-file is required\n${USAGE}`);
  let token: string;
  try {
    token = (await readFile(resolve(io.cwd, tokenFile), "utf8")).trim();
  } catch (err) {
    throw new DispatchCloudError("cli.no_token", `cannot read token file ${tokenFile}`, { cause: err });
  }
  if (!token.startsWith(WORKER_TOKEN_PREFIX))
    throw new DispatchCloudError(
      "cli.no_token",
      `${tokenFile} holds no worker token (${WORKER_TOKEN_PREFIX}...): 'dispatch-cloud workers token create' makes one`,
    );
  const tags = values.tag ?? [];
  if (tags.length > MAX_TAGS) throw usageError(`at most ${MAX_TAGS} tags`);
  for (const t of tags) {
    if (!new RegExp(TAG_PATTERN).test(t))
      throw usageError(`tag ${JSON.stringify(t)}: lower-case letters, digits, '.', '_' and '-' (at most 63)`);
  }
  let slots: number | undefined;
  if (values.slots !== undefined) {
    slots = Number(values.slots);
    if (!/^\d+$/.test(values.slots) || slots < 1 || slots > MAX_SLOTS)
      throw usageError(`--slots must be a whole number from 1 to ${MAX_SLOTS}`);
  }
  const runtime = values.runtime;
  if (runtime !== undefined && !RUNTIME_ENGINES.includes(runtime as RuntimeEngine))
    throw usageError(`--runtime must be one of ${RUNTIME_ENGINES.join(", ")}`);
  const onStop = values["on-stop"] ?? "finish";
  if (onStop !== "finish" && onStop !== "hand-back")
    throw usageError("--on-stop must be finish or hand-back");

  const logger = createLogger({ level: values.verbose === true ? "debug" : "info", format: "auto" });
  const handle = await startWorker({
    apiUrl,
    token,
    workerId,
    tags,
    ...(slots === undefined ? {} : { slots }),
    workDir: resolve(io.cwd, values["work-dir"] ?? "dispatch-cloud-worker"),
    ...(runtime === undefined ? {} : { runtime: runtime as RuntimeEngine }),
    onStop: onStop as StopMode,
    logger,
    env: io.env as NodeJS.ProcessEnv,
  });
  const onSignal = () => handle.stop();
  process.on("SIGINT", onSignal);
  process.on("SIGTERM", onSignal);
  let exit: Awaited<typeof handle.done>;
  try {
    exit = await handle.done;
  } finally {
    process.off("SIGINT", onSignal);
    process.off("SIGTERM", onSignal);
  }
  if (exit.kind === "upgraded") {
    logger.flush();
    return relaunch(exit.programFile, process.argv.slice(2));
  }
  return EXIT_OK;
}
