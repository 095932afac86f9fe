/**
 * For the crunch-run tests: an in-process REST server (createRestServer on a test database) listening on a
 * loopback port, bundles taken straight to `starting` with a fresh runner token, and crunch-run run as a real
 * process from sources (`bin/dispatch-cloud --detach ...`) with its own DISPATCH_VM_ROOT.
 */
import { spawn } from "node:child_process";
import { existsSync, readdirSync, rmSync } from "node:fs";
import { chmod, mkdtemp, readdir, readFile, rm } from "node:fs/promises";
import http from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { findPids, terminate } from "../cloud-drivers/local/procs.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createRestServer } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";
import { createUser, getBundle, insertBundle } from "../store/queries.ts";
import { stageBundle } from "../store/transitions.ts";
import type { Bundle, NewBundle } from "../store/types.ts";
import { startWithRunnerToken, testBundleUuid, testNewBundle } from "./db.ts";
import { BIN } from "./serve-process.ts";

export interface RunResult {
  code: number | null;
  stdout: string;
  stderr: string;
}

export interface RunnerHarness {
  apiUrl: string;
  /** DISPATCH_VM_ROOT of the crunch-run processes. */
  root: string;
  env: NodeJS.ProcessEnv;
  /** A bundle of the harness's user, taken to `starting` (attempt 1) with a fresh runner token. */
  newStartingBundle(
    overrides?: Partial<NewBundle>,
  ): Promise<{ uuid: string; token: string; attempt: number }>;
  /** A new bundle of the harness's user, staged (not yet claimed): its uuid. */
  newStagedBundle(overrides?: Partial<NewBundle>): Promise<string>;
  /** `crunch-run --detach uuid` with the start document on stdin. */
  detach(
    bundle: { uuid: string; token: string; attempt: number },
    doc?: Record<string, unknown>,
    extraEnv?: NodeJS.ProcessEnv,
  ): Promise<RunResult>;
  /** Any crunch-run command. */
  crunchRun(args: string[], stdin?: string, extraEnv?: NodeJS.ProcessEnv): Promise<RunResult>;
  /**
   * Sends the warm spares away (removes their sockets; they exit), so that the next --detach starts its
   * supervisor with the environment it is given rather than handing the bundle to a spare started earlier.
   */
  dropSpares(): void;
  /** `crunch-run --list` without the warm pool's `spare` line and the cache's `cache` line: the runners alone. */
  listBundles(extraEnv?: NodeJS.ProcessEnv): Promise<string>;
  /** Polls the store until the bundle is final (ready, failed, killed). */
  waitFinal(uuid: string, timeoutMs?: number): Promise<Bundle>;
  /** Polls until the bundle is in one of the states. */
  waitState(uuid: string, states: string[], timeoutMs?: number): Promise<Bundle>;
  /** One stream of the bundle's log through the users' API. */
  log(uuid: string, stream: "stdout" | "stderr"): Promise<string>;
  /** One output file through the users' API (status and body). */
  output(uuid: string, path: string): Promise<{ status: number; body: string }>;
  close(): Promise<void>;
}

/** The REST server's limits a test may lower (createRestServer's options of the same names). */
export interface HarnessLimits {
  maxOutputFiles?: number;
  maxLogBytesPerStream?: number;
}

