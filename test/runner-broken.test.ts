/**
 * An instance whose runner cannot run is broken, not booting (issue: the runner deployed inside a directory
 * whose package.json says `"type": "module"` died at once, and bundles waited on booting instances for ever).
 * The whole dispatcher on FakeClock, with the local driver's real VMs (embedded SSH), deploying as crunch-run
 * a program that exits 1 with a message: the instance is shut down within a minute, `instance list` (the CLI,
 * over the management API), the bundle's status and the warn log quote the message, and the pool does not
 * replace the instance in a tight loop.
 */
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { Registry } from "prom-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../cli/cli.ts";
import type { CliIo } from "../cli/io.ts";
import { destroyLocalVms } from "../cloud-drivers/local/driver.ts";
import { createDispatcher, type Dispatcher } from "../dispatcher/main.ts";
import type { PoolEvent } from "../dispatcher/pool/pool.ts";
import { artifactOf } from "../dispatcher/runner-artifact.ts";
import { createManagementServer } from "../management-api/server.ts";
import { stageBundle } from "../store/transitions.ts";
import { createTestBundle, createTestUser, openTestDb, type TestDb } from "./db.ts";
import { FakeClock } from "./fake-clock.ts";
import { capturingLogger, configFrom, silentLogger } from "./fixtures.ts";

const MESSAGE = "crunch-run: cannot start: this artifact is broken on purpose";
const BROKEN_RUNNER = artifactOf(Buffer.from(`#!/bin/sh\necho '${MESSAGE}' >&2\nexit 1\n`));
const TOKEN = "dcm-runner-broken-test-token";

let dir: string;
let db: TestDb;
let dispatcher: Dispatcher | undefined;
let management: FastifyInstance | undefined;
let logLines: Record<string, unknown>[] = [];

beforeAll(async () => {
  dir = await mkdtemp(join(tmpdir(), "dc-runner-broken-"));
  db = await openTestDb("pglite");
});

afterAll(async () => {
  await management?.close();
  await dispatcher?.stop();
  await destroyLocalVms(join(dir, "vms"), silentLogger).catch(() => 0);
  await db?.close();
  await rm(dir, { recursive: true, force: true });
});

/** Advances FakeClock a second at a time, letting real I/O (SSH, VM processes) run in between. */
async function advance(clock: FakeClock, ms: number, until?: () => boolean): Promise<void> {
  for (let t = 0; t < ms; t += 1000) {
    await clock.advance(1000);
    // Background work may itself wait on FakeClock (the driver's rate limit): give it real time, not forever.
    await Promise.race([dispatcher?.parts?.pool.settled(), new Promise((r) => setTimeout(r, 200))]);
    await new Promise((r) => setTimeout(r, 15));
    if (until?.() === true) return;
  }
}

describe("a runner that cannot run", () => {
  it("gets its instance shut down within a minute with the runner's words, and no tight loop of creates", async () => {
    const config = configFrom(`clusterId: rbk01
dataDir: ${dir}/data
logging: {level: warn}
management: {listen: "127.0.0.1:0", token: "env:DC_TEST_MANAGEMENT_TOKEN"}
cloud:
  driver: local
  driverParameters: {stateDir: ${dir}/vms, sshServer: embedded}
  maxInstances: 5
  maxConcurrentInstanceCreateOps: 0
`);
    const clock = new FakeClock();
    const { logger, lines } = capturingLogger("warn");
    logLines = lines;
    const registry = new Registry();
    dispatcher = await createDispatcher({
      config,
      db,
      clock,
      logger,
      registry,
      runner: BROKEN_RUNNER,
      runnerApiUrl: "http://127.0.0.1:9/",
    });
    await dispatcher.start();
    const parts = dispatcher.parts;
    if (parts === null) throw new Error("the dispatcher is not active");
    const events: PoolEvent[] = [];
    parts.pool.subscribe((e) => events.push(e));
    management = await createManagementServer({
      config,
      dispatcher,
      db,
      registry,
      logger: false,
      clock,
      env: { DC_TEST_MANAGEMENT_TOKEN: TOKEN },
    });
    const url = await management.listen({ host: "127.0.0.1", port: 0 });

    const user = await createTestUser(db);
    const bundle = await createTestBundle(db, user.uuid);
    if (!(await stageBundle(db, bundle.uuid, { actor: "test" })).ok) throw new Error("stage failed");
    await dispatcher.runOnce();
    const creates = () =>
      events.filter((e) => e.type === "worker:created" && e.workerId.startsWith("creating-"));
    expect(creates()).toHaveLength(1);
    const firstCreateAt = clock.now();

    // Shut down within a minute of fake time.
    const shutDown = () =>
      parts.pool.workers().find((w) => !w.placeholder && w.state === "shutdown") ??
      events.find((e) => e.type === "worker:state" && e.state === "shutdown");
    await advance(clock, 60_000, () => shutDown() !== undefined);
    const gone = shutDown();
    expect(gone, "no instance was shut down within a minute").toBeDefined();
    expect(clock.now() - firstCreateAt).toBeLessThanOrEqual(60_000);

    // The log says so at warn level, quoting the runner.
    const warned = logLines.filter((l) => l["level"] === 40 && String(l["reason"] ?? "").includes(MESSAGE));
    expect(warned.map((l) => l["msg"])).toContain("the runner cannot run on this instance");

    // instance list (the CLI, over the management API) quotes it.
    const out: string[] = [];
    const io: CliIo = {
      argv: ["instance", "list", "--management-url", url],
      env: { DISPATCH_CLOUD_MANAGEMENT_TOKEN: TOKEN },
      cwd: dir,
      out: (l) => out.push(l),
      err: (l) => out.push(l),
      progress: () => {},
    };
    expect(await runCli(io)).toBe(0);
    expect(out.join("\n")).toContain(`the runner cannot run: crunch-run --version exited 1: "${MESSAGE}"`);

    // The bundle's status says why it waits.
    await dispatcher.runOnce();
    const status = parts.scheduler.statusOf(bundle.uuid) ?? "";
    expect(status).toContain("the runner could not run on the last new instance");
    expect(status).toContain(MESSAGE);
    const queue = await management.inject({
      url: "/management/v1/bundles",
      headers: { authorization: `Bearer ${TOKEN}` },
    });
    expect(JSON.stringify(queue.json())).toContain(MESSAGE);

    // Five more minutes: new instances are tried after a growing wait, never one after another.
    await advance(clock, 5 * 60_000);
    expect(creates().length).toBeGreaterThanOrEqual(2);
    expect(creates().length).toBeLessThanOrEqual(3);
    expect(parts.pool.workers().filter((w) => w.state === "idle" || w.state === "running")).toEqual([]);
  }, 120_000);
});
