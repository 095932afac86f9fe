/**
 * The SSH executor's tests against a real server, run once per server kind (test/sshexec-embedded.test.ts,
 * test/sshexec-openssh.test.ts). A "VM" here is a root directory with the instance secret file, served by a
 * server that can be stopped and started again on the same address and port.
 */
import { createHash, randomBytes } from "node:crypto";
import { chmodSync, chownSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { Readable } from "node:stream";
import ssh2 from "ssh2";
import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from "vitest";
import { lookupUser } from "../cloud-drivers/local/procs.ts";
import {
  generateKeyPair,
  openSshUnavailable,
  startOpenSshServer,
} from "../cloud-drivers/local/ssh-openssh.ts";
import { startEmbeddedSshServer } from "../cloud-drivers/ssh-server.ts";
import {
  createSshExecutor,
  type SshExecutor,
  type SshExecutorOptions,
} from "../dispatcher/sshexec/executor.ts";
import { systemClock } from "../lib/clock.ts";
import { createLogger } from "../lib/logger.ts";

export type ServerKind = "embedded" | "openssh";

const logger = createLogger({
  level: process.env["DISPATCH_CLOUD_TEST_LOG_LEVEL"] ?? "silent",
  format: "text",
});
const HINT = 'run `eval "$(bash scripts/test-services.sh)"` as root (installs sshd, creates the dcvm user)';
const SECRET_FILE = "var/run/dispatch-cloud-instance-secret";

interface Vm {
  address: string;
  user: string;
  root: string;
  authorizedKey: string;
  privateKey: string;
  start(): Promise<void>;
  stop(): Promise<void>;
  writeSecret(secret: string): void;
  /** A path inside the VM root that the login user can write. */
  file(name: string): string;
}

let nextHost = 1;
/** A loopback address of its own for each sshd of this process. */
function loopbackHost(): string {
  return `127.${100 + (process.pid % 100)}.${(process.pid >> 7) % 250}.${nextHost++}`;
}

async function createVm(kind: ServerKind): Promise<Vm> {
  const user = process.env["DISPATCH_CLOUD_TEST_VM_USER"] ?? "dcvm";
  let owner: { uid: number; gid: number } | undefined;
  if (kind === "openssh") {
    const why = openSshUnavailable();
    if (why !== undefined) throw new Error(`cannot run sshd for these tests: ${why}`);
    owner = lookupUser(user);
    if (owner === undefined) throw new Error(`the test VM user "${user}" does not exist; ${HINT}`);
  }
  const base = mkdtempSync(path.join(tmpdir(), `sshexec-${kind}-`));
  const root = path.join(base, "root");
  mkdirSync(path.join(root, "var/run"), { recursive: true });
  const chown = (p: string) => owner && chownSync(p, owner.uid, owner.gid);
  for (const p of [root, path.join(root, "var"), path.join(root, "var/run")]) chown(p);
  const keys = generateKeyPair();
  const hostKey = generateKeyPair().privateKey;
  const host = kind === "openssh" ? loopbackHost() : "127.0.0.1";
  let port = 0;
  let stopFn: (() => Promise<void>) | null = null;

  const vm: Vm = {
    address: "",
    user,
    root,
    authorizedKey: keys.publicKey,
    privateKey: keys.privateKey,
    async start() {
      if (kind === "embedded") {
        const server = await startEmbeddedSshServer({
          host,
          port,
          hostKey,
          authorizedKeys: [keys.publicKey],
          env: { DISPATCH_VM_ROOT: root },
          streamLocalUnder: root,
          logger,
        });
        port = server.port;
        stopFn = () => server.close();
      } else {
        if (port === 0) port = 2222;
        const server = await startOpenSshServer({
          host,
          port,
          user,
          authorizedKeys: [keys.publicKey],
          rootDir: root,
          stateDir: path.join(base, "sshd"),
          logger,
        });
        stopFn = () => server.stop();
      }
      vm.address = `${host}:${port}`;
    },
    async stop() {
      await stopFn?.();
      stopFn = null;
    },
    writeSecret(secret: string) {
      const file = path.join(root, SECRET_FILE);
      rmSync(file, { force: true });
      writeFileSync(file, secret, { mode: 0o600 });
      chown(file);
    },
    file(name: string) {
      return path.join(root, name);
    },
  };
  await vm.start();
  cleanupBase.push(() => rmSync(base, { recursive: true, force: true }));
  return vm;
}

const cleanupBase: (() => void)[] = [];

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

async function waitUntil(cond: () => boolean, timeoutMs: number): Promise<boolean> {
  const end = Date.now() + timeoutMs;
  while (Date.now() < end) {
    if (cond()) return true;
    await new Promise((r) => setTimeout(r, 20));
  }
  return cond();
}

function percentile(values: number[], p: number): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))] ?? Number.NaN;
}

