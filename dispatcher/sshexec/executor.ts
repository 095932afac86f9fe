/**
 * The SSH executor: one multiplexed connection per instance. It connects (with back-off), proves the host is
 * the instance it was created as (the secret, before any other command), then runs commands and streamlocal
 * exchanges on channels of that connection, within the channel limit (slots.ts), output caps and deadlines.
 * About 700 lines on purpose: connecting, the identity check and running a command share one connection's
 * state (the client, its running commands, the refusal). The channel mechanics are in channels.ts, the limits
 * on connecting that all executors share in connect-limits.ts.
 */
import type { Readable } from "node:stream";
import ssh2, { type Client as SshClient } from "ssh2";
import type { Clock } from "../../lib/clock.ts";
import { type ExecOptions, type ExecResult, type Executor, SshError } from "../../lib/executor.ts";
import type { Permit } from "../../lib/limits.ts";
import type { Logger } from "../../lib/logger.ts";
import { INSTANCE_SECRET_SHELL_PATH } from "../../lib/runner-protocol.ts";
import { constantTimeEqual } from "../../lib/tokens.ts";
import {
  abortable,
  ChannelAhead,
  endClient,
  errMessage,
  isOpenRefusal,
  type OpenedChannel,
  openExec,
  openStreamLocal,
  type StdinState,
  sendSignal,
} from "./channels.ts";
import type { ConnectLimits } from "./connect-limits.ts";
import { ChannelSlots, type Slot } from "./slots.ts";
import {
  type BackoffOptions,
  backoffDelay,
  CappedBuffer,
  DEFAULT_BACKOFF,
  firstWord,
  parseAddress,
} from "./util.ts";

export { SshError } from "../../lib/executor.ts";

// ssh2 is CommonJS: Node's ESM loader only gives its default export.
const { Client, utils } = ssh2;

/** The reason a finished command's deadline is cancelled with (one object: an Error per command costs a stack). */
const DONE = new Error("done");

/** Reads the instance's secret; run first on every new connection, before anything else is sent. */
export const IDENTITY_COMMAND = `cat ${INSTANCE_SECRET_SHELL_PATH}`;

export interface SshExecutorOptions {
  /** "host" or "host:port" ("[v6]:port" for IPv6). */
  address: string;
  /** Port when `address` has none (config's cloud.sshPort); default 22. */
  defaultPort?: number;
  user: string;
  /** The private key's text (OpenSSH or PEM), already read from config's file:// secret. */
  privateKey: string;
  /** The instance's secret tag; null skips the identity check (only for hosts we did not create). */
  expectedSecret: string | null;
  /** How error messages and logs name the instance (e.g. its cloud id); default the address. */
  name?: string;
  /** Bound on one connect attempt: TCP, handshake, authentication (default 60 s). */
  connectTimeoutMs?: number;
  /** Default per-command timeout (default 10 min); ExecOptions.timeoutMs overrides it. */
  commandTimeoutMs?: number;
  /** Most channels open at once on the connection; more commands wait their turn (default 8). */
  maxChannels?: number;
  /** Cap on each of stdout and stderr kept per command (default 64 MiB); the rest is dropped and flagged. */
  maxOutputBytes?: number;
  /** Delays between failed connect attempts (default 1 s, x2, at most 30 s). */
  backoff?: Partial<BackoffOptions>;
  /** Delay before retrying a channel the server refused to open (default 100 ms). */
  channelRetryMs?: number;
  /**
   * Keeps a channel to the socket of the last exchange open ahead of the next one (ChannelAhead, channels.ts),
   * saving that exchange one round trip (default false; the dispatcher's executors, sshConnector, set it).
   */
  exchangeAhead?: boolean;
  /** SSH keepalive interval; three missed replies drop the connection (default 15 s; 0 disables). */
  keepaliveIntervalMs?: number;
  /**
   * Limits shared by the executors of many instances on setting up connections (TCP, key exchange,
   * authentication, identity check): each connect attempt waits for its turn here, after its back-off. Commands
   * on an open connection never wait here. Absent: no limit.
   */
  connectLimits?: ConnectLimits;
  logger: Logger;
  clock: Clock;
}

export interface SshExecResult extends ExecResult {
  /** True when the output passed maxOutputBytes and the rest was dropped. */
  stdoutTruncated: boolean;
  stderrTruncated: boolean;
}

