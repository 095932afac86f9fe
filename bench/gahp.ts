/**
 * bench:gahp — what HTCondor's gridmanager waits for when it drives `dispatch-cloud gahp`. A REST server in its
 * own process (PGlite, no dispatcher: the bundles stay queued) and the GAHP as a real process; the bench speaks
 * to it as the gridmanager does (test/gahp-client.ts) and prints, for a batch of N jobs sharing one input file:
 *   - BOINC_SUBMIT: from the request to its result (hash and upload of the file once, one tree, the bundles);
 *   - the same submit again (idempotent: nothing created);
 *   - BOINC_QUERY_BATCHES of the whole batch (min_mod_time 0), and again from the returned server time;
 *   - the answer's line length (the gridmanager reads lines of at most 500 KB).
 *
 * Usage: npm run bench:gahp [-- --jobs N] [--input-size BYTES]
 */
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { loadavg, tmpdir } from "node:os";
import path from "node:path";
import { esc, GahpProcess } from "../test/gahp-client.ts";
import { benchArgs } from "./args.ts";
import { forkBenchServer, startBenchServer } from "./rest-server.ts";

const { values } = benchArgs("Usage: npm run bench:gahp [-- --jobs N] [--input-size BYTES]", {
  options: {
    jobs: { type: "string", default: "1000" },
    "input-size": { type: "string", default: String(4 * 2 ** 20) },
    serve: { type: "boolean" },
  },
});

async function serve(): Promise<void> {
  const dir = mkdtempSync(path.join(tmpdir(), "dc-bench-gahp-srv-"));
  const { db, app, url, token } = await startBenchServer({
    db: "pglite",
    dataDir: dir,
    maxRequestBodySize: 2 ** 20,
  });
  process.on("message", async (m: string) => {
    if (m === "stop") {
      await app.close();
      await db.close();
      rmSync(dir, { recursive: true, force: true });
      process.exit(0);
    }
  });
  process.send?.({ ready: { url, token } });
}

async function main(): Promise<void> {
  const jobs = Number(values.jobs);
  const dir = mkdtempSync(path.join(tmpdir(), "dc-bench-gahp-"));
  const server = await forkBenchServer(import.meta.filename, ["--serve"]);
  const input = path.join(dir, "shared input.dat");
  writeFileSync(input, randomBytes(Number(values["input-size"])));
  const config = path.join(dir, "gahp.yml");
  writeFileSync(
    config,
    [
      `apiUrl: ${server.url}`,
      "token: env:BENCH_GAHP_TOKEN",
      "apps:",
      "  bench:",
      "    image: busybox",
      '    command: ["sh", "-c", "wc -c {inputs}/*", "{args}"]',
      "",
    ].join("\n"),
  );
  const gahp = GahpProcess.start(["--config", config], { ...process.env, BENCH_GAHP_TOKEN: server.token });
  try {
    await gahp.line();
    await gahp.send("ASYNC_MODE_ON");
    const batch = `condor#bench@localhost#bench#${Math.floor(Date.now() / 1000)}`;
    let line = `${esc(batch)} bench ${jobs}`;
    for (let i = 0; i < jobs; i++) line += ` ${batch}#1.${i} 2 -n ${i} 1 ${esc(input)} input.dat`;
    line += " NULL NULL 268435456 NULL 3600 NULL";
    const timed = async (what: string, command: string, args: string): Promise<string[]> => {
      const t0 = performance.now();
      const r = await gahp.result(await gahp.request(command, args), 600_000);
      const ms = performance.now() - t0;
      if (r[1] !== "NULL") throw new Error(`${what}: ${r[1]}`);
      console.log(
        `  ${what.padEnd(38)} ${ms.toFixed(0).padStart(7)} ms  (${((jobs * 1000) / ms).toFixed(0)} jobs/s)`,
      );
      return r;
    };
    console.log(
      `bench:gahp — ${jobs} jobs sharing a ${Number(values["input-size"]) >> 20} MiB input; submit line ${(line.length / 1024).toFixed(0)} KiB; load ${loadavg()
        .map((l) => l.toFixed(2))
        .join(" ")}`,
    );
    await timed("BOINC_SUBMIT", "BOINC_SUBMIT", line);
    await timed("BOINC_SUBMIT again (idempotent)", "BOINC_SUBMIT", line);
    const q = await timed("BOINC_QUERY_BATCHES min_mod_time 0", "BOINC_QUERY_BATCHES", `0 1 ${esc(batch)}`);
    console.log(`    answer: ${q.slice(3).length} arguments, ${(q.join(" ").length / 1024).toFixed(0)} KiB`);
    await timed("BOINC_QUERY_BATCHES from server time", "BOINC_QUERY_BATCHES", `${q[2]} 1 ${esc(batch)}`);
    console.log(
      `  load after: ${loadavg()
        .map((l) => l.toFixed(2))
        .join(" ")}`,
    );
  } finally {
    await gahp.close();
    await server.stop();
    rmSync(dir, { recursive: true, force: true });
  }
}

if (values.serve === true) void serve();
else await main();
