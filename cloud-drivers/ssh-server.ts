/**
 * An SSH server in this process (ssh2), for local VMs and tests: public-key authentication against a fixed
 * list of keys, `exec` requests (no shell, pty or subsystems) and, under one directory, channels to unix
 * sockets (direct-streamlocal, as OpenSSH's); stdin/stdout/stderr, exit
 * codes, and signals the client sends. By default each command runs as `sh -c <command>` in its own process
 * group, as the user this process runs as.
 */
import { type ChildProcess, spawn } from "node:child_process";
import net from "node:net";
import { constants as osConstants } from "node:os";
import path from "node:path";
import { Writable } from "node:stream";
import type { Connection, ParsedKey, ServerChannel } from "ssh2";
import ssh2 from "ssh2";
import type { Logger } from "../lib/logger.ts";

const { Server, utils } = ssh2;

export type ExecHandler = (
  command: string,
  session: {
    stdin: NodeJS.ReadableStream;
    stdout: NodeJS.WritableStream;
    stderr: NodeJS.WritableStream;
    /** Aborted when the client sends a signal (reason: its name, e.g. "SIGTERM") or goes away (reason: "closed"). */
    signal: AbortSignal;
  },
) => Promise<{ exitCode: number | null; signal?: string }>;

export interface EmbeddedSshServer {
  host: string;
  port: number;
  close(): Promise<void>;
  /** Open client connections. */
  connections: number;
}

export interface EmbeddedSshServerOptions {
  host: string;
  /** 0 or absent: an ephemeral port. */
  port?: number;
  /** PEM or OpenSSH private key. */
  hostKey: string | Buffer;
  /** OpenSSH public key lines (`ssh-ed25519 AAAA... comment`). */
  authorizedKeys: string[];
  /** Added to every command's environment (e.g. DISPATCH_VM_ROOT). */
  env?: Record<string, string>;
  /** Runs one command; the default spawns `sh -c command` in its own process group. */
  onExec?: ExecHandler;
  /**
   * Allows channels to unix sockets under this directory (OpenSSH's direct-streamlocal, which the pool uses to
   * hand bundles to crunch-run's spare supervisor); none when unset.
   */
  streamLocalUnder?: string;
  logger?: Logger;
}

export { generateKeyPair } from "../lib/ssh-keys.ts";

/** Parses OpenSSH public key lines; throws naming the bad line's index. */
export function parseAuthorizedKeys(lines: string[]): ParsedKey[] {
  return lines.map((line, i) => {
    const parsed = utils.parseKey(line.trim());
    const key = Array.isArray(parsed) ? parsed[0] : parsed;
    if (key === undefined || key instanceof Error) {
      throw new Error(`authorizedKeys[${i}] is not an OpenSSH public key: ${key?.message ?? "empty"}`);
    }
    return key;
  });
}

export async function startEmbeddedSshServer(opts: EmbeddedSshServerOptions): Promise<EmbeddedSshServer> {
  const keys = parseAuthorizedKeys(opts.authorizedKeys);
  const log = opts.logger?.child({ component: "ssh-embedded" });
  const env = { ...process.env, ...opts.env };
  const onExec = opts.onExec;
  const sockets = new Set<net.Socket>();
  /** Called when the server closes, one per running command (kills it). */
  const running = new Set<() => void>();

  const server = new Server({ hostKeys: [opts.hostKey] }, (conn: Connection) => {
    conn.on("error", (err) => log?.debug({ err }, "ssh connection error"));
    conn.on("authentication", (ctx) => {
      if (ctx.method !== "publickey") {
        ctx.reject(["publickey"]);
        return;
      }
      const key = keys.find((k) => k.type === ctx.key.algo && k.getPublicSSH().equals(ctx.key.data));
      if (key === undefined) {
        ctx.reject(["publickey"]);
        return;
      }
      // Without a signature the client only asks whether the key would do.
      if (ctx.signature === undefined || ctx.blob === undefined) {
        ctx.accept();
        return;
      }
      if (key.verify(ctx.blob, ctx.signature, ctx.hashAlgo) === true) ctx.accept();
      else ctx.reject(["publickey"]);
    });
    conn.on("ready", () => {
      conn.on("openssh.streamlocal", (accept, reject, info) => {
        const under = opts.streamLocalUnder;
        const target = path.resolve(info.socketPath);
        if (under === undefined || !target.startsWith(`${path.resolve(under)}/`)) {
          reject();
          return;
        }
        const sock = net.connect(target);
        sock.once("error", () => reject());
        sock.once("connect", () => {
          sock.removeAllListeners("error");
          sock.on("error", () => channel.destroy());
          const channel = accept();
          channel.on("error", () => sock.destroy());
          sock.pipe(channel).pipe(sock);
        });
      });
      conn.on("session", (acceptSession) => {
        const session = acceptSession();
        const signalListeners = new Set<(name: string) => void>();
        session.on("signal", (accept, _reject, info) => {
          accept?.();
          const name = `SIG${info.name.toUpperCase().replace(/^SIG/, "")}`;
          for (const listener of signalListeners) listener(name);
        });
        session.on("pty", (_accept, reject) => reject?.());
        session.on("shell", (_accept, reject) => reject());
        session.on("subsystem", (_accept, reject) => reject());
        session.on("env", (_accept, reject) => reject?.());
        session.on("exec", (accept, _reject, info) => {
          const channel = accept();
          const output = serialOutput(channel);
          const run = onExec
            ? runHandler(onExec, info.command, channel, output, signalListeners, running)
            : runProcess(info.command, env, channel, output, signalListeners, running);
          run.then(
            (result) => finish(channel, output, result),
            (err: unknown) => {
              log?.warn({ err }, "command failed to run");
              output.stderr.write(`${err instanceof Error ? err.message : String(err)}\n`);
              return finish(channel, output, { exitCode: 255 });
            },
          );
        });
      });
    });
  });

  const netServer = net.createServer((socket) => {
    sockets.add(socket);
    socket.on("close", () => sockets.delete(socket));
    socket.on("error", () => {});
    // Small request/response exchanges: without this, Nagle's algorithm and delayed ACKs add ~40 ms each.
    socket.setNoDelay(true);
    server.injectSocket(socket);
  });
  await new Promise<void>((resolve, reject) => {
    netServer.once("error", reject);
    netServer.listen(opts.port ?? 0, opts.host, () => {
      netServer.off("error", reject);
      resolve();
    });
  });
  const address = netServer.address() as net.AddressInfo;
  log?.debug({ host: opts.host, port: address.port }, "ssh server listening");

  return {
    host: opts.host,
    port: address.port,
    get connections() {
      return sockets.size;
    },
    async close() {
      const closed = new Promise<void>((resolve) => netServer.close(() => resolve()));
      for (const kill of running) kill();
      for (const socket of sockets) socket.destroy();
      await closed;
    },
  };
}