export async function startRunnerHarness(db: Db, limits: HarnessLimits = {}): Promise<RunnerHarness> {
  const dataDir = await mkdtemp(join(tmpdir(), "crunch-run-data-"));
  const root = await mkdtemp(join(tmpdir(), "crunch-run-vm-"));
  // As a real VM's root ("/"): other users may pass through it (the process runtime's bundle uids must).
  await chmod(root, 0o711);
  const app: FastifyInstance = await createRestServer({
    db,
    logger: false,
    clusterId: "zzzzz",
    maxRequestBodySize: 1024 * 1024,
    defaultMaxAttempts: 3,
    dataDir,
    logPollInterval: 200,
    ...limits,
  });
  await app.listen({ host: "127.0.0.1", port: 0 });
  const address = app.server.address();
  if (address === null || typeof address === "string") throw new Error("no listening address");
  const apiUrl = `http://127.0.0.1:${address.port}`;
  const userToken = newUserToken();
  const user = await createUser(db, {
    uuid: newUserUuid("zzzzz"),
    name: `cr-${Math.random().toString(36).slice(2, 10)}`,
    isAdmin: false,
    tokenHash: hashToken(userToken),
  });
  const env: NodeJS.ProcessEnv = { ...process.env, DISPATCH_VM_ROOT: root };
  delete env["NODE_OPTIONS"];

  const run = (args: string[], stdin = "", extraEnv: NodeJS.ProcessEnv = {}): Promise<RunResult> =>
    new Promise((resolve, reject) => {
      const child = spawn(BIN, args, { env: { ...env, ...extraEnv }, stdio: ["pipe", "pipe", "pipe"] });
      let stdout = "";
      let stderr = "";
      child.stdout.on("data", (d: Buffer) => {
        stdout += d.toString();
      });
      child.stderr.on("data", (d: Buffer) => {
        stderr += d.toString();
      });
      child.on("error", reject);
      child.on("close", (code) => resolve({ code, stdout, stderr }));
      child.stdin.end(stdin);
    });

  const get = (path: string): Promise<{ status: number; body: string }> =>
    new Promise((resolve, reject) => {
      http
        .get(`${apiUrl}${path}`, { headers: { authorization: `Bearer ${userToken}` } }, (res) => {
          let body = "";
          res.on("data", (d: Buffer) => {
            body += d.toString();
          });
          res.on("end", () => resolve({ status: res.statusCode ?? 0, body }));
        })
        .on("error", reject);
    });

  const waitState = async (uuid: string, states: string[], timeoutMs = 60_000): Promise<Bundle> => {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const b = await getBundle(db, uuid);
      if (b === null) throw new Error(`bundle ${uuid} is gone`);
      if (states.includes(b.state)) return b;
      if (Date.now() > deadline) {
        throw new Error(
          `bundle ${uuid} is still ${b.state} after ${timeoutMs} ms; wanted ${states.join("|")}`,
        );
      }
      await new Promise((r) => setTimeout(r, 100));
    }
  };

  const newStagedBundle = async (overrides: Partial<NewBundle> = {}): Promise<string> => {
    const uuid = testBundleUuid();
    await insertBundle(db, uuid, testNewBundle(user.uuid, overrides), "created");
    const staged = await stageBundle(db, uuid, { actor: "test" });
    if (!staged.ok) throw new Error(`cannot stage ${uuid}`);
    return uuid;
  };

  return {
    apiUrl,
    root,
    env,
    newStagedBundle,
    async newStartingBundle(overrides = {}) {
      const uuid = await newStagedBundle(overrides);
      const { token, bundle } = await startWithRunnerToken(db, uuid, { instanceId: "i-test", actor: "test" });
      return { uuid, token, attempt: bundle.attempt };
    },
    detach(bundle, doc = {}, extraEnv = {}) {
      const start = {
        uuid: bundle.uuid,
        attempt: bundle.attempt,
        apiUrl,
        token: bundle.token,
        instanceType: "small",
        gpuDevices: [],
        runtimeEngine: "process",
        heartbeatIntervalMs: 200,
        ...doc,
      };
      return run(["--detach", bundle.uuid], JSON.stringify(start), extraEnv);
    },
    crunchRun: run,
    dropSpares: () => {
      const dir = join(root, "var", "run");
      for (const name of existsSync(dir) ? readdirSync(dir) : []) {
        if (name.startsWith("cr-spare-")) rmSync(join(dir, name), { force: true });
      }
    },
    listBundles: async (extraEnv) =>
      (await run(["--list"], "", extraEnv)).stdout.replace(/^(spare|cache) .*\n/gm, ""),
    waitFinal: (uuid, timeoutMs) => waitState(uuid, ["ready", "failed", "killed"], timeoutMs),
    waitState,
    async log(uuid, stream) {
      const res = await get(`/api/v1/bundles/${uuid}/logs?stream=${stream}`);
      if (res.status !== 200) throw new Error(`logs of ${uuid}: ${res.status} ${res.body}`);
      return res.body;
    },
    output: (uuid, path) => get(`/api/v1/bundles/${uuid}/outputs/${path}`),
    async close() {
      // Stop any supervisor still running from this root (a failed test), then the server.
      const lockDir = join(root, "var", "lock");
      for (const name of await readdir(lockDir).catch(() => [] as string[])) {
        if (!name.endsWith(".lock")) continue;
        try {
          const { pid } = JSON.parse(await readFile(join(lockDir, name), "utf8")) as { pid: number };
          process.kill(pid, "SIGKILL");
        } catch {
          // gone
        }
      }
      // Supervisors outlive their bundles (they go back to the warm pool), and the pool and its spares write
      // under the root: stop every process of this root before removing it.
      const left = await stopProcessesOf(root);
      await app.close();
      await rm(dataDir, { recursive: true, force: true });
      await rm(root, { recursive: true, force: true, maxRetries: 5 });
      if (left.length > 0) throw new Error(`processes of ${root} outlived SIGKILL: ${left.join(" ")}`);
    },
  };
}

/**
 * SIGKILLs every process whose environment says DISPATCH_VM_ROOT=root (the warm pool, its spares, supervisors)
 * and waits for them to go; returns the pids of any still there.
 */
export async function stopProcessesOf(root: string): Promise<number[]> {
  await terminate(findPids({ env: ["DISPATCH_VM_ROOT", root] }), 0);
  return findPids({ env: ["DISPATCH_VM_ROOT", root] });
}

/** The supervisor's own log (its stdout and stderr), for failure messages. */
export async function supervisorLog(root: string, uuid: string): Promise<string> {
  return readFile(join(root, "var", "log", "crunch-run", `${uuid}.log`), "utf8").catch(() => "(no log)");
}
