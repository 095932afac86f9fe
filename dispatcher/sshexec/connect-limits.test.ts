/**
 * The connect limits shared by SSH executors, with the real executor: a TCP server that never answers stands for
 * instances whose handshake hangs, a real SSH server (embedded ssh2) for one that answers. FakeClock drives the
 * limits; what is asserted are counts (sockets the silent server accepted, callers waiting), never durations.
 */
import { createServer, type Socket } from "node:net";
import { afterEach, describe, expect, it, vi } from "vitest";
import { startEmbeddedSshServer } from "../../cloud-drivers/ssh-server.ts";
import { generateKeyPair } from "../../lib/ssh-keys.ts";
import { FakeClock, flushMicrotasks } from "../../test/fake-clock.ts";
import { silentLogger as logger } from "../../test/fixtures.ts";
import { CONNECT_COUNTS_FOR_MS, type ConnectLimits, createConnectLimits } from "./connect-limits.ts";
import { createSshExecutor, type SshExecutor } from "./executor.ts";

const pair = generateKeyPair();
const cleanups: (() => Promise<void>)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** Accepts TCP connections and never says a word: an SSH handshake to it hangs. */
async function silentServer(): Promise<{ port: number; accepted: () => number }> {
  const sockets = new Set<Socket>();
  let accepted = 0;
  const server = createServer((sock) => {
    accepted++;
    sockets.add(sock);
    sock.on("error", () => {});
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  cleanups.push(async () => {
    for (const s of sockets) s.destroy();
    await new Promise<void>((resolve) => server.close(() => resolve()));
  });
  const address = server.address();
  if (address === null || typeof address === "string") throw new Error("no port");
  return { port: address.port, accepted: () => accepted };
}

async function sshServer(): Promise<{ port: number }> {
  const server = await startEmbeddedSshServer({
    host: "127.0.0.1",
    hostKey: generateKeyPair().privateKey,
    authorizedKeys: [pair.publicKey],
    onExec: async (command, session) => {
      session.stdout.write(`ran ${command}\n`);
      return { exitCode: 0 };
    },
  });
  cleanups.push(() => server.close());
  return { port: server.port };
}

function executor(port: number, clock: FakeClock, connectLimits: ConnectLimits): SshExecutor {
  const exec = createSshExecutor({
    address: `127.0.0.1:${port}`,
    user: "root",
    privateKey: pair.privateKey,
    expectedSecret: null,
    logger,
    clock,
    connectLimits,
    keepaliveIntervalMs: 0,
  });
  cleanups.push(() => exec.close());
  return exec;
}

describe("SSH connect limits", () => {
  it("sets up at most maxConcurrent connections at once; one that hangs stops counting after CONNECT_COUNTS_FOR_MS", async () => {
    const clock = new FakeClock();
    const limits = createConnectLimits({ maxPerSecond: 0, maxConcurrent: 2, clock });
    const silent = await silentServer();
    const execs = Array.from({ length: 4 }, () => executor(silent.port, clock, limits));
    for (const e of execs) e.connect().catch(() => {});
    await vi.waitFor(() => expect(silent.accepted()).toBe(2));
    expect(limits.stats()).toMatchObject({ connecting: 2, waiting: 2 });
    // Given time, nobody else gets through while both handshakes hang.
    await new Promise((r) => setTimeout(r, 100));
    expect(silent.accepted()).toBe(2);
    await clock.advance(CONNECT_COUNTS_FOR_MS);
    await vi.waitFor(() => expect(silent.accepted()).toBe(4));
    expect(limits.stats()).toMatchObject({ waiting: 0, slow: 2, peak: 2 });
  });

  it("runs commands on an open connection while new connections wait for their turn", async () => {
    const clock = new FakeClock();
    const limits = createConnectLimits({ maxPerSecond: 0, maxConcurrent: 1, clock });
    const ssh = await sshServer();
    const silent = await silentServer();
    const open = executor(ssh.port, clock, limits);
    await open.connect();
    const hung = executor(silent.port, clock, limits);
    const queued = executor(ssh.port, clock, limits);
    hung.connect().catch(() => {});
    await vi.waitFor(() => expect(silent.accepted()).toBe(1));
    const late = queued.execute("true");
    late.catch(() => {});
    await flushMicrotasks();
    expect(limits.stats()).toMatchObject({ connecting: 1, waiting: 1 });
    const res = await open.execute("hostname");
    expect(res.stdout.toString()).toBe("ran hostname\n");
    expect(queued.stats().connected).toBe(false);
    expect(limits.stats().waiting).toBe(1);
  });

  it("starts at most maxPerSecond connections per second, in bursts of one second's worth", async () => {
    const clock = new FakeClock();
    const limits = createConnectLimits({ maxPerSecond: 2, maxConcurrent: 0, clock });
    const ssh = await sshServer();
    const execs = Array.from({ length: 5 }, () => executor(ssh.port, clock, limits));
    const connected = () => execs.filter((e) => e.stats().connected).length;
    const done = execs.map((e) => e.connect());
    await vi.waitFor(() => expect(connected()).toBe(2));
    await new Promise((r) => setTimeout(r, 100));
    expect(connected()).toBe(2);
    await clock.advance(500);
    await vi.waitFor(() => expect(connected()).toBe(3));
    await clock.advance(1000);
    await Promise.all(done);
    expect(connected()).toBe(5);
  });
});