export interface SshExecutorStats {
  connected: boolean;
  /** Channels open now, and the most ever open at once. */
  openChannels: number;
  peakChannels: number;
  /** Commands holding a channel slot (connecting, opening or running) and commands waiting for one. */
  running: number;
  queued: number;
  /** Successful (identity-checked) connections made so far. */
  connections: number;
  /** A channel is held open (or opening) ahead of the next exchange (exchangeAhead). */
  channelAhead: boolean;
  lastError: { code: string; message: string; at: number } | null;
}

export interface SshExecutor extends Executor {
  connect(): Promise<void>;
  execute(command: string, opts?: ExecOptions): Promise<SshExecResult>;
  exchange(
    socketPath: string,
    payload: string | Promise<string | null>,
    opts?: { timeoutMs?: number },
  ): Promise<Buffer>;
  stats(): SshExecutorStats;
}

/**
 * The executor factory the dispatcher and cloudtest use: one executor per instance, as its remote user, with
 * the dispatcher's key, proving the instance's secret before anything else; `connectLimits` shared by all.
 */
export function sshConnector(opts: {
  privateKey: string;
  sshPort: number;
  logger: Logger;
  clock: Clock;
  connectLimits?: ConnectLimits;
}): (instance: { id: string; address: string; remoteUser: string }, expectedSecret: string) => SshExecutor {
  return (instance, expectedSecret) =>
    createSshExecutor({
      address: instance.address,
      user: instance.remoteUser,
      privateKey: opts.privateKey,
      expectedSecret,
      defaultPort: opts.sshPort,
      exchangeAhead: true,
      logger: opts.logger.child({ component: "sshexec", instanceId: instance.id }),
      clock: opts.clock,
      ...(opts.connectLimits === undefined ? {} : { connectLimits: opts.connectLimits }),
    });
}

/** Creates an executor for one instance: one lazily opened, multiplexed SSH connection shared by commands. */

export function createSshExecutor(opts: SshExecutorOptions): SshExecutor {
  return new SshExecutorImpl(opts);
}

interface Connection {
  client: SshClient;
  /** Fails the commands running on this connection when it drops. */
  running: Set<(err: SshError) => void>;
}

class SshExecutorImpl implements SshExecutor {
  private readonly host: string;
  private readonly port: number;
  private readonly name: string;
  private readonly key: string;
  private readonly log: Logger;
  private readonly clock: Clock;
  private readonly backoff: BackoffOptions;
  private readonly connectTimeoutMs: number;
  private readonly commandTimeoutMs: number;
  private readonly maxOutputBytes: number;
  private readonly channelRetryMs: number;
  private readonly keepaliveIntervalMs: number;

  private conn: Connection | null = null;
  private connecting: Promise<Connection> | null = null;
  private pendingClient: SshClient | null = null;
  private failures = 0;
  private notBefore = 0;
  private refused: SshError | null = null;
  private closed = false;
  private readonly closing = new AbortController();

  private readonly slots: ChannelSlots;
  private readonly ahead: ChannelAhead | null;
  private openChannels = 0;
  private peakChannels = 0;
  private connections = 0;
  private lastError: SshExecutorStats["lastError"] = null;

  constructor(private readonly opts: SshExecutorOptions) {
    const { host, port } = parseAddress(opts.address, opts.defaultPort ?? 22);
    this.host = host;
    this.port = port;
    this.name = opts.name ?? opts.address;
    const parsed = utils.parseKey(opts.privateKey);
    if (parsed instanceof Error || !parsed.isPrivateKey()) {
      // The parser's message never quotes the key, but keep ours fixed anyway.
      throw new SshError(
        "ssh.invalid_key",
        "the SSH private key cannot be parsed (OpenSSH or PEM, unencrypted)",
      );
    }
    this.key = opts.privateKey;
    this.clock = opts.clock;
    this.log = opts.logger.child({ component: "sshexec", instance: this.name });
    this.backoff = { ...DEFAULT_BACKOFF, ...opts.backoff };
    this.slots = new ChannelSlots(Math.max(1, opts.maxChannels ?? 8));
    this.ahead = opts.exchangeAhead === true ? new ChannelAhead() : null;
    this.connectTimeoutMs = opts.connectTimeoutMs ?? 60_000;
    this.commandTimeoutMs = opts.commandTimeoutMs ?? 600_000;
    this.maxOutputBytes = opts.maxOutputBytes ?? 64 * 1024 * 1024;
    this.channelRetryMs = opts.channelRetryMs ?? 100;
    this.keepaliveIntervalMs = opts.keepaliveIntervalMs ?? 15_000;
  }

