/**
 * bench:submit — how fast users can hand the system work. For PostgreSQL and for PGlite, a server process (the
 * REST server, the bundle manager and the dispatcher's queue, on a fresh migrated database) takes:
 *   1. bundles one at a time (`POST /api/v1/bundles`) from 32 clients over keep-alive connections;
 *   2. bundles in batches of 1,000 (`POST /api/v1/bundles/batch`) from 4 clients, each answered whole;
 *   3. the same with `Prefer: return=minimal` (each bundle answered by its uuid and state, as `submit --batch`
 *      asks).
 * For each phase it prints bundles accepted per second (first request sent to last answer) and how long after
 * the last answer the dispatcher's queue held all of them (staged by the bundle manager, read by the queue).
 *
 * --history N first fills the store with N finished bundles of the same user (each with the five events of a
 * bundle that ran, as a cluster that has been running a while holds them; nothing deletes a bundle row), and
 * prints how long the queue took to load and the table's size on disk: a cluster's submissions go on beside
 * its whole history.
 *
 * Usage: npm run bench:submit [-- --single N] [--batched N] [--db pg,pglite] [--history N]
 * PostgreSQL: DISPATCH_CLOUD_TEST_PG_URL (scripts/test-services.sh starts one and prints it).
 */
import type { ChildProcess } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import http from "node:http";
import { tmpdir } from "node:os";
import path from "node:path";
import { pino } from "pino";
import { type BundleQueue, createBundleQueue } from "../dispatcher/queue/queue.ts";
import { systemClock } from "../lib/clock.ts";
import { createBundleManager } from "../rest-server/bundle-manager.ts";
import { parseBundleRequest } from "../rest-server/bundle-request.ts";
import { insertBundles } from "../store/queries.ts";
import type { openTestDb } from "../test/db.ts";
import { benchArgs } from "./args.ts";
import { forkBenchServer, startBenchServer } from "./rest-server.ts";

const USAGE = "Usage: npm run bench:submit [-- --single N] [--batched N] [--db pg,pglite] [--history N]";
const { values } = benchArgs(USAGE, {
  options: {
    single: { type: "string", default: "20000" },
    batched: { type: "string", default: "100000" },
    db: { type: "string", default: "pg,pglite" },
    history: { type: "string", default: "0" },
    serve: { type: "string" },
  },
});
const HISTORY = Number(values.history);
if (!Number.isInteger(HISTORY) || HISTORY < 0) throw new Error(`--history is a count of bundles\n${USAGE}`);

type ToParent =
  | { ready: { url: string; token: string } }
  | { history: { writeMs: number; queueLoadMs: number; tableMiB: number | null } }
  | { size: number; at: number }
  | { cpu: { serverMs: number; dbMs: number | null } };

/**
 * CPU used so far by this server process and, on PostgreSQL, by its database connections (their processes'
 * /proc times; null when they cannot be read, e.g. a server on another machine). Figures that hold however
 * busy the machine is, unlike the rates.
 */
async function cpuSoFar(
  db: Awaited<ReturnType<typeof openTestDb>>,
): Promise<{ serverMs: number; dbMs: number | null }> {
  const u = process.cpuUsage();
  const serverMs = (u.user + u.system) / 1000;
  if (db.kind !== "pg") return { serverMs, dbMs: null };
  const { rows } = await db.query<{ pid: number }>(
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
  );
  let ticks = 0;
  try {
    for (const { pid } of rows) {
      const f = readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1]?.split(" ") ?? [];
      ticks += Number(f[11]) + Number(f[12]);
    }
  } catch {
    return { serverMs, dbMs: null };
  }
  return { serverMs, dbMs: ticks * 10 };
}

