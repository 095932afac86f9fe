/**
 * The benches' REST server: a store (PGlite or PostgreSQL, test/db.ts), one ordinary user with a fresh token,
 * and the server listening on a loopback port. The caller closes `app` and `db`.
 */
import { type ChildProcess, fork } from "node:child_process";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createUser } from "../store/queries.ts";
import type { Bundle } from "../store/types.ts";
import { openTestDb, type TestDb } from "../test/db.ts";

export interface BenchServer {
  db: TestDb;
  app: Awaited<ReturnType<typeof createRestServer>>;
  url: string;
  /** The bench user's bearer token. */
  token: string;
}

export async function startBenchServer(opts: {
  db: "pg" | "pglite";
  dataDir: string;
  maxRequestBodySize: number;
  /** As `serve` passes new bundles to its dispatcher's queue (RestServerOptions.onBundlesWritten). */
  onBundlesWritten?: (bundles: readonly Bundle[]) => void;
}): Promise<BenchServer> {
  const db = await openTestDb(opts.db);
  const token = newUserToken();
  await createUser(db, {
    uuid: newUserUuid("bench"),
    name: "bench",
    isAdmin: false,
    tokenHash: hashToken(token),
  });
  const app = await createRestServer({
    db,
    logger: false,
    clusterId: "bench",
    maxRequestBodySize: opts.maxRequestBodySize,
    defaultMaxAttempts: 3,
    dataDir: opts.dataDir,
    ...(opts.onBundlesWritten === undefined ? {} : { onBundlesWritten: opts.onBundlesWritten }),
  });
  const url = await app.listen({ host: "127.0.0.1", port: 0 });
  return { db, app, url, token };
}

/**
 * A bench server in a process of its own (so the clients' work is not counted against it, nor its work against
 * theirs): forks `file` (the bench, which calls startBenchServer when it sees `serveArgs`) and waits for its
 * `{ ready: { url, token } }` message. `stop()` sends "stop" and waits for the exit.
 * BENCH_SERVER_CPU_PROF=DIR writes a CPU profile of the server process to DIR.
 */
export async function forkBenchServer(
  file: string,
  serveArgs: string[],
): Promise<{ child: ChildProcess; url: string; token: string; stop(): Promise<void> }> {
  const cpuProf = process.env["BENCH_SERVER_CPU_PROF"];
  const child = fork(file, serveArgs, {
    execArgv: [
      // As bin/dispatch-cloud starts the REST server (docs/operations.md, "The REST server's heap").
      "--initial-old-space-size=128",
      "--import",
      "tsx",
      ...(cpuProf === undefined ? [] : ["--cpu-prof", `--cpu-prof-dir=${cpuProf}`]),
    ],
    stdio: ["ignore", "inherit", "inherit", "ipc"],
  });
  const { url, token } = await new Promise<{ url: string; token: string }>((resolve, reject) => {
    child.once("exit", (code) => reject(new Error(`the bench's server process exited (${code})`)));
    child.on("message", (m: { ready?: { url: string; token: string } }) => {
      if (m.ready !== undefined) resolve(m.ready);
    });
  });
  const stop = async () => {
    if (child.exitCode !== null) return;
    const exited = new Promise((r) => child.once("exit", r));
    child.send("stop");
    await exited;
  };
  return { child, url, token, stop };
}
