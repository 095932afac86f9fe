/**
 * Warms a spare supervisor's hand-off path before it says it is ready (spare.ts, issue 21).
 *
 * A spare is a fresh process, and the first time it runs the code between a hand-off and its runner `start`
 * call (taking a lock file, making the bundle's logger, Node's HTTP client and its first connection, our runner
 * client, the retry loop, reading a JSON answer) costs milliseconds of one-time set-up: lazily loaded Node
 * internals, the libuv thread pool, V8 compiling each function on its first call, pino compiling its redaction.
 * Measured step by step on a 2-core machine, that was about 20 ms of a 35-44 ms submit -> start
 * (docs/performance.md). So a spare goes through the same steps once with nothing at stake: a lock in a
 * directory of its own (never the instance's lock directory, which `--list` reads), a logger that writes
 * nowhere, and a `start` call to a loopback HTTP server it runs itself for the purpose. Nothing here may stop a
 * spare: a failure is ignored (the real hand-off then pays the set-up, as before).
 */
import { mkdtempSync, rmSync } from "node:fs";
import http from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { Writable } from "node:stream";
import { createLogger } from "../lib/logger.ts";
import { createRunnerClient } from "./api-client.ts";
import { procStartTime, readLockText, releaseLock, tryCreateLock } from "./lock.ts";

/** The uuid the warm-up uses; it names no bundle (the cluster prefix `warm0` is not one we issue). */
const WARM_UUID = "warm0-bndl-000000000000000";

export async function warmUpSpare(): Promise<void> {
  const server = http.createServer((req, res) => {
    req.resume();
    req.on("end", () => {
      res.writeHead(200, { "content-type": "application/json" });
      res.end(JSON.stringify({ uuid: WARM_UUID, state: "running", attempt: 1 }));
    });
  });
  let dir: string | null = null;
  try {
    dir = mkdtempSync(path.join(tmpdir(), "crunch-run-warm-"));
    const file = path.join(dir, `crunch-run-${WARM_UUID}.lock`);
    const self = { uuid: WARM_UUID, pid: process.pid, startTime: procStartTime(process.pid) ?? "" };
    if (tryCreateLock(file, self)) {
      await readLockText(file);
      await releaseLock(file, process.pid);
    }
    await new Promise<void>((resolve, reject) => {
      server.once("error", reject);
      server.listen(0, "127.0.0.1", resolve);
    });
    const { port } = server.address() as AddressInfo;
    const client = createRunnerClient({ apiUrl: `http://127.0.0.1:${port}`, token: "warm-up" });
    await client.start({ budgetMs: 0 });
    // The supervisor's log (pino compiles its redaction each time a logger is made).
    const discard = new Writable({ write: (_chunk, _enc, done) => done() });
    createLogger({ level: "info", format: "json", destination: discard }).info("warm-up");
  } catch {
    // Only a warm-up: the hand-off works without it.
  } finally {
    server.closeAllConnections();
    await new Promise((resolve) => server.close(resolve));
    if (dir !== null) rmSync(dir, { recursive: true, force: true });
  }
}