/** Sends the exit status and ends the channel, once every byte of output has been handed to ssh2. */
async function finish(
  channel: ServerChannel,
  output: SerialOutput,
  result: { exitCode: number | null; signal?: string },
): Promise<void> {
  const gone = new Promise<void>((resolve) => channel.once("close", () => resolve()));
  await Promise.race([output.flushed(), gone]);
  try {
    if (result.signal !== undefined) channel.exit(result.signal.replace(/^SIG/, ""), false, "");
    else channel.exit(result.exitCode ?? 255);
    channel.end();
  } catch {
    // The client went away; nothing to report to.
  }
}

interface SerialOutput {
  stdout: Writable;
  stderr: Writable;
  /** Resolves once everything written so far has been accepted by ssh2. */
  flushed(): Promise<void>;
}

/**
 * stdout and stderr share one SSH flow-control window, and ssh2 resumes only one waiting write when the window
 * reopens (stdout's, if both wait), leaving a waiting stderr chunk behind for good. Writing both through one
 * queue, one chunk at a time, means ssh2 never holds two waiting writes.
 */
function serialOutput(channel: ServerChannel): SerialOutput {
  let tail: Promise<void> = Promise.resolve();
  const writerTo = (target: NodeJS.WritableStream) =>
    new Writable({
      write(chunk: Buffer, _encoding, callback) {
        tail = tail.then(
          () =>
            new Promise<void>((resolve) => {
              try {
                target.write(chunk, () => resolve()); // called once ssh2 has taken the chunk, window permitting
              } catch {
                resolve();
              }
            }),
        );
        tail.then(() => callback(), callback);
      },
    });
  return { stdout: writerTo(channel), stderr: writerTo(channel.stderr), flushed: () => tail };
}

/** Runs a custom handler, aborting its signal on the first client signal or when the channel closes. */
async function runHandler(
  handler: ExecHandler,
  command: string,
  channel: ServerChannel,
  output: SerialOutput,
  signalListeners: Set<(name: string) => void>,
  running: Set<() => void>,
): Promise<{ exitCode: number | null; signal?: string }> {
  const abort = new AbortController();
  const onSignal = (name: string) => abort.abort(name);
  const onClose = () => abort.abort("closed");
  signalListeners.add(onSignal);
  channel.on("close", onClose);
  running.add(onClose);
  try {
    return await handler(command, {
      stdin: channel,
      stdout: output.stdout,
      stderr: output.stderr,
      signal: abort.signal,
    });
  } finally {
    signalListeners.delete(onSignal);
    channel.off("close", onClose);
    running.delete(onClose);
  }
}

/** Spawns `sh -c command` as a process-group leader, forwarding client signals to the group. */
function runProcess(
  command: string,
  env: NodeJS.ProcessEnv,
  channel: ServerChannel,
  output: SerialOutput,
  signalListeners: Set<(name: string) => void>,
  running: Set<() => void>,
): Promise<{ exitCode: number | null; signal?: string }> {
  return new Promise((resolve, reject) => {
    let child: ChildProcess;
    try {
      child = spawn("/bin/sh", ["-c", command], { env, detached: true, stdio: "pipe" });
    } catch (err) {
      reject(err);
      return;
    }
    let exited = false;
    const killGroup = (signal: NodeJS.Signals) => {
      if (exited || child.pid === undefined) return;
      try {
        process.kill(-child.pid, signal);
      } catch {
        // Already gone.
      }
    };
    const onSignal = (name: string) => {
      if (name in osConstants.signals) killGroup(name as NodeJS.Signals);
    };
    // A client that closes the channel (or dies) before the command ends takes the command with it.
    const onGone = () => killGroup("SIGKILL");
    signalListeners.add(onSignal);
    channel.on("close", onGone);
    running.add(onGone);

    channel.pipe(child.stdin!);
    child.stdin!.on("error", () => {}); // EPIPE when the command does not read all of its stdin.
    child.stdout!.pipe(output.stdout, { end: false });
    child.stderr!.pipe(output.stderr, { end: false });
    child.on("error", (err) => {
      cleanup();
      reject(err);
    });
    child.on("close", (code, signal) => {
      cleanup();
      resolve(signal === null ? { exitCode: code } : { exitCode: null, signal });
    });
    function cleanup() {
      exited = true;
      signalListeners.delete(onSignal);
      channel.off("close", onGone);
      running.delete(onGone);
      channel.unpipe(child.stdin!);
    }
  });
}