  stats(): SshExecutorStats {
    return {
      connected: this.conn !== null,
      openChannels: this.openChannels,
      peakChannels: this.peakChannels,
      running: this.slots.running,
      queued: this.slots.queued,
      connections: this.connections,
      channelAhead: this.ahead?.holding ?? false,
      lastError: this.lastError,
    };
  }

  async connect(): Promise<void> {
    this.checkUsable();
    try {
      await this.connection();
    } catch (err) {
      throw this.noteError(err);
    }
  }

  async execute(command: string, opts: ExecOptions = {}): Promise<SshExecResult> {
    this.checkUsable();
    // A stdin stream may fail while the command waits for a slot or a channel, before run() pipes it: note
    // the error from the start (an unheard 'error' would crash the process) and let run() act on it.
    const stdinStream =
      opts.stdin !== undefined && typeof opts.stdin !== "string" && !Buffer.isBuffer(opts.stdin)
        ? (opts.stdin as Readable)
        : null;
    const stdinState: StdinState = { error: null };
    const noteStdinError = (err: Error) => {
      stdinState.error = err;
      stdinState.onError?.(err);
    };
    stdinStream?.on("error", noteStdinError);
    const slot = await this.slots.acquire().catch((err: unknown) => {
      stdinStream?.off("error", noteStdinError);
      throw err;
    });
    const timeoutMs = opts.timeoutMs ?? this.commandTimeoutMs;
    const deadline = new AbortController();
    const timeoutError = () =>
      new SshError(
        "ssh.timeout",
        `"${firstWord(command)}" on ${this.name} ran past its ${timeoutMs} ms timeout`,
      );
    this.clock.sleep(timeoutMs, deadline.signal).then(
      () => deadline.abort(timeoutError()),
      () => {},
    );
    try {
      for (;;) {
        const conn = await abortable(this.connection(), deadline.signal);
        const channel = await this.openChannel(conn, command, deadline.signal);
        if (channel === null) continue; // the connection dropped before the channel opened: reconnect
        return await this.run(conn, channel, opts.stdin, deadline.signal, slot, stdinState);
      }
    } catch (err) {
      throw this.noteError(err);
    } finally {
      stdinStream?.off("error", noteStdinError);
      deadline.abort(DONE);
      if (!slot.deferred) slot.release();
    }
  }