export function sshExecutorSuite(kind: ServerKind): void {
  describe(`SSH executor against the ${kind} server`, () => {
    let vm: Vm;
    const secret = randomBytes(24).toString("hex");
    const executors: SshExecutor[] = [];

    const executor = (over: Partial<SshExecutorOptions> = {}): SshExecutor => {
      const exec = createSshExecutor({
        address: vm.address,
        user: vm.user,
        privateKey: vm.privateKey,
        expectedSecret: secret,
        name: `vm-${kind}`,
        logger,
        clock: systemClock,
        connectTimeoutMs: 10_000,
        ...over,
      });
      executors.push(exec);
      return exec;
    };

    beforeAll(async () => {
      vm = await createVm(kind);
      vm.writeSecret(secret);
    });
    afterEach(async () => {
      for (const e of executors.splice(0)) await e.close();
      vm.writeSecret(secret);
    });
    afterAll(async () => {
      await vm?.stop();
      for (const c of cleanupBase.splice(0)) c();
    });

    it("exchanges a payload with a unix socket on the instance over the same connection", async () => {
      const sock = vm.file("var/run/echo.sock");
      const server = net.createServer({ allowHalfOpen: true }, (c) => {
        let text = "";
        c.on("data", (d: Buffer) => {
          text += d.toString();
        });
        c.on("end", () => c.end(text.toUpperCase()));
      });
      await new Promise<void>((ok) => server.listen(sock, ok));
      chmodSync(sock, 0o777); // sshd's session runs as the VM user
      try {
        const exec = executor();
        expect((await exec.exchange(sock, "hand this to the spare")).toString()).toBe(
          "HAND THIS TO THE SPARE",
        );
        await expect(exec.exchange(vm.file("var/run/nobody.sock"), "x")).rejects.toMatchObject({
          code: "ssh.closed",
        });
        // The connection stays usable, and it is still the only one.
        expect((await exec.execute("true")).exitCode).toBe(0);
        expect(exec.stats().connections).toBe(1);
      } finally {
        server.close();
      }
    });

    it("opens an exchange's channel before its promised payload is made; null closes it unused", async () => {
      const sock = vm.file("var/run/later.sock");
      const connected: Array<() => void> = [];
      const received: string[] = [];
      const server = net.createServer({ allowHalfOpen: true }, (c) => {
        let text = "";
        connected.shift()?.();
        c.on("error", () => {}); // the unused channel closes without reading an answer (EPIPE)
        c.on("data", (d: Buffer) => {
          text += d.toString();
        });
        c.on("end", () => {
          received.push(text);
          c.end(text === "" ? "" : `got ${text}`);
        });
      });
      await new Promise<void>((ok) => server.listen(sock, ok));
      chmodSync(sock, 0o777);
      try {
        const exec = executor();
        await exec.connect();
        const reached = () => new Promise<void>((ok) => connected.push(ok));
        let give: (p: string | null) => void = () => {};
        const payload = new Promise<string | null>((ok) => {
          give = ok;
        });
        const first = reached();
        const answer = exec.exchange(sock, payload);
        // The socket is connected while the payload is still being made.
        await first;
        expect(received).toEqual([]);
        give("the document");
        expect((await answer).toString()).toBe("got the document");

        let cancel: (p: string | null) => void = () => {};
        const second = reached();
        const unused = exec.exchange(
          sock,
          new Promise<string | null>((ok) => {
            cancel = ok;
          }),
        );
        await second;
        cancel(null);
        expect((await unused).length).toBe(0);
        await vi.waitFor(() => expect(received).toEqual(["the document", ""]));
        expect(exec.stats()).toMatchObject({ connections: 1, openChannels: 0, running: 0 });
      } finally {
        server.close();
      }
    });

    it("with exchangeAhead, holds a channel to the last exchange's socket open for the next one", async () => {
      const sockA = vm.file("var/run/ahead-a.sock");
      const sockB = vm.file("var/run/ahead-b.sock");
      // Each server's connections in the order accepted: what came on each, and whether it has closed.
      type Seen = { sock: net.Socket; text: string; closed: boolean };
      const listen = async (path: string) => {
        const seen: Seen[] = [];
        const server = net.createServer({ allowHalfOpen: true }, (c) => {
          const one: Seen = { sock: c, text: "", closed: false };
          seen.push(one);
          c.on("error", () => {});
          c.on("data", (d: Buffer) => {
            one.text += d.toString();
          });
          c.on("end", () => c.end(`got ${one.text}`));
          c.on("close", () => {
            one.closed = true;
          });
        });
        await new Promise<void>((ok) => server.listen(path, ok));
        chmodSync(path, 0o777);
        return { server, seen };
      };
      const a = await listen(sockA);
      const b = await listen(sockB);
      try {
        const exec = executor({ exchangeAhead: true });
        expect((await exec.exchange(sockA, "one")).toString()).toBe("got one");
        // The next channel is accepted while idle, and the next exchange's payload goes on it.
        await vi.waitFor(() => expect(a.seen.length).toBe(2));
        expect(a.seen[1]).toMatchObject({ text: "", closed: false });
        expect((await exec.exchange(sockA, Promise.resolve("two"))).toString()).toBe("got two");
        expect(a.seen[1]?.text).toBe("two");
        await vi.waitFor(() => expect(a.seen.length).toBe(3));

        // The socket's server drops the idle channel (a pool going away): the executor lets it go, and the next
        // exchange opens a channel of its own.
        a.seen[2]?.sock.destroy();
        await vi.waitFor(() => expect(exec.stats().channelAhead).toBe(false));
        expect((await exec.exchange(sockA, "three")).toString()).toBe("got three");
        expect(a.seen[3]?.text).toBe("three");
        await vi.waitFor(() => expect(a.seen.length).toBe(5));

        // An exchange with another socket closes the one held for the first, and holds one for itself.
        expect((await exec.exchange(sockB, "four")).toString()).toBe("got four");
        await vi.waitFor(() => expect(a.seen[4]?.closed).toBe(true));
        await vi.waitFor(() => expect(b.seen.length).toBe(2));
        expect(exec.stats()).toMatchObject({ channelAhead: true, connections: 1, running: 0 });

        // Closing the executor closes the channel held.
        await exec.close();
        await vi.waitFor(() => expect(b.seen[1]?.closed).toBe(true));
        expect(a.seen.map((s) => s.text)).toEqual(["one", "two", "", "three", ""]);

        // A socket's server that speaks before it is sent anything (not a warm pool; odd bytes): its idle
        // channel is dropped, never handed to the next exchange with what it said.
        const sockC = vm.file("var/run/ahead-c.sock");
        const chatty: string[] = [];
        const c = net.createServer({ allowHalfOpen: true }, (conn) => {
          let text = "";
          conn.on("error", () => {});
          conn.write("\x00\xffunasked\n");
          conn.on("data", (d: Buffer) => {
            text += d.toString();
          });
          conn.on("end", () => {
            chatty.push(text);
            conn.end(`got ${text}`);
          });
        });
        await new Promise<void>((ok) => c.listen(sockC, ok));
        chmodSync(sockC, 0o777);
        try {
          const talker = executor({ exchangeAhead: true });
          expect((await talker.exchange(sockC, "six")).toString()).toContain("got six");
          await vi.waitFor(() => expect(talker.stats().channelAhead).toBe(false));
          const seven = (await talker.exchange(sockC, "seven")).toString();
          expect(seven).toBe("\x00\xffunasked\ngot seven");
          expect(chatty).toContain("seven");
        } finally {
          c.close();
        }

        // Without exchangeAhead nothing is opened beyond the exchange's own channel.
        const plain = executor();
        expect((await plain.exchange(sockB, "five")).toString()).toBe("got five");
        expect(plain.stats().channelAhead).toBe(false);
        expect(b.seen.length).toBe(3);
      } finally {
        a.server.close();
        b.server.close();
      }
    });

    it("gives each leg of an exchange its own deadline; a payload never made is not the instance's error", async () => {
      const sock = vm.file("var/run/slow.sock");
      const server = net.createServer({ allowHalfOpen: true }, (c) => {
        let text = "";
        c.on("error", () => {});
        c.on("data", (d: Buffer) => {
          text += d.toString();
        });
        // Answers 700 ms after the payload, which itself comes 700 ms after the channel: 1.4 s in all.
        c.on("end", () => setTimeout(() => c.end(`late ${text}`), 700));
      });
      await new Promise<void>((ok) => server.listen(sock, ok));
      chmodSync(sock, 0o777);
      try {
        const exec = executor();
        await exec.connect();
        const slowPayload = new Promise<string>((ok) => setTimeout(() => ok("doc"), 700));
        expect((await exec.exchange(sock, slowPayload, { timeoutMs: 1000 })).toString()).toBe("late doc");

        const never = new Promise<string | null>(() => {});
        await expect(exec.exchange(sock, never, { timeoutMs: 300 })).rejects.toMatchObject({
          code: "ssh.timeout",
          message: expect.stringContaining("nothing to send in 300 ms"),
        });
        expect(exec.stats()).toMatchObject({ lastError: null, openChannels: 0, running: 0, connections: 1 });
      } finally {
        server.close();
      }
    });

    it("returns output and exit status; a non-zero exit or a signal is not an error", async () => {
      const exec = executor();
      const r = await exec.execute('echo out; echo err >&2; echo "root=$DISPATCH_VM_ROOT"; exit 3');
      expect(r.exitCode).toBe(3);
      expect(r.signal).toBeNull();
      expect(r.stdout.toString()).toBe(`out\nroot=${vm.root}\n`);
      expect(r.stderr.toString()).toBe("err\n");
      expect(r.stdoutTruncated).toBe(false);

      const ok = await exec.execute("true");
      expect(ok.exitCode).toBe(0);
      const killed = await exec.execute("kill -TERM $$");
      expect(killed).toMatchObject({ exitCode: null, signal: "SIGTERM" });
      expect(exec.stats()).toMatchObject({ connected: true, connections: 1, openChannels: 0, running: 0 });
    });

    it("runs 50 concurrent commands over one connection, never more than maxChannels channels at once", async () => {
      const exec = executor({ maxChannels: 8 });
      const results = await Promise.all(
        Array.from({ length: 50 }, (_, i) => exec.execute(`sleep 0.2; echo ${i}`)),
      );
      expect(results.map((r) => r.exitCode)).toEqual(Array(50).fill(0));
      expect(results.map((r) => r.stdout.toString())).toEqual(Array.from({ length: 50 }, (_, i) => `${i}\n`));
      const stats = exec.stats();
      expect(stats.connections).toBe(1);
      expect(stats.peakChannels).toBe(8);
      expect(stats).toMatchObject({ openChannels: 0, running: 0, queued: 0 });
    });

    if (kind === "openssh") {
      it("sshd refuses channels past MaxSessions (10): without the limiter, opens fail, and are retried", async () => {
        // A bare ssh2 client opening 50 channels at once sees the server's refusals.
        const client = new ssh2.Client();
        await new Promise<void>((resolve, reject) => {
          client.once("ready", resolve).once("error", reject);
          const [host = "", port] = vm.address.split(":");
          client.connect({ host, port: Number(port), username: vm.user, privateKey: vm.privateKey });
        });
        const outcomes = await Promise.all(
          Array.from(
            { length: 50 },
            () =>
              new Promise<string>((resolve) => {
                client.exec("sleep 0.5", (err, ch) => {
                  if (err) resolve(err.message);
                  else ch.on("close", () => resolve("ok")).resume();
                });
              }),
          ),
        );
        client.end();
        const refused = outcomes.filter((o) => o !== "ok");
        expect(refused.length).toBeGreaterThanOrEqual(40);
        expect(refused[0]).toMatch(/open failed/);

        // The executor with a limit above the server's still gets every command through by retrying.
        const exec = executor({ maxChannels: 50, channelRetryMs: 50 });
        const results = await Promise.all(
          Array.from({ length: 50 }, () => exec.execute("sleep 0.2; echo ok")),
        );
        expect(results.every((r) => r.exitCode === 0 && r.stdout.toString() === "ok\n")).toBe(true);
        expect(exec.stats().connections).toBe(1);
      });
    }

    it("survives a server restart: the running command fails with ssh.closed, the next one reconnects", async () => {
      const exec = executor();
      expect((await exec.execute("echo before")).stdout.toString()).toBe("before\n");
      // Ignore TERM so the command cannot end with a status of its own while the server goes down.
      const inFlight = exec.execute("trap '' TERM HUP; sleep 30");
      inFlight.catch(() => {});
      await waitUntil(() => exec.stats().openChannels === 1, 5_000);
      await vm.stop();
      await expect(inFlight).rejects.toMatchObject({ code: "ssh.closed" });
      expect(exec.stats().connected).toBe(false);
      await vm.start();
      const after = await exec.execute("echo after");
      expect(after.stdout.toString()).toBe("after\n");
      expect(exec.stats().connections).toBe(2);
    });

    it("checks identity again on every new connection", async () => {
      const exec = executor();
      await exec.execute("true");
      await vm.stop();
      vm.writeSecret("another-hosts-secret");
      await vm.start();
      await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.host_mismatch" });
    });

    it("kills a command past its timeout and reports ssh.timeout; the connection stays usable", async () => {
      const exec = executor();
      const pidFile = vm.file("timeout.pids");
      const cmd = `sleep 1000 & echo $! > ${pidFile}; echo $$ >> ${pidFile}; wait`;
      const started = Date.now();
      const err = await exec.execute(cmd, { timeoutMs: 1_000 }).catch((e: unknown) => e);
      expect(err).toMatchObject({ code: "ssh.timeout", message: expect.stringContaining('"sleep"') });
      expect((err as Error).message).not.toContain(pidFile);
      expect(Date.now() - started).toBeLessThan(5_000);
      const pids = readFileSync(pidFile, "utf8").trim().split("\n").map(Number);
      expect(pids).toHaveLength(2);
      expect(await waitUntil(() => pids.every((p) => !isAlive(p)), 5_000)).toBe(true);
      const next = await exec.execute("echo still");
      expect(next.stdout.toString()).toBe("still\n");
      expect(exec.stats().connections).toBe(1);
      expect(await waitUntil(() => exec.stats().openChannels === 0, 5_000)).toBe(true);
    });

    it("streams 10 MiB of stdin intact (Readable with backpressure, and Buffer)", async () => {
      const exec = executor();
      const data = randomBytes(10 * 1024 * 1024);
      const sha = createHash("sha256").update(data).digest("hex");
      const chunks = Array.from({ length: 160 }, (_, i) => data.subarray(i * 65536, (i + 1) * 65536));
      const fromStream = await exec.execute("sha256sum", { stdin: Readable.from(chunks) });
      expect(fromStream.exitCode).toBe(0);
      expect(fromStream.stdout.toString().split(" ")[0]).toBe(sha);
      const fromBuffer = await exec.execute("sha256sum", { stdin: data });
      expect(fromBuffer.stdout.toString().split(" ")[0]).toBe(sha);
      const fromString = await exec.execute("cat", { stdin: "héllo\n" });
      expect(fromString.stdout.toString()).toBe("héllo\n");
    });

    it("fails a command whose stdin stream errors with ssh.closed, and kills it", async () => {
      const exec = executor();
      const pidFile = vm.file("stdin.pid");
      const stdin = new Readable({ read() {} });
      const p = exec.execute(`echo $$ > ${pidFile}; exec cat > /dev/null`, { stdin });
      stdin.push(Buffer.alloc(1024));
      await waitUntil(() => {
        try {
          return readFileSync(pidFile, "utf8").trim() !== "";
        } catch {
          return false;
        }
      }, 5_000);
      stdin.destroy(new Error("disk read failed"));
      await expect(p).rejects.toMatchObject({
        code: "ssh.closed",
        message: expect.stringContaining("stdin"),
      });
      const pid = Number(readFileSync(pidFile, "utf8").trim());
      expect(await waitUntil(() => !isAlive(pid), 5_000)).toBe(true);
      expect((await exec.execute("echo fine")).stdout.toString()).toBe("fine\n");
    });

    it("close() fails running and queued commands with ssh.closed and refuses new ones", async () => {
      const exec = executor({ maxChannels: 1 });
      const running = exec.execute("sleep 30");
      const queued = exec.execute("echo never");
      running.catch(() => {});
      queued.catch(() => {});
      await waitUntil(() => exec.stats().openChannels === 1, 5_000);
      expect(exec.stats()).toMatchObject({ running: 1, queued: 1 });
      await exec.close();
      await expect(running).rejects.toMatchObject({ code: "ssh.closed" });
      await expect(queued).rejects.toMatchObject({ code: "ssh.closed" });
      await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.closed" });
    });

    it("caps collected output and flags the truncation", async () => {
      const exec = executor({ maxOutputBytes: 1024 * 1024 });
      const r = await exec.execute("head -c 3000000 /dev/zero; echo tail >&2");
      expect(r.exitCode).toBe(0);
      expect(r.stdout.length).toBe(1024 * 1024);
      expect(r.stdoutTruncated).toBe(true);
      expect(r.stderr.toString()).toBe("tail\n");
      expect(r.stderrTruncated).toBe(false);
    });

    it("refuses a host whose secret file does not match, and every command after", async () => {
      vm.writeSecret("not-the-expected-secret");
      const exec = executor();
      const marker = vm.file("ran-after-mismatch");
      const err = await exec.execute(`touch ${marker}`).catch((e: unknown) => e);
      expect(err).toMatchObject({ code: "ssh.host_mismatch" });
      const message = (err as Error).message;
      expect(message).toContain(vm.address);
      expect(message).toContain(`vm-${kind}`);
      expect(message).not.toContain(secret);
      expect(message).not.toContain("not-the-expected-secret");
      // Permanently, even once the file is right again (a new connection would be made otherwise).
      vm.writeSecret(secret);
      await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.host_mismatch" });
      expect(exec.stats()).toMatchObject({ connected: false, connections: 0 });
      expect(() => readFileSync(marker)).toThrow();
    });

    it("treats a missing secret file as not booted yet, and connects once it is written", async () => {
      rmSync(vm.file(SECRET_FILE));
      const exec = executor();
      await expect(exec.execute("true")).rejects.toMatchObject({
        code: "ssh.not_ready",
        message: expect.stringContaining("no secret file yet"),
      });
      await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.not_ready" });
      vm.writeSecret(secret);
      await expect(exec.execute("echo ok")).resolves.toMatchObject({ exitCode: 0 });
      expect(exec.stats()).toMatchObject({ connected: true, connections: 1 });
    });

    it("fails with ssh.connect_failed for a key the server does not accept", async () => {
      const exec = executor({ privateKey: generateKeyPair().privateKey });
      await expect(exec.execute("true")).rejects.toMatchObject({
        code: "ssh.connect_failed",
        message: expect.stringContaining("authentication failed"),
      });
      expect(exec.stats().lastError).toMatchObject({ code: "ssh.connect_failed" });
    });

    it("keeps every exit status over many quick commands, and measures their latency", async () => {
      // A quick command's exit status can arrive in the same read as the exec reply (about 1 in 40 with
      // sshd): 300 commands catch an executor that would lose it.
      const exec = executor();
      await exec.execute("true");
      const times: number[] = [];
      for (let i = 0; i < 300; i++) {
        const t0 = performance.now();
        const r = await exec.execute(`exit ${i % 3}`);
        times.push(performance.now() - t0);
        expect(r.exitCode).toBe(i % 3);
      }
      const p50 = percentile(times, 50);
      const p90 = percentile(times, 90);
      console.log(
        `sshexec ${kind} (${kind === "openssh" ? `as ${vm.user}` : "in-process server"}): p50 ${p50.toFixed(1)} ms, p90 ${p90.toFixed(1)} ms (300 commands)`,
      );
      expect(p50).toBeLessThan(500);
    });
  });
}
