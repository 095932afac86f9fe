/**
 * What a newcomer runs into around `serve`: one `serve` per data directory (a second one exits at once naming
 * the first; a dead holder's lock is taken over), a process that cannot listen exits non-zero instead of
 * hanging, output to a closed pipe ends quietly, logs for people (text at a terminal; one request line at
 * debug, not two at info), and a data directory private to the service user.
 */
import { execFile, spawn } from "node:child_process";
import { chmod, mkdir, mkdtemp, readdir, rm, stat, writeFile } from "node:fs/promises";
import net from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { Writable } from "node:stream";
import { afterAll, describe, expect, it } from "vitest";
import { lockDataDir, lockSocketPath, preparePrivateDir } from "../lib/data-dir.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { createLogger, resolveLogFormat } from "../lib/logger.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createUser } from "../store/queries.ts";
import { openTestDb } from "./db.ts";
import { BIN, REPO, runBin, startServe } from "./serve-process.ts";

const dirs: string[] = [];
async function tempDir(prefix: string): Promise<string> {
  const d = await mkdtemp(path.join(tmpdir(), prefix));
  dirs.push(d);
  return d;
}
afterAll(async () => {
  await Promise.all(dirs.map((d) => rm(d, { recursive: true, force: true })));
});

/** A child node process that takes the lock on `dataDir` and waits; resolves once it holds it. */
async function holderProcess(dataDir: string, platform: string): Promise<ReturnType<typeof spawn>> {
  const code = `import { lockDataDir } from ${JSON.stringify(path.join(REPO, "lib", "data-dir.ts"))};
await lockDataDir(${JSON.stringify(dataDir)}, { command: "serve", platform: ${JSON.stringify(platform)} });
process.stdout.write("locked\\n");
setInterval(() => {}, 1000);`;
  const child = spawn(process.execPath, ["--import", "tsx", "--input-type=module", "-e", code], {
    cwd: REPO,
    stdio: ["ignore", "pipe", "inherit"],
  });
  await new Promise<void>((resolve, reject) => {
    child.stdout?.on("data", (d: Buffer) => {
      if (d.toString().includes("locked")) resolve();
    });
    child.once("exit", (c) => reject(new Error(`the holder exited (${c}) before taking the lock`)));
  });
  return child;
}

async function killed(child: ReturnType<typeof spawn>): Promise<void> {
  const gone = new Promise((r) => child.once("exit", r));
  child.kill("SIGKILL");
  await gone;
}