/** The server side, in its own process so the clients' work is not counted against it. */
async function serve(kind: "pg" | "pglite"): Promise<void> {
  const logger = pino({ level: "silent" });
  const dir = mkdtempSync(path.join(tmpdir(), "dc-bench-submit-"));
  // As in `serve`, the queue is told of new bundles by the REST server as well as by their NOTIFY.
  let queue: BundleQueue | null = null;
  const { db, app, url, token } = await startBenchServer({
    db: kind,
    dataDir: dir,
    maxRequestBodySize: 2 ** 20,
    onBundlesWritten: (bundles) => queue?.applyAll(bundles),
  });
  const send = (m: ToParent) => process.send?.(m);
  const writeMs = HISTORY > 0 ? await writeHistory(db, HISTORY) : 0;
  const manager = createBundleManager({ db, logger, pollInterval: 10_000, batchSize: 5000 });
  queue = createBundleQueue({ db, clock: systemClock, logger, pollInterval: 1000 });
  await manager.start();
  const q0 = performance.now();
  await queue.start();
  const history = { writeMs, queueLoadMs: performance.now() - q0, tableMiB: await tableMiB(db) };
  process.on("message", async (m: string) => {
    if (m === "size") send({ size: queue.size, at: Date.now() });
    if (m === "cpu") send({ cpu: await cpuSoFar(db) });
    if (m === "history") send({ history });
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

/** Rows per statement of writeHistory. */
const HISTORY_CHUNK = 50_000;

/**
 * Writes `n` finished bundles of the bench user straight to the store (not through the API, which is what is
 * measured afterwards): copies of one bundle submitted the usual way, each `ready` after one attempt with the
 * events of its way there, under uuids as random as the API's. Returns the time taken.
 */
async function writeHistory(db: Awaited<ReturnType<typeof openTestDb>>, n: number): Promise<number> {
  const t0 = performance.now();
  const { rows: users } = await db.query<{ uuid: string }>("SELECT uuid FROM users WHERE name = 'bench'");
  const owner = users[0]?.uuid;
  if (owner === undefined) throw new Error("the bench user is missing");
  const [template] = await insertBundles(
    db,
    owner,
    [
      {
        uuid: "bench-bndl-historytemplate",
        bundle: parseBundleRequest(item(0), owner, 3, { ram: 0, vcpus: 0 }),
      },
    ],
    "submitted",
  );
  if (template === undefined) throw new Error("the history's template bundle was not written");
  // Every column of the template but those each row of the history sets itself (change_seq: the insert trigger).
  const { rows: cols } = await db.query<{ name: string }>(
    "SELECT column_name AS name FROM information_schema.columns WHERE table_name = 'bundles' AND table_schema = current_schema()",
  );
  const own: Record<string, string> = {
    uuid: "'bench-bndl-' || substr(md5(g::text || $3), 1, 15)",
    name: "'h' || g",
    state: "'ready'",
    attempt: "1",
    exit_code: "0",
    instance_type: "'bench'",
    created_at: "t - interval '40 ms'",
    staged_at: "t - interval '40 ms'",
    starting_at: "t - interval '30 ms'",
    running_at: "t - interval '20 ms'",
    finished_at: "t",
    updated_at: "t",
  };
  const copied = cols.map((c) => c.name).filter((c) => c !== "change_seq");
  const salt = String(Date.now());
  for (let from = 0; from < n; from += HISTORY_CHUNK) {
    const to = Math.min(n, from + HISTORY_CHUNK) - 1;
    // One bundle a second, ending now, so the newest are the last written (as the owner's list pages them).
    await db.query(
      `WITH h AS (
         INSERT INTO bundles (${copied.join(", ")})
         SELECT ${copied.map((c) => own[c] ?? `tpl.${c}`).join(", ")}
         FROM bundles tpl, generate_series($1::int, $2::int) g,
           LATERAL (SELECT now() - ($4::int - g) * interval '1 second' AS t) ts
         WHERE tpl.uuid = 'bench-bndl-historytemplate'
         RETURNING uuid, created_at, finished_at
       )
       INSERT INTO bundle_events (bundle_uuid, from_state, to_state, attempt, actor, created_at)
       SELECT h.uuid, v.f, v.t, 1, 'bench', h.created_at
       FROM h CROSS JOIN (VALUES (NULL, 'created'), ('created', 'staged'), ('staged', 'starting'),
         ('starting', 'running'), ('running', 'ready')) AS v(f, t)`,
      [from, to, salt, n],
    );
    process.stderr.write(`bench:submit: history: ${to + 1}/${n} finished bundles written\n`);
  }
  // The template is no bundle of the history: it goes back to the queue's view as a finished one too.
  await db.query(
    "UPDATE bundles SET state = 'ready', attempt = 1, exit_code = 0, finished_at = now() WHERE uuid = 'bench-bndl-historytemplate'",
  );
  await db.query("ANALYZE bundles; ANALYZE bundle_events");
  const took = performance.now() - t0;
  // A history is old: the queue's first read after its load takes again every row written within twice its
  // watermarkDelay (2 s) before it (queue.ts), which a cluster's history is not.
  await new Promise((r) => setTimeout(r, 4_500));
  return took;
}

/** The bundles and bundle_events tables with their indexes, in MiB (null on PGlite, where it is not asked). */
async function tableMiB(db: Awaited<ReturnType<typeof openTestDb>>): Promise<number | null> {
  if (db.kind !== "pg") return null;
  const { rows } = await db.query<{ bytes: string }>(
    "SELECT pg_total_relation_size('bundles') + pg_total_relation_size('bundle_events') AS bytes",
  );
  return Number(rows[0]?.bytes ?? 0) / 2 ** 20;
}

/** Sends `message` to the server process and resolves with the first answer `pick` takes. */
function askChild<T>(child: ChildProcess, message: string, pick: (m: ToParent) => T | undefined): Promise<T> {
  return new Promise((resolve) => {
    const on = (m: ToParent) => {
      const got = pick(m);
      if (got === undefined) return;
      child.off("message", on);
      resolve(got);
    };
    child.on("message", on);
    child.send(message);
  });
}

const ask = (child: ChildProcess) => askChild(child, "size", (m) => ("size" in m ? m : undefined));
const askCpu = (child: ChildProcess) => askChild(child, "cpu", (m) => ("cpu" in m ? m.cpu : undefined));
const askHistory = (child: ChildProcess) =>
  askChild(child, "history", (m) => ("history" in m ? m.history : undefined));

const item = (i: number) => ({ command: ["true"], image: "busybox", name: `b${i}` });

/** `clients` loops, each sending its share of `total` bundles, `per` at a time; returns the time taken. */
async function submit(
  url: string,
  token: string,
  total: number,
  per: number,
  clients: number,
  minimal: boolean,
): Promise<number> {
  const headers = {
    authorization: `Bearer ${token}`,
    "content-type": "application/json",
    ...(minimal ? { prefer: "return=minimal" } : {}),
  };
  // node:http with a keep-alive agent: fetch costs the client about 1.5 ms of CPU a request here, which on a
  // 2-core machine is taken from the server being measured.
  const agent = new http.Agent({ keepAlive: true, maxSockets: clients });
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
        const res = await post(agent, `${url}/api/v1/bundles${per === 1 ? "" : "/batch"}`, headers, body);
        if (res.status !== 201) throw new Error(`HTTP ${res.status}: ${res.body.slice(0, 300)}`);
      }
    }),
  );
  const took = performance.now() - t0;
  agent.destroy();
  return took;
}