  async exchange(
    socketPath: string,
    payload: string | Promise<string | null>,
    opts: { timeoutMs?: number } = {},
  ): Promise<Buffer> {
    this.checkUsable();
    const slot = await this.slots.acquire();
    const timeoutMs = opts.timeoutMs ?? this.commandTimeoutMs;
    // timeoutMs applies to each leg on its own: opening the channel, waiting for the payload, and the answer
    // after it was sent. A promised payload's wait (the dispatcher's claim) is the caller's, not the instance's:
    // running out of it is not noted as the instance's last error.
    let deadline = new AbortController();
    const arm = (message: string): AbortSignal => {
      deadline.abort(DONE);
      const leg = new AbortController();
      deadline = leg;
      this.clock.sleep(timeoutMs, leg.signal).then(
        () =>
          leg.abort(
            new SshError("ssh.timeout", `${socketPath} on ${this.name}: ${message} in ${timeoutMs} ms`),
          ),
        () => {},
      );
      return leg.signal;
    };
    let waitingForPayload = false;
    try {
      const opening = arm("no channel");
      const conn = await abortable(this.connection(), opening);
      const held = this.ahead?.take(conn.client, socketPath) ?? null;
      const stream =
        (held === null ? null : await abortable(held, opening, (late) => late?.close())) ??
        (await abortable(openStreamLocal(conn.client, socketPath), opening, (late) => late.close()));
      // The socket is there: the next exchange with it finds its channel open (opened once this one is over,
      // so as not to compete with it on either side).
      const openNext = () => {
        if (this.conn === conn && !this.closed) this.ahead?.open(conn.client, socketPath);
      };
      try {
        const answered = new Promise<Buffer>((resolve, reject) => {
          const chunks: Buffer[] = [];
          let size = 0;
          stream.on("data", (chunk: Buffer) => {
            size += chunk.length;
            if (size <= this.maxOutputBytes) chunks.push(chunk);
          });
          stream.on("error", (err: Error) => reject(new SshError("ssh.closed", err.message)));
          stream.on("close", () => resolve(Buffer.concat(chunks)));
        });
        answered.catch(() => {}); // unread when the payload is null or late
        // The channel opened while the payload was being made; null means there is nothing to send after all.
        let text: string | null;
        if (typeof payload === "string") text = payload;
        else {
          waitingForPayload = true;
          text = await abortable(payload, arm("nothing to send"));
          waitingForPayload = false;
        }
        if (text === null) {
          openNext();
          return Buffer.alloc(0);
        }
        const answering = arm("no answer");
        stream.end(text);
        const answer = await abortable(answered, answering);
        openNext();
        return answer;
      } finally {
        stream.close();
      }
    } catch (err) {
      const failure =
        err instanceof SshError
          ? err
          : new SshError("ssh.closed", `${socketPath} on ${this.name}: ${errMessage(err)}`);
      throw waitingForPayload ? failure : this.noteError(failure);
    } finally {
      deadline.abort(DONE);
      slot.release();
    }
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.closing.abort(new SshError("ssh.closed", `the executor for ${this.name} is closed`));
    this.slots.rejectAll(this.closedError());
    this.ahead?.drop();
    this.pendingClient?.destroy();
    const conn = this.conn;
    this.conn = null;
    if (conn === null) return;
    for (const fail of conn.running) fail(this.closedError());
    await endClient(conn.client, this.clock);
  }

  private closedError(): SshError {
    return new SshError("ssh.closed", `the executor for ${this.name} is closed`);
  }

  private checkUsable(): void {
    if (this.refused) throw this.refused;
    if (this.closed) throw this.closedError();
  }

  private noteError(err: unknown): unknown {
    if (err instanceof SshError)
      this.lastError = { code: err.code, message: err.message, at: this.clock.now() };
    return err;
  }

  // --- connection -----------------------------------------------------------------------------------------

  private connection(): Promise<Connection> {
    if (this.refused) return Promise.reject(this.refused);
    if (this.closed) return Promise.reject(this.closedError());
    if (this.conn) return Promise.resolve(this.conn);
    if (!this.connecting) {
      this.connecting = this.establish().finally(() => {
        this.connecting = null;
      });
    }
    return this.connecting;
  }

  private async establish(): Promise<Connection> {
    const wait = this.notBefore - this.clock.now();
    if (wait > 0) {
      this.log.debug({ waitMs: wait }, "waiting before reconnecting");
      await this.clock.sleep(wait, this.closing.signal);
    }
    this.checkUsable();
    let permit: Permit | null = null;
    try {
      permit = (await this.opts.connectLimits?.acquire(this.closing.signal)) ?? null;
      this.checkUsable();
      const client = await this.openClient();
      try {
        await this.verify(client);
        if (this.closed) throw this.closedError();
      } catch (err) {
        client.end();
        throw err;
      } finally {
        this.pendingClient = null;
        permit?.release();
      }
      const conn: Connection = { client, running: new Set() };
      client.on("close", () => this.dropped(conn));
      this.conn = conn;
      this.failures = 0;
      this.notBefore = 0;
      this.connections++;
      this.log.info({ connections: this.connections }, "connected");
      return conn;
    } catch (err) {
      if (this.closed) throw this.closedError();
      // A host still booting is retried at the caller's pace (the probe interval), without growing backoff.
      const transient =
        err instanceof SshError && ["ssh.host_mismatch", "ssh.closed", "ssh.not_ready"].includes(err.code);
      if (err instanceof SshError && !transient) {
        this.failures++;
        this.notBefore = this.clock.now() + backoffDelay(this.failures, this.backoff);
        this.log.warn({ err: err.message, failures: this.failures }, "connect failed");
      }
      throw this.noteError(err);
    } finally {
      permit?.release();
    }
  }

