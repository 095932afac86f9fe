/**
 * `dispatch-cloud worker` as a real process (from sources, and from the one-file artifact for upgrades)
 * against a real REST server (in process, on PGlite) with its worker routes: resources detection, no
 * listening socket, check-in, a bundle delivered by check-in run to ready by crunch-run's process runtime,
 * kill, stopping (finish and hand-back), the upgrade and a refused upgrade (digest mismatch).
 */
import { type ChildProcess, spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, readFileSync } from "node:fs";
import { chmod, mkdtemp, readdir, readFile, readlink, rm, statfs, writeFile } from "node:fs/promises";
import http from "node:http";
import os, { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../cli/cli.ts";
import type { CliIo } from "../cli/io.ts";
import { detectGpus, detectResources, parseNvidiaSmi } from "../cli/worker/resources.ts";
import { verifyArtifact } from "../cli/worker/upgrade.ts";
import { createRestServer } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";
import { getBundle, insertBundle } from "../store/queries.ts";
import { killBundle, stageBundle, startBundleOnWorker } from "../store/transitions.ts";
import type { Bundle, NewBundle } from "../store/types.ts";
import { getWorker, notifyWorkers } from "../store/worker-queries.ts";
import {
  createTestUserWithToken,
  startWithRunnerToken,
  testBundleUuid,
  testNewBundle,
  useTestDb,
} from "./db.ts";
import { BIN } from "./serve-process.ts";

const sha256 = (b: Buffer | string) => createHash("sha256").update(b).digest("hex");

describe("worker resources", () => {
  it("reports the machine's CPUs, RAM and its work directory's free disk", async () => {
    const dir = await mkdtemp(join(tmpdir(), "wc-res-"));
    try {
      const r = await detectResources(dir, null);
      expect(r.vcpus).toBe(os.availableParallelism());
      expect(r.ram).toBe(os.totalmem());
      const s = await statfs(dir);
      // Free space moves a little while other tests write; the same file system, the same order of size.
      expect(Math.abs(r.freeDisk - s.bavail * s.bsize)).toBeLessThan(1024 ** 3);
      expect(r.freeDisk).toBeGreaterThan(0);
      expect(r.gpu).toBeNull();
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("reads GPUs from nvidia-smi: count, the smallest device's memory, driver and compute capability", async () => {
    expect(parseNvidiaSmi("81920, 535.54.03, 8.0\n40960, 535.54.03, 8.0\n")).toEqual({
      stack: "cuda",
      deviceCount: 2,
      vram: 40960 * 2 ** 20,
      driverVersion: "535.54.03",
      hardwareTarget: "8.0",
    });
    expect(parseNvidiaSmi("")).toBeNull();
    expect(parseNvidiaSmi("[N/A], 535, 8.0\n")).toBeNull();
    const dir = await mkdtemp(join(tmpdir(), "wc-smi-"));
    try {
      const smi = join(dir, "nvidia-smi");
      await writeFile(
        smi,
        '#!/bin/sh\n[ "$1" = --query-gpu=memory.total,driver_version,compute_cap ] || exit 9\necho "24576, 550.1, 8.9"\n',
        {
          mode: 0o755,
        },
      );
      expect(await detectGpus(smi)).toEqual({
        stack: "cuda",
        deviceCount: 1,
        vram: 24576 * 2 ** 20,
        driverVersion: "550.1",
        hardwareTarget: "8.9",
      });
      // Not installed, or failing: no GPU.
      expect(await detectGpus(join(dir, "absent"))).toBeNull();
      await writeFile(smi, "#!/bin/sh\nexit 1\n", { mode: 0o755 });
      expect(await detectGpus(smi)).toBeNull();
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("refuses an artifact whose bytes, announced digest or header disagree", () => {
    const content = Buffer.from("program v2");
    const good = { sha256: sha256(content), bytes: content.length };
    expect(verifyArtifact(content, good, good.sha256)).toBe(good.sha256);
    for (const [c, e, h] of [
      [Buffer.from("program v3"), good, good.sha256],
      [content, { ...good, sha256: sha256("other") }, good.sha256],
      [content, good, sha256("other")],
      [content, good, ""],
      [content, { ...good, bytes: 3 }, good.sha256],
    ] as const) {
      expect(() => verifyArtifact(c, e, h)).toThrow(
        expect.objectContaining({ code: "worker.artifact_mismatch" }),
      );
    }
  });
});

/** The inodes of the sockets a process has open. */
async function socketInodes(pid: number): Promise<Set<string>> {
  const out = new Set<string>();
  for (const fd of await readdir(`/proc/${pid}/fd`).catch(() => [] as string[])) {
    const link = await readlink(`/proc/${pid}/fd/${fd}`).catch(() => "");
    const m = /^socket:\[(\d+)\]$/.exec(link);
    if (m !== null) out.add(m[1]!);
  }
  return out;
}

/**
 * The listening sockets among a process's sockets: TCP in state LISTEN (0A), any bound UDP socket, and Unix
 * sockets accepting connections (__SO_ACCEPTCON, flag 0x10000), from the process's network namespace tables.
 */
async function listeningSockets(pid: number): Promise<string[]> {
  const mine = await socketInodes(pid);
  const found: string[] = [];
  for (const table of ["tcp", "tcp6", "udp", "udp6"]) {
    const text = await readFile(`/proc/${pid}/net/${table}`, "utf8").catch(() => "");
    for (const line of text.split("\n").slice(1)) {
      const f = line.trim().split(/\s+/);
      if (f.length < 10 || !mine.has(f[9]!)) continue;
      if (table.startsWith("udp") || f[3] === "0A") found.push(`${table} ${f[1]}`);
    }
  }
  const unix = await readFile(`/proc/${pid}/net/unix`, "utf8").catch(() => "");
  for (const line of unix.split("\n").slice(1)) {
    const f = line.trim().split(/\s+/);
    if (f.length < 7 || !mine.has(f[6]!)) continue;
    if ((Number.parseInt(f[3]!, 16) & 0x10000) !== 0) found.push(`unix ${f[7] ?? "(unnamed)"}`);
  }
  return found;
}

async function waitFor<T>(
  what: string,
  fn: () => Promise<T | null | undefined | false>,
  ms = 60_000,
): Promise<T> {
  const until = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v !== null && v !== undefined && v !== false) return v;
    if (Date.now() > until) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

class WorkerProc {
  out = "";
  readonly exited: Promise<number | null>;
  constructor(readonly child: ChildProcess) {
    child.stdout?.on("data", (d: Buffer) => {
      this.out += d.toString();
    });
    child.stderr?.on("data", (d: Buffer) => {
      this.out += d.toString();
    });
    this.exited = new Promise((ok) => child.once("exit", (code) => ok(code)));
  }
  get pid(): number {
    return this.child.pid as number;
  }
  /** The log lines (JSON) whose msg matches. */
  lines(msg: RegExp): Record<string, unknown>[] {
    return this.out
      .split("\n")
      .filter((l) => l.startsWith("{"))
      .map((l) => JSON.parse(l) as Record<string, unknown>)
      .filter((l) => msg.test(String(l["msg"])));
  }
  waitLog(msg: RegExp, ms = 60_000): Promise<Record<string, unknown>> {
    return waitFor(`log ${msg} in:\n${this.out}`, async () => this.lines(msg)[0], ms);
  }
  async stop(signal: NodeJS.Signals = "SIGTERM"): Promise<number | null> {
    if (this.child.exitCode === null && this.child.signalCode === null) this.child.kill(signal);
    return this.exited;
  }
  /** Signals its whole process group, as Ctrl-C at a terminal does (started with `group`). */
  async ctrlC(): Promise<number | null> {
    process.kill(-this.pid, "SIGINT");
    return this.exited;
  }
}

describe("dispatch-cloud worker (a real process against the REST server)", () => {
  const getDb = useTestDb("pglite");
  let db: Db;
  let apiUrl: string;
  let user: { uuid: string; token: string };
  let dir: string;
  const procs: WorkerProc[] = [];
  const servers: FastifyInstance[] = [];

  const io = (argv: string[]): CliIo & { stdout: string[]; stderr: string[] } => {
    const stdout: string[] = [];
    const stderr: string[] = [];
    return {
      argv,
      env: { DISPATCH_CLOUD_TOKEN: user.token, DISPATCH_CLOUD_API_URL: apiUrl },
      cwd: dir,
      out: (l) => stdout.push(l),
      err: (l) => stderr.push(l),
      progress: () => {},
      stdout,
      stderr,
    };
  };

  async function restServer(artifact?: { sha256: string; content: Buffer }): Promise<string> {
    const server = await createRestServer({
      db,
      logger: false,
      clusterId: "zzzzz",
      maxRequestBodySize: 1024 * 1024,
      defaultMaxAttempts: 3,
      dataDir: await mkdtemp(join(dir, "data-")),
      logPollInterval: 200,
      workers: { longPoll: 2000, runtimeEngine: "process", ...(artifact === undefined ? {} : { artifact }) },
    });
    await server.listen({ host: "127.0.0.1", port: 0 });
    servers.push(server);
    const a = server.server.address();
    if (a === null || typeof a === "string") throw new Error("no address");
    return `http://127.0.0.1:${a.port}`;
  }

  /** A new worker of the test user, made by `dispatch-cloud workers token create`; its id and token file. */
  async function newWorker(name: string): Promise<{ id: string; tokenFile: string }> {
    const c = io(["workers", "token", "create", "--name", name]);
    expect(await runCli(c), c.stderr.join("\n")).toBe(0);
    const id = /created worker (\S+)/.exec(c.stderr.join("\n"))?.[1];
    expect(id).toMatch(/^zzzzz-wrkr-[a-z0-9]{15}$/);
    const tokenFile = join(dir, `${name}.token`);
    await writeFile(tokenFile, `${c.stdout[0]}\n`, { mode: 0o600 });
    return { id: id as string, tokenFile };
  }

  function startWorkerProcess(
    w: { id: string; tokenFile: string },
    args: string[],
    opts: { program?: string; api?: string; group?: boolean } = {},
  ): WorkerProc {
    const argv = [
      "worker",
      "--api-url",
      opts.api ?? apiUrl,
      "--token-file",
      w.tokenFile,
      "--worker-id",
      w.id,
    ];
    const env = { ...process.env };
    delete env["NODE_OPTIONS"];
    const p = new WorkerProc(
      spawn(opts.program ?? BIN, [...argv, ...args], {
        env,
        stdio: ["ignore", "pipe", "pipe"],
        cwd: dir,
        detached: opts.group === true,
      }),
    );
    procs.push(p);
    return p;
  }

  async function bundleOnWorker(workerId: string, over: Partial<NewBundle>): Promise<string> {
    const uuid = testBundleUuid();
    await insertBundle(db, uuid, testNewBundle(user.uuid, over), "created");
    expect((await stageBundle(db, uuid, { actor: "test" })).ok).toBe(true);
    // As the dispatcher places a bundle on a worker.
    const r = await startBundleOnWorker(db, uuid, { workerId, gpuDevices: [], actor: "test" });
    expect(r.ok).toBe(true);
    await notifyWorkers(db, [workerId]);
    return uuid;
  }

  const waitState = (uuid: string, states: string[], ms = 60_000): Promise<Bundle> =>
    waitFor(
      `${uuid} in ${states.join("|")}`,
      async () => {
        const b = await getBundle(db, uuid);
        return b !== null && states.includes(b.state) ? b : null;
      },
      ms,
    );

  /** `crunch-run <args>` from sources with DISPATCH_VM_ROOT=root, the start document (if any) on stdin. */
  const crunchRun = (
    root: string,
    args: string[],
    doc?: object,
  ): Promise<{ code: number | null; stdout: string; stderr: string }> =>
    new Promise((resolve, reject) => {
      const env: NodeJS.ProcessEnv = { ...process.env, DISPATCH_VM_ROOT: root };
      delete env["NODE_OPTIONS"];
      const child = spawn(BIN, args, { env, stdio: ["pipe", "pipe", "pipe"] });
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
      child.stdin.end(doc === undefined ? "" : JSON.stringify(doc));
    });

  const workDir = (name: string) => join(dir, name);
  const listed = async (root: string): Promise<string[]> =>
    (await readdir(join(root, "var", "lock")).catch(() => [] as string[])).filter((n) => n.endsWith(".lock"));

  beforeAll(async () => {
    db = getDb();
    dir = await mkdtemp(join(tmpdir(), "wc-worker-"));
    // As a VM's root: the process runtime's bundle users pass through to their work directories.
    await chmod(dir, 0o711);
    user = await createTestUserWithToken(db);
    apiUrl = await restServer();
  });

  afterEach((ctx) => {
    if (ctx.task.result?.state !== "fail") return;
    for (const p of procs) process.stderr.write(`--- worker ${p.pid}:\n${p.out}\n`);
  });

  afterAll(async () => {
    for (const p of procs) await p.stop("SIGKILL");
    for (const s of servers) await s.close();
    // Supervisors a failed test left behind.
    for (const name of await readdir(dir).catch(() => [] as string[])) {
      for (const lock of await listed(join(dir, name))) {
        try {
          const { pid } = JSON.parse(readFileSync(join(dir, name, "var", "lock", lock), "utf8")) as {
            pid: number;
          };
          process.kill(pid, "SIGKILL");
        } catch {
          // gone
        }
      }
    }
    await rm(dir, { recursive: true, force: true });
  });

  it("workers token create, list, disable and enable from the CLI", async () => {
    const w = await newWorker("cli-one");
    expect(readFileSync(w.tokenFile, "utf8")).toMatch(/^dcw_/);
    const l = io(["workers", "list"]);
    expect(await runCli(l), l.stderr.join("\n")).toBe(0);
    expect(l.stdout[0]).toMatch(/^ID\s+NAME\s+OWNER\s+STATE\s+SLOTS\s+RUNNING\s+CHECK-IN\s+VERSION/);
    const row = l.stdout.find((line) => line.startsWith(w.id));
    expect(row).toMatch(new RegExp(`^${w.id}\\s+cli-one\\s+${user.uuid}\\s+new\\s+\\d+\\s+0\\s+never`));
    const d = io(["workers", "disable", w.id]);
    expect(await runCli(d)).toBe(0);
    expect((await getWorker(db, w.id))?.disabledAt).not.toBeNull();
    const e = io(["workers", "enable", w.id, "zzzzz-wrkr-000000000000000"]);
    expect(await runCli(e)).toBe(1);
    expect(e.stdout).toEqual([`${w.id}: enabled`, expect.stringContaining("[workers.not_found]")]);
    expect((await getWorker(db, w.id))?.disabledAt).toBeNull();
    // A bundle asks for a tag and for the owner's workers only (submit's flags of the request's fields).
    const sub = io(["submit", "--image", "busybox", "--tag", "gpu", "--workers-only", "--", "true"]);
    expect(await runCli(sub), sub.stderr.join("\n")).toBe(0);
    const submitted = await getBundle(db, sub.stdout[0] as string);
    expect(submitted?.resources).toMatchObject({ tag: "gpu", workersOnly: true });
    const a = io(["workers", "list", "--all"]);
    expect(await runCli(a)).toBe(1);
    expect(a.stderr.join("\n")).toContain("[auth.forbidden]");
  });

  it("checks in with no listening socket, runs a delivered bundle to ready, kills one, and finishes on SIGTERM", async () => {
    const w = await newWorker("laptop");
    const root = workDir("laptop");
    // A leftover in its work directory: a runner of one of the user's bundles that is not this worker's (it runs
    // "on an instance"). The worker finds it, reports it, and the server's answer tells it to kill it.
    const leftover = testBundleUuid();
    await insertBundle(db, leftover, testNewBundle(user.uuid, { command: ["sleep", "300"] }), "created");
    expect((await stageBundle(db, leftover, { actor: "test" })).ok).toBe(true);
    const started = await startWithRunnerToken(db, leftover, { instanceId: "i-elsewhere", actor: "test" });
    const detached = await crunchRun(root, ["--detach", leftover], {
      uuid: leftover,
      attempt: started.bundle.attempt,
      apiUrl,
      token: started.token,
      instanceType: "small",
      gpuDevices: [],
      runtimeEngine: "process",
      warmSupervisors: 0,
    });
    expect(detached.code, detached.stderr).toBe(0);
    await waitState(leftover, ["running"]);
    const p = startWorkerProcess(w, [
      "--work-dir",
      root,
      "--tag",
      "gpu",
      "--tag",
      "lab-1",
      "--slots",
      "3",
      "--runtime",
      "process",
    ]);
    const row = await waitFor("the worker's first check-in", async () => {
      const r = await getWorker(db, w.id);
      return r?.checkedInAt !== null && r?.state === "active" ? r : null;
    });
    expect(row).toMatchObject({
      tags: ["gpu", "lab-1"],
      slots: 3,
      version: expect.any(String),
      artifactSha256: null, // from sources: no artifact to report
    });
    expect(row?.resources).toMatchObject({ vcpus: os.availableParallelism(), ram: os.totalmem(), gpu: null });
    expect(row?.resources?.freeDisk).toBeGreaterThan(0);
    // It talks to the server, yet listens nowhere.
    expect((await socketInodes(p.pid)).size).toBeGreaterThan(0);
    expect(await listeningSockets(p.pid)).toEqual([]);

    expect(await p.waitLog(/^found a bundle running in the work directory$/)).toMatchObject({
      uuid: leftover,
      attempt: 1,
    });
    expect(await p.waitLog(/^stopping a bundle's runner$/)).toMatchObject({ uuid: leftover });
    await waitFor("the leftover's runner gone", async () => (await listed(root)).length === 0);

    const done = await bundleOnWorker(w.id, {
      command: ["sh", "-c", 'echo "hi from $GREETING" > "$DISPATCH_OUTPUT_DIR/out.txt"'],
      env: { GREETING: "the worker" },
    });
    const final = await waitState(done, ["ready", "failed", "killed"]);
    expect(final.state, p.out).toBe("ready");
    expect(final.exitCode).toBe(0);
    expect(final.workerId).toBe(w.id);
    expect(await p.waitLog(/^bundle started$/)).toMatchObject({ uuid: done, attempt: 1 });
    await p.waitLog(/^bundle finished$/);
    // The supervisor ran below the work directory (crunch-run's DISPATCH_VM_ROOT) and left its log there.
    expect(existsSync(join(root, "var", "log", "crunch-run", `${done}.log`))).toBe(true);
    const res = await fetch(`${apiUrl}/api/v1/bundles/${done}/outputs/out.txt`, {
      headers: { authorization: `Bearer ${user.token}` },
    });
    expect(await res.text()).toBe("hi from the worker\n");
    expect(await listeningSockets(p.pid)).toEqual([]);

    // A bundle killed by its owner: stopped, whether the server's kill message or the supervisor's own
    // heartbeat gets there first (the worker's kill message is shown deterministically by the leftover above).
    const long = await bundleOnWorker(w.id, { command: ["sleep", "300"] });
    await waitState(long, ["running"]);
    await waitFor("the running bundle in the worker's check-in", async () =>
      (await getWorker(db, w.id))?.running.some((r) => r.uuid === long),
    );
    expect((await killBundle(db, long, { actor: "test", reason: "killed by the test" })).ok).toBe(true);
    await notifyWorkers(db, [w.id]);
    await waitFor("the killed runner gone", async () => (await listed(root)).length === 0);
    await waitFor("the check-in without it", async () => (await getWorker(db, w.id))?.running.length === 0);
    expect((await getBundle(db, long))?.state).toBe("killed");
    expect(p.out).not.toContain("dcr_");
    expect(p.out).not.toContain("dcw_");

    // SIGTERM with nothing running: checks out at once.
    expect(await p.stop("SIGTERM")).toBe(0);
    expect((await getWorker(db, w.id))?.state).toBe("stopped");
    expect(p.lines(/^checked out$/)).toHaveLength(1);
  }, 150_000);

  it("retries a server that fails (503) with back-off, logging the failure once, and checks in when it recovers", async () => {
    let failing = true;
    let refused = 0;
    const target = new URL(apiUrl);
    const proxy = http.createServer((req, res) => {
      if (failing) {
        refused++;
        res.writeHead(503, { "content-type": "application/json" });
        res.end(JSON.stringify({ error: { code: "internal.error", message: "the test's proxy is down" } }));
        req.resume();
        return;
      }
      const up = http.request(
        { host: target.hostname, port: target.port, path: req.url, method: req.method, headers: req.headers },
        (upRes) => {
          res.writeHead(upRes.statusCode ?? 502, upRes.headers);
          upRes.pipe(res);
        },
      );
      req.pipe(up);
    });
    await new Promise<void>((ok) => proxy.listen(0, "127.0.0.1", ok));
    const port = (proxy.address() as { port: number }).port;
    try {
      const w = await newWorker("flaky");
      const p = startWorkerProcess(w, ["--work-dir", workDir("flaky")], { api: `http://127.0.0.1:${port}` });
      await waitFor("three refused check-ins", async () => refused >= 3);
      expect(p.child.exitCode).toBeNull();
      expect(p.lines(/^check-in failed; retrying with back-off$/)).toHaveLength(1);
      expect((await getWorker(db, w.id))?.checkedInAt).toBeNull();
      failing = false;
      const again = await p.waitLog(/^check-in works again$/);
      expect(again["failures"]).toBe(refused);
      await waitFor(
        "the check-in through the proxy",
        async () => (await getWorker(db, w.id))?.state === "active",
      );
      expect(await p.stop("SIGTERM")).toBe(0);
    } finally {
      proxy.closeAllConnections();
      await new Promise<void>((ok) => proxy.close(() => ok()));
    }
  }, 150_000);

  it("--on-stop finish lets the running bundle end before it checks out; hand-back requeues it", async () => {
    const w = await newWorker("finisher");
    const root = workDir("finisher");
    const p = startWorkerProcess(w, ["--work-dir", root, "--runtime", "process"]);
    const b = await bundleOnWorker(w.id, {
      command: ["sh", "-c", 'sleep 3; echo done > "$DISPATCH_OUTPUT_DIR/x"'],
    });
    await waitState(b, ["running"]);
    p.child.kill("SIGTERM");
    await p.waitLog(/^stopping: taking no new bundles/);
    await waitFor("draining in the row", async () => (await getWorker(db, w.id))?.state === "draining");
    expect(await p.exited).toBe(0);
    // It stopped only after the bundle was done.
    expect((await getBundle(db, b))?.state).toBe("ready");
    expect((await getWorker(db, w.id))?.state).toBe("stopped");

    const q = startWorkerProcess(w, ["--work-dir", root, "--runtime", "process", "--on-stop", "hand-back"]);
    const c = await bundleOnWorker(w.id, { command: ["sleep", "300"] });
    await waitState(c, ["running"]);
    await waitFor("the runner", async () => (await listed(root)).length === 1);
    q.child.kill("SIGINT");
    expect(await q.exited).toBe(0);
    expect(await q.waitLog(/^handed the bundles back/)).toBeDefined();
    // The running bundle was given up by its worker (lost: the attempt rules decide), and its runner is gone.
    const after = await getBundle(db, c);
    expect(after?.state).not.toBe("running");
    expect(after?.workerId ?? null).toBeNull();
    expect(await listed(root)).toEqual([]);
    expect((await getWorker(db, w.id))?.state).toBe("stopped");
  }, 150_000);

  describe("upgrades (from the one-file artifact)", () => {
    let artifactA: Buffer;
    let artifactB: Buffer;
    beforeAll(async () => {
      // Not a literal specifier: the build script (esbuild) is loaded only here.
      const { buildArtifact } = (await import("../scripts/build.ts")) as typeof import("../scripts/build.ts");
      artifactA = (await buildArtifact()).content;
      // The "new" version: the same program with a different digest.
      artifactB = Buffer.concat([artifactA, Buffer.from("\n// the next version\n")]);
    }, 180_000);

    async function programCopy(name: string): Promise<string> {
      const d = await mkdtemp(join(dir, `${name}-bin-`));
      const file = join(d, "dispatch-cloud.cjs");
      await writeFile(file, artifactA, { mode: 0o755 });
      return file;
    }

    it("drains, downloads the server's artifact, replaces its program and checks in with the new digest", async () => {
      const newApi = await restServer({ sha256: sha256(artifactB), content: artifactB });
      const w = await newWorker("upgrader");
      const program = await programCopy("upgrader");
      const p = startWorkerProcess(w, ["--work-dir", workDir("upgrader"), "--runtime", "process"], {
        program,
        api: newApi,
        group: true,
      });
      await p.waitLog(/^upgrading/, 90_000);
      await p.waitLog(/^upgraded/, 90_000);
      const row = await waitFor(
        "a check-in with the new digest",
        async () => {
          const r = await getWorker(db, w.id);
          return r?.artifactSha256 === sha256(artifactB) && r.state === "active" ? r : null;
        },
        90_000,
      );
      expect(row.version).toBeTruthy();
      expect(sha256(readFileSync(program))).toBe(sha256(artifactB));
      // The new program runs the next bundle.
      const b = await bundleOnWorker(w.id, { command: ["true"] });
      expect((await waitState(b, ["ready", "failed", "killed"])).state, p.out).toBe("ready");
      // The old process passes Ctrl-C on to the new one (once: it finishes, not hands back) and exits with its code.
      expect(await p.ctrlC()).toBe(0);
      expect(p.lines(/^stopping: taking no new bundles/)).toHaveLength(1);
      expect(p.lines(/^stopping: handing the bundles back/)).toEqual([]);
      expect((await getWorker(db, w.id))?.state).toBe("stopped");
    }, 180_000);

    it("refuses an artifact whose digest does not match and keeps running its own program", async () => {
      const api = await restServer({ sha256: sha256(artifactB), content: artifactB });
      // Between the worker and the server: a proxy that changes one byte of the artifact on its way.
      const target = new URL(api);
      const proxy = http.createServer((req, res) => {
        const up = http.request(
          {
            host: target.hostname,
            port: target.port,
            path: req.url,
            method: req.method,
            headers: req.headers,
          },
          (upRes) => {
            const chunks: Buffer[] = [];
            upRes.on("data", (c: Buffer) => chunks.push(c));
            upRes.on("end", () => {
              const body = Buffer.concat(chunks);
              if (req.url === "/api/v1/workers/artifact" && body.length > 100) body[100] = body[100]! ^ 1;
              res.writeHead(upRes.statusCode ?? 502, upRes.headers);
              res.end(body);
            });
          },
        );
        req.pipe(up);
      });
      await new Promise<void>((ok) => proxy.listen(0, "127.0.0.1", ok));
      const port = (proxy.address() as { port: number }).port;
      try {
        const w = await newWorker("refuser");
        const program = await programCopy("refuser");
        const p = startWorkerProcess(w, ["--work-dir", workDir("refuser")], {
          program,
          api: `http://127.0.0.1:${port}`,
        });
        const refused = await p.waitLog(/^upgrade failed/, 90_000);
        expect(refused["code"]).toBe("worker.artifact_mismatch");
        const at = (await getWorker(db, w.id))?.checkedInAt?.getTime() ?? 0;
        // Still running, still checking in with its own program.
        await waitFor("a check-in after the refusal", async () => {
          const r = await getWorker(db, w.id);
          return (r?.checkedInAt?.getTime() ?? 0) > at ? r : null;
        });
        expect(p.child.exitCode).toBeNull();
        expect(sha256(readFileSync(program))).toBe(sha256(artifactA));
        expect((await getWorker(db, w.id))?.artifactSha256).toBe(sha256(artifactA));
        expect(p.lines(/^upgraded/)).toEqual([]);
        expect(await p.stop("SIGTERM")).toBe(0);
      } finally {
        proxy.closeAllConnections();
        await new Promise<void>((ok) => proxy.close(() => ok()));
      }
    }, 180_000);
  });
});