/** One POST over `agent`; resolves with the status and body text. */
function post(
  agent: http.Agent,
  url: string,
  headers: Record<string, string>,
  body: string,
): Promise<{ status: number; body: string }> {
  return new Promise((resolve, reject) => {
    const req = http.request(url, { method: "POST", agent, headers }, (res) => {
      const chunks: Buffer[] = [];
      res.on("data", (c: Buffer) => chunks.push(c));
      res.on("end", () => resolve({ status: res.statusCode ?? 0, body: Buffer.concat(chunks).toString() }));
      res.on("error", reject);
    });
    req.on("error", reject);
    req.end(body);
  });
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
  // BENCH_SERVER_CPU_PROF=DIR: a CPU profile of the server process, written to DIR.
  const server = await forkBenchServer(import.meta.filename, ["--serve", kind, "--history", String(HISTORY)]);
  const { child, url, token } = server;
  try {
    if (HISTORY > 0) {
      const h = await askHistory(child);
      console.log(
        `${kind.padEnd(6)} history: ${HISTORY} finished bundles (5 events each) written in ${(h.writeMs / 1000).toFixed(1)} s` +
          `${h.tableMiB === null ? "" : `, ${Math.round(h.tableMiB)} MiB with their events and indexes`}; ` +
          `the queue loaded in ${h.queueLoadMs.toFixed(0)} ms`,
      );
    }
    let inQueue = 0;
    const phases: [string, number, number, number, boolean][] = [
      ["one at a time, 32 clients", Number(values.single), 1, 32, false],
      ["batches of 1,000, 4 clients", Number(values.batched), 1000, 4, false],
      ["same, return=minimal", Number(values.batched), 1000, 4, true],
    ];
    for (const [name, total, per, clients, minimal] of phases) {
      process.stderr.write(`bench:submit [${kind}] ${name}: ${total} bundles...\n`);
      if (total === 0) continue;
      const cpu0 = await askCpu(child);
      const ms = await submit(url, token, total, per, clients, minimal);
      const lastAnswer = Date.now();
      inQueue += total;
      const lag = await queueCaughtUp(child, inQueue, lastAnswer);
      const cpu1 = await askCpu(child);
      const perBundle = (a: number | null, b: number | null) =>
        a === null || b === null ? "n/a" : `${((b - a) / total).toFixed(3)} ms`;
      console.log(
        `${kind.padEnd(6)} ${name.padEnd(28)} ${String(total).padStart(7)} bundles in ${(ms / 1000).toFixed(2)} s: ` +
          `${Math.round((total * 1000) / ms)
            .toString()
            .padStart(6)}/s; queue held all ${lag} ms after the last answer; CPU per bundle: server ` +
          `${perBundle(cpu0.serverMs, cpu1.serverMs)}, PostgreSQL ${perBundle(cpu0.dbMs, cpu1.dbMs)}`,
      );
    }
  } finally {
    await server.stop();
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