  private dropped(conn: Connection): void {
    if (this.conn !== conn) return;
    this.conn = null;
    if (conn.running.size > 0) this.log.warn({ running: conn.running.size }, "connection lost");
    else this.log.info("connection closed");
    const err = new SshError(
      "ssh.closed",
      `the SSH connection to ${this.name} closed while a command was running`,
    );
    this.noteError(err);
    for (const fail of conn.running) fail(err);
  }

  private openClient(): Promise<SshClient> {
    return new Promise<SshClient>((resolve, reject) => {
      const client = new Client();
      this.pendingClient = client;
      let ready = false;
      client.on("ready", () => {
        ready = true;
        resolve(client);
      });
      client.on("error", (err: Error & { level?: string }) => {
        if (ready) {
          this.log.warn({ err: err.message }, "SSH connection error");
          return;
        }
        this.pendingClient = null;
        const why =
          err.level === "client-authentication" ? "authentication failed (wrong key or user)" : err.message;
        reject(
          new SshError(
            "ssh.connect_failed",
            `cannot connect to ${this.name} (${this.opts.user}@${this.host}:${this.port}): ${why}`,
            { cause: err },
          ),
        );
      });
      client.on("close", () => {
        if (ready) return;
        this.pendingClient = null;
        reject(
          this.closed
            ? this.closedError()
            : new SshError("ssh.connect_failed", `cannot connect to ${this.name}: the connection closed`),
        );
      });
      client.connect({
        host: this.host,
        port: this.port,
        username: this.opts.user,
        privateKey: this.key,
        // Cloud host keys cannot be known in advance; identity is proven by the secret file instead.
        hostVerifier: () => true,
        readyTimeout: this.connectTimeoutMs,
        keepaliveInterval: this.keepaliveIntervalMs,
        keepaliveCountMax: 3,
      });
      // Commands are small request/response exchanges: without this, Nagle's algorithm and delayed ACKs
      // add ~40 ms to each one.
      client.setNoDelay(true);
    });
  }

  /** Proves the host is the instance we created, before any other command reaches it. */
  private async verify(client: SshClient): Promise<void> {
    if (this.opts.expectedSecret === null) return;
    const deadline = new AbortController();
    this.clock.sleep(this.connectTimeoutMs, deadline.signal).then(
      () =>
        deadline.abort(
          new SshError("ssh.connect_failed", `${this.name} did not answer the identity check in time`),
        ),
      () => {},
    );
    let result: SshExecResult;
    try {
      const opened = await abortable(openExec(client, IDENTITY_COMMAND), deadline.signal, (late) =>
        late.channel.close(),
      );
      result = await this.run({ client, running: new Set() }, opened, undefined, deadline.signal, null);
    } catch (err) {
      if (err instanceof SshError && err.code === "ssh.connect_failed") throw err;
      throw new SshError(
        "ssh.connect_failed",
        `the identity check on ${this.name} failed: ${errMessage(err)}`,
        {
          cause: err,
        },
      );
    } finally {
      deadline.abort(DONE);
    }
    const found = result.stdout.toString("utf8").replace(/\n$/, "");
    if (result.exitCode === 0 && constantTimeEqual(found, this.opts.expectedSecret)) return;
    if (result.exitCode !== 0 || found === "") {
      // SSH comes up before the init script has written the secret: not proven yet, but not refused either.
      throw new SshError("ssh.not_ready", `${this.name} has no secret file yet (still booting?)`);
    }
    this.refused = new SshError(
      "ssh.host_mismatch",
      `the host at ${this.host}:${this.port} is not instance ${this.name}: its secret file does not match ` +
        "its tag; nothing more is sent to it",
    );
    this.log.error({ address: `${this.host}:${this.port}` }, "host failed the identity check; refusing it");
    this.slots.rejectAll(this.refused);
    throw this.refused;
  }

  /** Opens an exec channel, retrying while the server refuses it; null if the connection is gone. */
  private async openChannel(
    conn: Connection,
    command: string,
    signal: AbortSignal,
  ): Promise<OpenedChannel | null> {
    for (let attempt = 1; ; attempt++) {
      if (this.conn !== conn) return null;
      try {
        return await abortable(openExec(conn.client, command), signal, (late) => late.channel.close());
      } catch (err) {
        if (err instanceof SshError) throw err;
        if (!isOpenRefusal(err)) {
          // Not connected, or the connection closed under the request: drop it and reconnect.
          if (this.conn === conn) {
            conn.client.end();
            this.dropped(conn);
          }
          return null;
        }
        if (attempt === 1 || attempt % 50 === 0) {
          this.log.debug({ attempt, err: errMessage(err) }, "the server refused a channel; retrying");
        }
        await this.clock.sleep(this.channelRetryMs, signal);
      }
    }
  }

