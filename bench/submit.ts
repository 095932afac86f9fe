/**
 * bench:submit — how fast users can hand the system work. For PostgreSQL and for PGlite, a server process (the
 * REST server, the bundle manager and the dispatcher's queue, on a fresh migrated database) takes:
 *   1. bundles one at a time (`POST /api/v1/bundles`) from 32 clients over keep-alive connections;
 *   2. bundles in batches of 1,000 (`POST /api/v1/bundles/batch`) from 4 clients.
 * For each phase it prints bundles accepted per second (first request sent to last answer) and how long after
 * the last answer the dispatcher's queue held all of them (staged by the bundle manager, read by the queue).
 *
 * Usage: npm run bench:submit [-- --single N] [--batched N] [--db pg,pglite]
 * PostgreSQL: DISPATCH_CLOUD_TEST_PG_URL (scripts/test-services.sh starts one and prints it).
 */
import { type ChildProcess, fork } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { parseArgs } from "node:util";
import { pino } from "pino";
import { createBundleQueue } from "../dispatcher/queue/queue.ts";
import { systemClock } from "../lib/clock.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createBundleManager } from "../rest-server/bundle-manager.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createUser } from "../store/queries.ts";
import { openTestDb } from "../test/db.ts";

const { values } = parseArgs({
  options: {
    single: { type: "string", default: "20000" },
    batched: { type: "string", default: "100000" },
    db: { type: "string", default: "pg,pglite" },
    serve: { type: "string" },
  },
});

type ToParent = { ready: { url: string; token: string } } | { size: number; at: number };

/** The server side, in its own process so the clients' work is not counted against it. */
async function serve(kind: "pg" | "pglite"): Promise<void> {
  const logger = pino({ level: "silent" });
  const db = await openTestDb(kind);
  const dir = mkdtempSync(path.join(tmpdir(), "dc-bench-submit-"));
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
    maxRequestBodySize: 2 ** 20,
    defaultMaxAttempts: 3,
    dataDir: dir,
  });
  const manager = createBundleManager({ db, logger, pollInterval: 10_000, batchSize: 5000 });
  const queue = createBundleQueue({ db, clock: systemClock, logger, pollInterval: 1000 });
  await manager.start();
  await queue.start();
  const url = await app.listen({ host: "127.0.0.1", port: 0 });
  const send = (m: ToParent) => process.send?.(m);
  process.on("message", async (m: string) => {
    if (m === "size") send({ size: queue.size, at: Date.now() });
    if (m === "stop") {
      await app.close();
      await queue.stop();
      await manager.stop();
      await db.close();
      rmSync(dir, { recursive: true, force: true });
      process.exit(0);
    }
  });
  send({ ready: { url, token } });
}

function ask(child: ChildProcess): Promise<{ size: number; at: number }> {
  return new Promise((resolve) => {
    const on = (m: ToParent) => {
      if ("size" in m) {
        child.off("message", on);
        resolve(m);
      }
    };
    child.on("message", on);
    child.send("size");
  });
}

const item = (i: number) => ({ command: ["true"], image: "busybox", name: `b${i}` });

/** `clients` loops, each sending its share of `total` bundles, `per` at a time; returns the time taken. */
async function submit(
  url: string,
  token: string,
  total: number,
  per: number,
  clients: number,
): Promise<number> {
  const headers = { authorization: `Bearer ${token}`, "content-type": "application/json" };
  let next = 0;
  const t0 = performance.now();
  await Promise.all(
    Array.from({ length: clients }, async () => {
      for (;;) {
        const from = next;
        if (from >= total) return;
        const n = Math.min(per, total - from);
        next += n;
        const body =
          per === 1
            ? JSON.stringify(item(from))
            : JSON.stringify({ items: Array.from({ length: n }, (_, i) => item(from + i)) });
        const res = await fetch(`${url}/api/v1/bundles${per === 1 ? "" : "/batch"}`, {
          method: "POST",
          headers,
          body,
        });
        if (res.status !== 201) throw new Error(`HTTP ${res.status}: ${(await res.text()).slice(0, 300)}`);
        await res.arrayBuffer();
      }
    }),
  );
  return performance.now() - t0;
}

/** Milliseconds from `since` until the queue holds `want` bundles (polled every 20 ms). */
async function queueCaughtUp(child: ChildProcess, want: number, since: number): Promise<number> {
  for (;;) {
    const { size, at } = await ask(child);
    if (size >= want) return at - since;
    if (Date.now() - since > 120_000) throw new Error(`queue holds ${size} of ${want} after 120 s`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

async function bench(kind: "pg" | "pglite"): Promise<void> {
  const child = fork(import.meta.filename, ["--serve", kind], {
    execArgv: ["--import", "tsx"],
    stdio: ["ignore", "inherit", "inherit", "ipc"],
  });
  const { url, token } = await new Promise<{ url: string; token: string }>((resolve, reject) => {
    child.once("exit", (code) => reject(new Error(`server process exited (${code})`)));
    child.on("message", (m: ToParent) => {
      if ("ready" in m) resolve(m.ready);
    });
  });
  try {
    let inQueue = 0;
    const phases: [string, number, number, number][] = [
      ["one at a time, 32 clients", Number(values.single), 1, 32],
      ["batches of 1,000, 4 clients", Number(values.batched), 1000, 4],
    ];
    for (const [name, total, per, clients] of phases) {
      process.stderr.write(`bench:submit [${kind}] ${name}: ${total} bundles...\n`);
      const ms = await submit(url, token, total, per, clients);
      const lastAnswer = Date.now();
      inQueue += total;
      const lag = await queueCaughtUp(child, inQueue, lastAnswer);
      console.log(
        `${kind.padEnd(6)} ${name.padEnd(28)} ${String(total).padStart(7)} bundles in ${(ms / 1000).toFixed(2)} s: ` +
          `${Math.round((total * 1000) / ms)
            .toString()
            .padStart(6)}/s; queue held all ${lag} ms after the last answer`,
      );
    }
  } finally {
    child.send("stop");
    await new Promise((r) => child.once("exit", r));
  }
}

if (values.serve !== undefined) {
  await serve(values.serve === "pg" ? "pg" : "pglite");
} else {
  console.log(`bench:submit on ${(await import("node:os")).cpus().length} cores, Node ${process.version}`);
  for (const kind of values.db.split(",")) {
    if (kind !== "pg" && kind !== "pglite") throw new Error(`--db takes pg and/or pglite, not ${kind}`);
    await bench(kind);
  }
}
