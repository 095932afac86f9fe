/** The local VMs' SSH servers, against a real ssh2 client: the embedded server and Debian's sshd. */
import { createHash, randomBytes } from "node:crypto";
import { chmodSync, chownSync, mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import type ssh2 from "ssh2";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { isAlive, lookupUser } from "../cloud-drivers/local/procs.ts";
import { type OpenSshServer, startOpenSshServer } from "../cloud-drivers/local/ssh-openssh.ts";
import {
  type EmbeddedSshServer,
  generateKeyPair,
  startEmbeddedSshServer,
} from "../cloud-drivers/ssh-server.ts";
import { connect, processesUnder, requireOpenSsh, run, waitFor } from "./local-driver-helpers.ts";

const clientKey = generateKeyPair();

describe("embedded SSH server", () => {
  let server: EmbeddedSshServer;
  let client: ssh2.Client;
  const address = () => `${server.host}:${server.port}`;

  beforeAll(async () => {
    server = await startEmbeddedSshServer({
      host: "127.0.0.1",
      hostKey: generateKeyPair().privateKey,
      authorizedKeys: [clientKey.publicKey],
      env: { DISPATCH_VM_ROOT: "/some/root" },
    });
    client = await connect(address(), "anyone", clientKey.privateKey);
  });
  afterAll(async () => {
    client?.end();
    await server?.close();
  });

  it("runs commands with sh -c and its env, and reports exit codes", async () => {
    const r = await run(client, 'echo "root=$DISPATCH_VM_ROOT"; echo oops >&2; exit 3');
    expect(r).toEqual({ stdout: "root=/some/root\n", stderr: "oops\n", code: 3, signal: null });
    expect(server.connections).toBe(1);
  });

  it("refuses a key it was not given", async () => {
    await expect(connect(address(), "anyone", generateKeyPair().privateKey)).rejects.toThrow(
      /authentication methods failed/,
    );
  });

  it("delivers 10 MiB of stdin intact", async () => {
    const data = randomBytes(10 * 1024 * 1024);
    const r = await run(client, "sha256sum", { stdin: data });
    expect(r.code).toBe(0);
    expect(r.stdout.split(" ")[0]).toBe(createHash("sha256").update(data).digest("hex"));
  });

  it("reports a command killed by a signal", async () => {
    const r = await run(client, "kill -KILL $$");
    expect(r).toMatchObject({ code: null, signal: "SIGKILL" });
  });

  it("forwards the client's signal to the command's whole process group", async () => {
    let child = 0;
    const r = await run(client, "sleep 60 & echo $!; wait", {
      onChannel: (ch) =>
        ch.once("data", (d: Buffer) => {
          child = Number(d.toString().trim());
          ch.signal("TERM");
        }),
    });
    expect(r.signal).toBe("SIGTERM");
    expect(child).toBeGreaterThan(0);
    await waitFor("the backgrounded sleep to die", () => !isAlive(child));
  });

  it("kills a dead client's commands", async () => {
    const doomed = await connect(address(), "anyone", clientKey.privateKey);
    const pid = await new Promise<number>((resolve, reject) => {
      doomed.exec("sleep 60 & echo $!; wait", (err, ch) => {
        if (err) reject(err);
        else ch.once("data", (d: Buffer) => resolve(Number(d.toString().trim())));
      });
    });
    expect(isAlive(pid)).toBe(true);
    doomed.destroy();
    await waitFor("the dead client's command to be killed", () => !isAlive(pid));
  });

  it("runs a custom exec handler, aborting it when the client signals", async () => {
    const custom = await startEmbeddedSshServer({
      host: "127.0.0.1",
      hostKey: generateKeyPair().privateKey,
      authorizedKeys: [clientKey.publicKey],
      onExec: async (command, session) => {
        session.stdout.write(`ran ${command}\n`);
        await new Promise((resolve) => session.signal.addEventListener("abort", resolve));
        session.stderr.write(`aborted by ${String(session.signal.reason)}\n`);
        return { exitCode: null, signal: String(session.signal.reason) };
      },
    });
    try {
      const c = await connect(`127.0.0.1:${custom.port}`, "x", clientKey.privateKey);
      const r = await run(c, "hello", { onChannel: (ch) => ch.once("data", () => ch.signal("INT")) });
      c.end();
      expect(r).toEqual({
        stdout: "ran hello\n",
        stderr: "aborted by SIGINT\n",
        code: null,
        signal: "SIGINT",
      });
    } finally {
      await custom.close();
    }
  });
});

describe("OpenSSH sshd in its own mount namespace", () => {
  let dir: string;
  let server: OpenSshServer;
  let user: string;
  const host = "127.0.4.2";

  beforeAll(async () => {
    user = requireOpenSsh();
    const ids = lookupUser(user);
    if (ids === undefined) throw new Error(`no user ${user}; run eval "$(bash scripts/test-services.sh)"`);
    dir = mkdtempSync(path.join(tmpdir(), "local-driver-sshd-"));
    const root = path.join(dir, "root");
    mkdirSync(path.join(root, "var/run"), { recursive: true });
    for (const d of [root, path.join(root, "var"), path.join(root, "var/run")])
      chownSync(d, ids.uid, ids.gid);
    chmodSync(dir, 0o711);
    const started = Date.now();
    server = await startOpenSshServer({
      host,
      user,
      authorizedKeys: [clientKey.publicKey],
      rootDir: root,
      stateDir: path.join(dir, "sshd"),
    });
    console.log(`sshd started in ${Date.now() - started} ms`);
  });
  afterAll(async () => {
    await server?.stop();
    if (dir !== undefined) {
      expect(processesUnder(dir)).toEqual([]);
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("runs sessions as the login user with DISPATCH_VM_ROOT and private /tmp and /var/run", async () => {
    const c = await connect(`${host}:22`, user, clientKey.privateKey);
    try {
      const r = await run(
        c,
        'id -un; echo "$DISPATCH_VM_ROOT"; echo x > "$DISPATCH_VM_ROOT/var/run/f" && cat "$DISPATCH_VM_ROOT/var/run/f"; ls -A /tmp',
      );
      expect(r.code).toBe(0);
      const [who, root, f, ...tmp] = r.stdout.trim().split("\n");
      expect(who).toBe(user);
      expect(root).toBe(path.join(dir, "root"));
      expect(f).toBe("x");
      // The private /tmp shows only what was bound back in (the path to the test directory), nothing else of /tmp.
      expect(tmp.length).toBeLessThanOrEqual(1);
    } finally {
      c.end();
    }
  });

  it("allows 10 concurrent channels on one connection and refuses the 11th (MaxSessions 10)", async () => {
    const c = await connect(`${host}:22`, user, clientKey.privateKey);
    try {
      const channels: ssh2.ClientChannel[] = [];
      const opened = await Promise.allSettled(
        Array.from(
          { length: 11 },
          () =>
            new Promise<ssh2.ClientChannel>((resolve, reject) =>
              c.exec("cat", (err, ch) => {
                if (err) reject(err);
                else {
                  channels.push(ch);
                  resolve(ch);
                }
              }),
            ),
        ),
      );
      expect(opened.filter((o) => o.status === "fulfilled")).toHaveLength(10);
      const refused = opened.filter((o) => o.status === "rejected");
      expect(refused).toHaveLength(1);
      expect(String((refused[0] as PromiseRejectedResult).reason)).toMatch(/open failed|failure/i);
      // The ten open ones all work.
      const outputs = await Promise.all(
        channels.map(
          (ch, i) =>
            new Promise<string>((resolve) => {
              let out = "";
              ch.on("data", (d: Buffer) => {
                out += d.toString();
              });
              ch.on("close", () => resolve(out));
              ch.stderr.resume();
              ch.end(`channel ${i}\n`);
            }),
        ),
      );
      expect(outputs).toEqual(channels.map((_, i) => `channel ${i}\n`));
    } finally {
      c.end();
    }
  });
});