describe.each(["linux", "darwin"] as const)("the data directory lock (%s socket)", (platform) => {
  it("refuses a second holder, naming the first; a released or dead holder's lock is taken", async () => {
    const dataDir = await preparePrivateDir(path.join(await tempDir("dc-lock-"), "data"));
    expect(lockSocketPath(dataDir, platform).startsWith("\0")).toBe(platform === "linux");

    const first = await lockDataDir(dataDir, { command: "serve", platform });
    const err = await lockDataDir(dataDir, { command: "serve", platform }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(DispatchCloudError);
    expect((err as DispatchCloudError).code).toBe("serve.data_dir_in_use");
    expect((err as DispatchCloudError).message).toContain(`the data directory ${dataDir} is in use by`);
    expect((err as DispatchCloudError).message).toContain(`(pid ${process.pid}, started `);
    await first.release();
    const again = await lockDataDir(dataDir, { command: "serve", platform });
    await again.release();

    // A holder that dies without releasing (SIGKILL) leaves nothing that blocks the next one.
    const holder = await holderProcess(dataDir, platform);
    const busy = await lockDataDir(dataDir, { command: "serve", platform }).catch((e: unknown) => e);
    expect((busy as DispatchCloudError).message).toContain(`(pid ${holder.pid}, started `);
    await killed(holder);
    const taken = await lockDataDir(dataDir, { command: "serve", platform });
    await taken.release();
  }, 60_000);
});

describe("serve", () => {
  it("exits non-zero, naming the key, when it cannot listen (instead of hanging)", async () => {
    const dir = await tempDir("dc-listen-");
    const blocker = net.createServer();
    await new Promise<void>((ok) => blocker.listen(0, "127.0.0.1", ok));
    const port = (blocker.address() as net.AddressInfo).port;
    const config = path.join(dir, "config.yml");
    await writeFile(
      config,
      `clusterId: lst01\ndataDir: ${dir}/data\nrestServer: {listen: "127.0.0.1:${port}"}\nmanagement: {listen: "127.0.0.1:0"}\nlogging: {level: warn}\n`,
    );
    const r = await runBin(["serve", "--config", config]);
    blocker.close();
    expect(r.code, r.stderr).toBe(1);
    expect(r.stderr).toContain(
      `cannot listen on 127.0.0.1:${port} (restServer.listen): the address is in use by another process`,
    );
    expect(r.stderr).toContain("[serve.cannot_listen]");
  }, 120_000);

  it("keeps its data directory private: 0700, the database's files and the tokens unreadable by others", async () => {
    // A data directory an older version left open (0755) is tightened before anything is written to it.
    const parent = await tempDir("dc-private-");
    await chmod(parent, 0o755);
    await mkdir(path.join(parent, "data"), { mode: 0o755 });
    await chmod(path.join(parent, "data"), 0o755);
    const s = await startServe("", { dir: parent });
    try {
      const data = path.join(parent, "data");
      expect((await stat(data)).mode & 0o777).toBe(0o700);
      expect((await stat(path.join(data, "admin-token"))).mode & 0o777).toBe(0o600);
      const open: string[] = [];
      const walk = async (d: string): Promise<void> => {
        for (const e of await readdir(d, { withFileTypes: true })) {
          const p = path.join(d, e.name);
          if ((await stat(p)).mode & 0o077) open.push(p);
          if (e.isDirectory()) await walk(p);
        }
      };
      await walk(path.join(data, "pglite"));
      expect(open).toEqual([]);
      expect(s.stderr()).toContain("the data directory was readable by others; it is now private (0700)");
      // Another local user can read none of it.
      const user = process.env["DISPATCH_CLOUD_TEST_VM_USER"] ?? "dcvm";
      if (process.getuid?.() !== 0) throw new Error("this check runs as root (the test command does)");
      const other = await new Promise<{ code: number | null; out: string }>((ok) => {
        execFile(
          "su",
          [user, "-s", "/bin/sh", "-c", `cat '${data}/admin-token'; ls '${data}/pglite'`],
          (err, stdout, stderr) => ok({ code: err === null ? 0 : 1, out: stdout + stderr }),
        );
      });
      expect(other.code).not.toBe(0);
      expect(other.out).toContain("Permission denied");
      expect(other.out).not.toContain("dcu_");
    } finally {
      await s.stop();
    }
  }, 120_000);
});

describe("the CLI's output to a closed pipe", () => {
  it("ends quietly: no stack trace, exit 0 or 141", async () => {
    const r = await new Promise<{ status: string; stderr: string; stdout: string }>((ok) => {
      execFile(
        "bash",
        ["-c", `set -o pipefail; '${BIN}' config defaults | head -n 1; echo "status=\${PIPESTATUS[0]}"`],
        (_err, stdout, stderr) => ok({ status: /status=(\d+)/.exec(stdout)?.[1] ?? "?", stderr, stdout }),
      );
    });
    expect(r.stdout.split("\n")[0]).toMatch(/^# /);
    expect(["0", "141"]).toContain(r.status);
    expect(r.stderr).not.toMatch(/EPIPE|Error|\n\s+at /);
  }, 60_000);
});

describe("logs for people", () => {
  it("are text at a terminal and JSON otherwise when logging.format is auto (the default)", () => {
    const tty = Object.assign(new Writable({ write: (_c, _e, done) => done() }), { isTTY: true });
    const pipe = new Writable({ write: (_c, _e, done) => done() });
    expect(resolveLogFormat("auto", tty)).toBe("text");
    expect(resolveLogFormat("auto", pipe)).toBe("json");
    expect(resolveLogFormat("json", tty)).toBe("json");
    const lines: string[] = [];
    const terminal = Object.assign(
      new Writable({
        write(chunk: Buffer, _e, done) {
          lines.push(chunk.toString());
          done();
        },
      }),
      { isTTY: true },
    );
    createLogger({ level: "info", format: "auto", destination: terminal }).info({ n: 1 }, "hello");
    expect(lines.join("")).toMatch(/ INFO hello n=1\n$/);
  });

  it("have one line per HTTP request, at debug; none at info", async () => {
    const db = await openTestDb("pglite");
    try {
      for (const level of ["info", "debug"] as const) {
        const lines: Array<Record<string, unknown>> = [];
        const logger = createLogger({
          level,
          format: "json",
          destination: new Writable({
            write(chunk: Buffer, _e, done) {
              for (const l of chunk.toString().split("\n")) if (l !== "") lines.push(JSON.parse(l));
              done();
            },
          }),
        });
        const app = await createRestServer({
          db,
          logger,
          clusterId: "log01",
          maxRequestBodySize: 1 << 20,
          defaultMaxAttempts: 3,
          dataDir: await tempDir("dc-logs-"),
        });
        await app.inject({ url: "/_health/ping" });
        await app.close();
        const requestLines = lines.filter((l) => String(l["msg"]).includes("request"));
        if (level === "info") expect(requestLines).toEqual([]);
        else {
          expect(requestLines).toHaveLength(1);
          expect(requestLines[0]).toMatchObject({
            level: 20,
            method: "GET",
            url: "/_health/ping",
            statusCode: 200,
          });
        }
      }
    } finally {
      await db.close();
    }
  });

  it("keep a bundle's state changes at info: created (staged at once) and killed by a user", async () => {
    const db = await openTestDb("pglite");
    try {
      const lines: Array<Record<string, unknown>> = [];
      const logger = createLogger({
        level: "info",
        format: "json",
        destination: new Writable({
          write(chunk: Buffer, _e, done) {
            for (const l of chunk.toString().split("\n")) if (l !== "") lines.push(JSON.parse(l));
            done();
          },
        }),
      });
      const token = newUserToken();
      const user = await createUser(db, {
        uuid: newUserUuid("log02"),
        name: "logs",
        isAdmin: false,
        tokenHash: hashToken(token),
      });
      const app = await createRestServer({
        db,
        logger,
        clusterId: "log02",
        maxRequestBodySize: 1 << 20,
        defaultMaxAttempts: 3,
        dataDir: await tempDir("dc-logs-"),
      });
      const headers = { authorization: `Bearer ${token}` };
      const created = await app.inject({
        method: "POST",
        url: "/api/v1/bundles",
        headers,
        payload: { image: "busybox", command: ["true"] },
      });
      expect(created.statusCode, created.body).toBe(201);
      const uuid = (created.json() as { uuid: string }).uuid;
      const killed = await app.inject({ method: "POST", url: `/api/v1/bundles/${uuid}/kill`, headers });
      expect(killed.statusCode, killed.body).toBe(200);
      await app.close();
      expect(lines.filter((l) => l["bundleUuid"] === uuid)).toMatchObject([
        { level: 30, msg: "bundle created", owner: user.uuid, image: "busybox" },
        { level: 30, msg: "bundle killed", from: "staged", by: user.uuid },
      ]);
      expect(JSON.stringify(lines)).not.toContain(token);
    } finally {
      await db.close();
    }
  });
});
