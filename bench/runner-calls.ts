/**
 * bench:runner-calls — how many of the runners' two frequent calls the REST server answers per second: the
 * heartbeat (every running bundle's, every heartbeatIntervalMs: 5 s unless the start document says otherwise)
 * and a log chunk (a bundle's output, flushed every 250 ms while it comes). These rates bound how many bundles one
 * server keeps running. For each database, a server process (the REST server on a fresh migrated database holding
 * --bundles bundles, --running of them running, each with its own runner token) takes, from 32 clients over
 * keep-alive connections, each client cycling through its own share of the tokens: heartbeats, then 1 KiB stdout
 * chunks (each at its stream's next offset), each for --rounds rounds of --seconds. It prints each round's rate
 * and how many running bundles the heartbeats' best round carries at the 5 s interval.
 *
 * Usage: npm run bench:runner-calls [-- --db pg,pglite] [--running N] [--bundles N] [--seconds S] [--rounds R]
 * PostgreSQL: DISPATCH_CLOUD_TEST_PG_URL (scripts/test-services.sh starts one and prints it).
 */
import type { ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import http from "node:http";
import { availableParallelism, cpus, tmpdir, totalmem } from "node:os";
import path from "node:path";
import { hashToken, newRunnerToken } from "../lib/tokens.ts";
import { insertBundles } from "../store/queries.ts";
import { markRunningByTokens, startBundles } from "../store/transitions.ts";
import { testBundleUuid, testNewBundle } from "../test/db.ts";
import { benchArgs } from "./args.ts";
import { forkBenchServer, startBenchServer } from "./rest-server.ts";

const USAGE =
  "Usage: npm run bench:runner-calls [-- --db pg,pglite] [--running N] [--bundles N] [--seconds S] [--rounds R]";
const { values } = benchArgs(USAGE, {
  options: {
    db: { type: "string", default: "pg,pglite" },
    running: { type: "string", default: "2000" },
    bundles: { type: "string", default: "50000" },
    seconds: { type: "string", default: "4" },
    rounds: { type: "string", default: "3" },
    serve: { type: "string" },
  },
});

const CLIENTS = 32;
const DEFAULT_INTERVAL_S = 5;
/** Bundles per insert statement while the database is filled. */
const FILL_BATCH = 1000;

const count = (name: string, v: string | undefined, min: number): number => {
  const n = Number(v);
  if (!Number.isInteger(n) || n < min) {
    process.stderr.write(`--${name} must be a whole number >= ${min}\n${USAGE}\n`);
    process.exit(2);
  }
  return n;
};
const RUNNING = count("running", values.running, 1);
const BUNDLES = Math.max(RUNNING, count("bundles", values.bundles, 1));
const SECONDS = count("seconds", values.seconds, 1);
const ROUNDS = count("rounds", values.rounds, 1);

type ToParent = { ready: { url: string; token: string } } | { tokens: string[] };

/** The server side, in its own process: fills the database, makes RUNNING bundles running. */
async function serve(kind: "pg" | "pglite"): Promise<void> {
  const dir = mkdtempSync(path.join(tmpdir(), "dc-bench-runner-calls-"));
  const { db, app, url, token } = await startBenchServer({
    db: kind,
    dataDir: dir,
    maxRequestBodySize: 2 ** 20,
  });
  const { rows } = await db.query<{ uuid: string }>("SELECT uuid FROM users LIMIT 1");
  const owner = rows[0]?.uuid;
  if (owner === undefined) throw new Error("the bench server made no user");
  const tokens: string[] = [];
  for (let done = 0; done < BUNDLES; done += FILL_BATCH) {
    const n = Math.min(FILL_BATCH, BUNDLES - done);
    const items = Array.from({ length: n }, () => ({ uuid: testBundleUuid(), bundle: testNewBundle(owner) }));
    // The first RUNNING are submitted (staged: no dependencies), the rest stay created.
    const run = Math.max(0, Math.min(n, RUNNING - done));
    if (run > 0) await insertBundles(db, owner, items.slice(0, run), "submitted");
    if (run < n) await insertBundles(db, owner, items.slice(run), "created");
    const mine = items.slice(0, run).map((i) => ({ uuid: i.uuid, token: newRunnerToken() }));
    const started = await startBundles(
      db,
      mine.map((m) => ({
        uuid: m.uuid,
        instanceId: "i-bench",
        instanceType: "bench",
        runnerTokenHash: hashToken(m.token),
        gpuDevices: [],
      })),
      "bench",
    );
    const hashes = mine.map((m) => hashToken(m.token));
    const running = await markRunningByTokens(db, hashes, "bench");
    if (started.size !== mine.length || running.size !== mine.length)
      throw new Error(`of ${mine.length} bundles, ${started.size} started and ${running.size} running`);
    tokens.push(...mine.map((m) => m.token));
  }
  const send = (m: ToParent) => process.send?.(m);
  process.on("message", async (m: string) => {
    if (m === "tokens") send({ tokens });
    if (m === "stop") {
      await app.close();
      await db.close();
      rmSync(dir, { recursive: true, force: true });
      process.exit(0);
    }
  });
  send({ ready: { url, token } });
}

function askTokens(child: ChildProcess): Promise<string[]> {
  return new Promise((resolve) => {
    const on = (m: ToParent) => {
      if ("tokens" in m) {
        child.off("message", on);
        resolve(m.tokens);
      }
    };
    child.on("message", on);
    child.send("tokens");
  });
}

/** One call; any answer but 200 stops the bench. */
function post(url: URL, agent: http.Agent, path: string, token: string, type: string, body: Buffer | string) {
  return new Promise<void>((resolve, reject) => {
    const req = http.request(
      {
        host: url.hostname,
        port: url.port,
        path,
        method: "POST",
        agent,
        headers: { authorization: `Bearer ${token}`, "content-type": type },
      },
      (res) => {
        res.resume();
        res.on("end", () =>
          res.statusCode === 200 ? resolve() : reject(new Error(`${path} was answered ${res.statusCode}`)),
        );
      },
    );
    req.on("error", reject);
    req.end(body);
  });
}

const HEARTBEAT = JSON.stringify({
  resourceUsage: { cpuSeconds: 1.5, memoryBytes: 2 ** 27, maxMemoryBytes: 2 ** 28 },
});
const CHUNK = Buffer.alloc(1024, "log line\n");

/**
 * Calls from CLIENTS clients for `ms`, client c cycling through tokens c, c + CLIENTS, ... (so a token's log
 * stream has one writer); the rate per second.
 */
async function round(tokens: string[], ms: number, call: (token: string) => Promise<void>): Promise<number> {
  let n = 0;
  const t0 = performance.now();
  const until = t0 + ms;
  await Promise.all(
    Array.from({ length: CLIENTS }, async (_, c) => {
      const mine = tokens.filter((_, i) => i % CLIENTS === c);
      for (let i = 0; mine.length > 0 && performance.now() < until; i++) {
        await call(mine[i % mine.length] as string);
        n++;
      }
    }),
  );
  return n / ((performance.now() - t0) / 1000);
}

async function main(): Promise<void> {
  const kinds = (values.db as string).split(",");
  for (const k of kinds)
    if (k !== "pg" && k !== "pglite") throw new Error(`--db: ${k} is neither pg nor pglite`);
  console.log(
    `bench:runner-calls: ${availableParallelism()} CPUs (${cpus()[0]?.model ?? "?"}), ${(totalmem() / 2 ** 30).toFixed(0)} GiB; ${BUNDLES} bundles, ${RUNNING} running; ${CLIENTS} clients, keep-alive`,
  );
  for (const kind of kinds) {
    process.stderr.write(`bench:runner-calls [${kind}]: filling the database...\n`);
    const server = await forkBenchServer(import.meta.filename, ["--serve", kind]);
    const agent = new http.Agent({ keepAlive: true, maxSockets: CLIENTS });
    try {
      const tokens = await askTokens(server.child);
      const url = new URL(server.url);
      const offsets = new Map<string, number>();
      const phases: [string, (token: string) => Promise<void>][] = [
        ["heartbeats", (t) => post(url, agent, "/api/v1/runner/heartbeat", t, "application/json", HEARTBEAT)],
        [
          "log chunks of 1 KiB",
          async (t) => {
            const at = offsets.get(t) ?? 0;
            const path = `/api/v1/runner/logs?stream=stdout&offset=${at}`;
            await post(url, agent, path, t, "application/octet-stream", CHUNK);
            offsets.set(t, at + CHUNK.length);
          },
        ],
      ];
      const db = kind === "pg" ? "PostgreSQL" : "PGlite";
      for (const [name, call] of phases) {
        const rates: number[] = [];
        // One untimed second first: connections opened, statements prepared.
        await round(tokens, 1000, call);
        for (let r = 0; r < ROUNDS; r++) {
          process.stderr.write(`bench:runner-calls [${kind}] ${name}: round ${r + 1}/${ROUNDS}...\n`);
          rates.push(await round(tokens, SECONDS * 1000, call));
        }
        const carries =
          name === "heartbeats"
            ? `; at ${DEFAULT_INTERVAL_S} s a heartbeat, the best round carries ${(Math.max(...rates) * DEFAULT_INTERVAL_S).toFixed(0)} running bundles`
            : "";
        console.log(
          `  ${db}, ${name}: ${rates.map((x) => `${x.toFixed(0)}/s`).join(", ")} (${SECONDS} s rounds)${carries}`,
        );
      }
    } finally {
      agent.destroy();
      await server.stop();
    }
  }
}

if (values.serve !== undefined) {
  const kind = values.serve;
  if (kind !== "pg" && kind !== "pglite") throw new Error(`--serve: ${kind} is neither pg nor pglite`);
  await serve(kind);
} else await main();
