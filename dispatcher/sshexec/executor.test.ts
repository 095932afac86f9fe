import { createServer, type Server, type Socket } from "node:net";
import { afterEach, describe, expect, it, vi } from "vitest";
import { systemClock } from "../../lib/clock.ts";
import { generateKeyPair } from "../../lib/ssh-keys.ts";
import { FakeClock, flushMicrotasks } from "../../test/fake-clock.ts";
import { silentLogger as logger } from "../../test/fixtures.ts";
import { createSshExecutor, type SshExecutor } from "./executor.ts";

// Not ssh2.utils.generateKeyPairSync: about one key in 128 it makes cannot be parsed back (see lib/ssh-keys.ts).
const pair = generateKeyPair();
const key = { private: pair.privateKey, public: pair.publicKey };

/** A TCP server that counts connections and hangs up on each at once: every SSH connect attempt fails. */
async function hangUpServer(): Promise<{ server: Server; port: number; attempts: () => number }> {
  let attempts = 0;
  const server = createServer((sock) => {
    attempts++;
    sock.destroy();
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const address = server.address();
  if (address === null || typeof address === "string") throw new Error("no port");
  return { server, port: address.port, attempts: () => attempts };
}

const cleanups: (() => Promise<void>)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

describe("createSshExecutor", () => {
  it("rejects a key that cannot be parsed, without quoting it", () => {
    const bad =
      "-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-key-SECRETBITS\n-----END OPENSSH PRIVATE KEY-----\n";
    let err: unknown;
    try {
      createSshExecutor({
        address: "127.0.0.1",
        user: "u",
        privateKey: bad,
        expectedSecret: null,
        logger,
        clock: systemClock,
      });
    } catch (e) {
      err = e;
    }
    expect(err).toMatchObject({ code: "ssh.invalid_key" });
    expect(String((err as Error).message)).not.toContain("SECRETBITS");
  });

  it("rejects a public key given as the private key", () => {
    expect(() =>
      createSshExecutor({
        address: "127.0.0.1",
        user: "u",
        privateKey: key.public,
        expectedSecret: null,
        logger,
        clock: systemClock,
      }),
    ).toThrow(expect.objectContaining({ code: "ssh.invalid_key" }));
  });

  it("rejects a malformed address", () => {
    expect(() =>
      createSshExecutor({
        address: "host:notaport",
        user: "u",
        privateKey: key.private,
        expectedSecret: null,
        logger,
        clock: systemClock,
      }),
    ).toThrow(expect.objectContaining({ code: "ssh.connect_failed" }));
  });
});

describe("reconnect backoff (FakeClock)", () => {
  it("waits 1 s, 2 s, 4 s ... at most 30 s between failed connect attempts", async () => {
    const { server, port, attempts } = await hangUpServer();
    const clock = new FakeClock();
    const exec: SshExecutor = createSshExecutor({
      address: `127.0.0.1:${port}`,
      user: "u",
      privateKey: key.private,
      expectedSecret: "s",
      logger,
      clock,
    });
    cleanups.push(async () => {
      await exec.close();
      await new Promise((r) => server.close(r));
    });

    // The first attempt is immediate.
    await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.connect_failed" });
    expect(attempts()).toBe(1);
    expect(exec.stats().lastError).toMatchObject({ code: "ssh.connect_failed" });

    const expected = [1_000, 2_000, 4_000, 8_000, 16_000, 30_000, 30_000];
    for (const [i, delay] of expected.entries()) {
      // Two commands queued during the wait share one attempt.
      const a = exec.execute("true");
      const b = exec.execute("true");
      a.catch(() => {});
      b.catch(() => {});
      await clock.advance(delay - 1);
      await flushMicrotasks();
      expect(attempts()).toBe(i + 1);
      await clock.advance(1);
      await vi.waitFor(() => expect(attempts()).toBe(i + 2));
      await expect(a).rejects.toMatchObject({ code: "ssh.connect_failed" });
      await expect(b).rejects.toMatchObject({ code: "ssh.connect_failed" });
      expect(attempts()).toBe(i + 2);
    }
  });

  it("a command waiting out the backoff fails with ssh.closed when the executor closes", async () => {
    const { server, port } = await hangUpServer();
    const clock = new FakeClock();
    const exec = createSshExecutor({
      address: `127.0.0.1:${port}`,
      user: "u",
      privateKey: key.private,
      expectedSecret: "s",
      logger,
      clock,
    });
    cleanups.push(async () => {
      await new Promise((r) => server.close(r));
    });
    await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.connect_failed" });
    const waiting = exec.execute("true");
    await flushMicrotasks();
    await exec.close();
    await expect(waiting).rejects.toMatchObject({ code: "ssh.closed" });
    await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.closed" });
  });

  it("times out a command whose connect attempt never finishes (ssh.timeout, FakeClock)", async () => {
    // A server that accepts and says nothing: the SSH handshake hangs until the command's deadline.
    const socks: Socket[] = [];
    const silent = createServer((sock) => {
      socks.push(sock);
    });
    await new Promise<void>((resolve) => silent.listen(0, "127.0.0.1", resolve));
    const address = silent.address();
    if (address === null || typeof address === "string") throw new Error("no port");
    const clock = new FakeClock();
    const exec = createSshExecutor({
      address: `127.0.0.1:${address.port}`,
      user: "u",
      privateKey: key.private,
      expectedSecret: "s",
      logger,
      clock,
    });
    cleanups.push(async () => {
      await exec.close();
      for (const s of socks) s.destroy();
      await new Promise((r) => silent.close(r));
    });
    const p = exec.execute("probe --secret-arg", { timeoutMs: 5_000 });
    p.catch(() => {});
    await clock.advance(5_000);
    const err = await p.catch((e: unknown) => e);
    expect(err).toMatchObject({ code: "ssh.timeout" });
    expect((err as Error).message).toContain('"probe"');
    expect((err as Error).message).not.toContain("secret-arg");
  });
});