  /**
   * Feeds stdin, collects output, and settles on the exit status, the connection dropping, or the deadline
   * (which sends KILL and closes the channel). `slot` (null for the identity check) is released when the
   * channel closes if the command was abandoned.
   */
  private run(
    conn: Connection,
    opened: OpenedChannel,
    stdin: ExecOptions["stdin"],
    deadline: AbortSignal,
    slot: Slot | null,
    stdinState: StdinState = { error: null },
  ): Promise<SshExecResult> {
    const { channel } = opened;
    return new Promise<SshExecResult>((resolve, reject) => {
      const stdout = new CappedBuffer(this.maxOutputBytes);
      const stderr = new CappedBuffer(this.maxOutputBytes);
      let settled = false;
      let channelClosed = false;
      let stdinStream: Readable | null = null;
      this.openChannels++;
      this.peakChannels = Math.max(this.peakChannels, this.openChannels);

      const settle = (err: SshError | null) => {
        if (settled) return;
        settled = true;
        conn.running.delete(fail);
        deadline.removeEventListener("abort", onDeadline);
        if (stdinStream) stdinStream.unpipe(channel);
        stdinState.onError = undefined;
        if (err) reject(err);
        else
          resolve({
            stdout: stdout.toBuffer(),
            stderr: stderr.toBuffer(),
            exitCode: opened.exit?.code ?? null,
            signal: opened.exit?.signal ?? null,
            stdoutTruncated: stdout.truncated,
            stderrTruncated: stderr.truncated,
          });
      };
      const fail = (err: SshError) => settle(err);
      conn.running.add(fail);

      const onStdinError = (err: Error) => {
        sendSignal(channel, "KILL");
        channel.close();
        settle(new SshError("ssh.closed", `the stdin stream for ${this.name} failed: ${err.message}`));
      };
      const onDeadline = () => {
        sendSignal(channel, "KILL");
        channel.close();
        if (slot && !channelClosed) {
          // Hold the slot until the server has closed the channel, so the limit stays true; give up after 10 s.
          slot.deferred = true;
          const giveUp = new AbortController();
          channel.once("close", () => giveUp.abort());
          this.clock.sleep(10_000, giveUp.signal).then(
            () => slot.release(),
            () => slot.release(),
          );
        }
        settle(
          deadline.reason instanceof SshError
            ? deadline.reason
            : new SshError("ssh.timeout", "command timed out"),
        );
      };
      if (deadline.aborted) {
        onDeadline();
      } else {
        deadline.addEventListener("abort", onDeadline, { once: true });
      }

      channel.on("data", (chunk: Buffer) => stdout.push(chunk));
      channel.stderr.on("data", (chunk: Buffer) => stderr.push(chunk));
      channel.on("error", (err: Error) => this.log.debug({ err: err.message }, "channel error"));
      const onClose = () => {
        channelClosed = true;
        this.openChannels--;
        const done = () =>
          settle(
            opened.exit
              ? null
              : new SshError(
                  "ssh.closed",
                  `the channel to ${this.name} closed before the command's exit status`,
                ),
          );
        if (channel.stderr.readableEnded) done();
        else channel.stderr.once("end", done);
      };
      if (opened.closed) onClose();
      else channel.once("close", onClose);

      // A command that has already finished (exit and close in one read) has a destroyed channel: ending it
      // again would only build an error nobody reads.
      if (stdin === undefined) {
        if (!channel.destroyed && !channel.writableEnded) channel.end();
      } else if (typeof stdin === "string" || Buffer.isBuffer(stdin)) {
        channel.end(stdin);
      } else {
        stdinStream = stdin as Readable;
        if (stdinState.error !== null) {
          onStdinError(stdinState.error);
        } else {
          stdinState.onError = onStdinError;
          stdinStream.pipe(channel);
        }
      }
    });
  }
}
