/**
 * `dispatch-cloud gahp`: a BOINC GAHP for HTCondor's gridmanager (docs/htcondor.md). Requests on stdin, answers on
 * stdout, logs on stderr; it ends on QUIT or when stdin closes.
 */
import { homedir } from "node:os";
import { join, resolve } from "node:path";
import { VERSION } from "../../lib/version.ts";
import { parse } from "../args.ts";
import { GahpApi, Limiter } from "../gahp/api.ts";
import { BoincService } from "../gahp/boinc.ts";
import { loadGahpConfig } from "../gahp/config.ts";
import { GahpEngine } from "../gahp/server.ts";
import { type CliIo, EXIT_OK, usageError } from "../io.ts";

const USAGE = `usage: dispatch-cloud gahp [--config FILE]
  Speaks the BOINC GAHP protocol on stdin/stdout for HTCondor 9.x's gridmanager (grid_resource = boinc URL).
  FILE (default $DISPATCH_CLOUD_GAHP_CONFIG, else ~/.dispatch-cloud/gahp.yml) gives the REST server, the token
  and the apps' bundle templates; see docs/htcondor.md.`;

/** When this GAHP's protocol was last changed (the banner's date). */
const RELEASED = "Nov 26 2026";

export const GAHP_VERSION = `$GahpVersion: ${VERSION} ${RELEASED} dispatch-cloud\\ BOINC\\ GAHP $`;

/** The streams the GAHP talks through (process.stdin/stdout in production). */
export interface GahpStreams {
  input: NodeJS.ReadableStream;
  write: (text: string) => void;
}

export async function gahpCommand(io: CliIo, streams?: GahpStreams): Promise<number> {
  const { values, positionals } = parse(io.argv, {
    config: { type: "string" },
    help: { type: "boolean", short: "h" },
  });
  if (values.help === true) {
    io.out(USAGE);
    return EXIT_OK;
  }
  if (positionals.length !== 0) throw usageError(USAGE);
  const file = resolve(
    io.cwd,
    values.config ??
      io.env["DISPATCH_CLOUD_GAHP_CONFIG"] ??
      join(io.env["HOME"] ?? homedir(), ".dispatch-cloud", "gahp.yml"),
  );
  const config = await loadGahpConfig(file, io.env);
  const s: GahpStreams = streams ?? {
    input: process.stdin,
    write: (text) => {
      process.stdout.write(text);
    },
  };
  const log = (line: string) => io.err(`gahp: ${line}`);
  const limiter = new Limiter(config.httpConcurrency);
  const controller = new AbortController();
  let api = new GahpApi(config.apiUrl, config.token, limiter, controller.signal);
  const boinc = new BoincService({
    apps: config.apps,
    api: () => api,
    selectProject: (url, token) => {
      api.close();
      api = new GahpApi(url, token, limiter, controller.signal);
      // Never a secret in the log: no user or password a URL might carry.
      const shown = new URL(url);
      log(`project ${shown.origin}${shown.pathname}`);
    },
    log,
  });
  const engine = new GahpEngine({
    version: GAHP_VERSION,
    commands: boinc.commands(),
    maxPending: config.maxPendingRequests,
    maxRequestBytes: config.maxRequestBytes,
    write: s.write,
    log,
  });
  engine.signal.addEventListener("abort", () => controller.abort(engine.signal.reason));
  const shownUrl = new URL(config.apiUrl);
  log(
    `started (config ${file}, REST server ${shownUrl.origin}${shownUrl.pathname}, ${Object.keys(config.apps).length} apps)`,
  );
  engine.start();
  await new Promise<void>((done) => {
    const stop = () => {
      s.input.removeListener("data", onData);
      s.input.removeListener("end", onEnd);
      s.input.removeListener("error", onEnd);
      done();
    };
    const onData = (chunk: Buffer | string) => {
      engine.feed(typeof chunk === "string" ? Buffer.from(chunk) : chunk);
      if (engine.quit) stop();
    };
    const onEnd = () => {
      engine.end();
      stop();
    };
    s.input.on("data", onData);
    s.input.once("end", onEnd);
    s.input.once("error", onEnd);
  });
  engine.stop();
  await engine.settled();
  boinc.close();
  api.close();
  if (streams === undefined) {
    process.stdin.destroy();
  }
  log(engine.quit ? "QUIT: stopping" : "stdin closed: stopping");
  return EXIT_OK;
}
