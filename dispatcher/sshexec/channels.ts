/**
 * One SSH channel's mechanics for the executor (executor.ts): opening exec and streamlocal channels, telling a
 * refused open from a dead connection, signalling, racing a promise with a deadline, ending a client, holding one
 * streamlocal channel open ahead of its use (ChannelAhead). Nothing here knows about instances, identity or limits.
 */
import type { ClientChannel, Client as SshClient } from "ssh2";
import type { Clock } from "../../lib/clock.ts";

/** A stdin stream's failure, noted from the moment execute() accepted the command. */
export interface StdinState {
  error: Error | null;
  onError?: ((err: Error) => void) | undefined;
}

/** An exec channel and what happened to it before its reader got to it. */
export interface OpenedChannel {
  channel: ClientChannel;
  exit: { code: number | null; signal: string | null } | null;
  closed: boolean;
}

/** A streamlocal channel to a unix socket on the server (OpenSSH's direct-streamlocal@openssh.com). */
export function openStreamLocal(client: SshClient, socketPath: string): Promise<ClientChannel> {
  return new Promise<ClientChannel>((resolve, reject) => {
    try {
      client.openssh_forwardOutStreamLocal(socketPath, (err, channel) =>
        err ? reject(err) : resolve(channel),
      );
    } catch (err) {
      reject(err);
    }
  });
}

/**
 * Opens a session channel running `command`; rejects with ssh2's error (which has `reason` if refused).
 * The exit status can arrive in the same packet batch as the exec reply, before anyone awaiting this promise
 * runs: it is recorded here, synchronously, or it would be lost.
 */
export function openExec(client: SshClient, command: string): Promise<OpenedChannel> {
  return new Promise<OpenedChannel>((resolve, reject) => {
    try {
      client.exec(command, (err, channel) => {
        if (err) {
          reject(err);
          return;
        }
        const opened: OpenedChannel = { channel, exit: null, closed: false };
        channel.on("exit", (code: number | null | undefined, signal?: string) => {
          opened.exit = {
            code: code ?? null,
            signal: code === null || code === undefined ? (signal ?? null) : null,
          };
        });
        channel.once("close", () => {
          opened.closed = true;
        });
        resolve(opened);
      });
    } catch (err) {
      reject(err); // "Not connected"
    }
  });
}

/** A CHANNEL_OPEN_FAILURE from the server (e.g. past MaxSessions) or no free local channel ids. */
export function isOpenRefusal(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  const reason = (err as Error & { reason?: unknown }).reason;
  return typeof reason === "number" || err.message === "No free channels available";
}

/**
 * Sends a signal request on the channel. ssh2's Channel.signal() does nothing once stdin has ended (the
 * stream is no longer writable), but the protocol allows the request on any channel still open from our side.
 */
export function sendSignal(channel: ClientChannel, name: string): void {
  try {
    if (channel.writable) {
      channel.signal(name);
      return;
    }
    const ch = channel as unknown as {
      outgoing?: { id: number; state: string };
      _client?: { _protocol?: { signal(id: number, name: string): void } };
    };
    if (ch.outgoing && (ch.outgoing.state === "open" || ch.outgoing.state === "eof")) {
      ch._client?._protocol?.signal(ch.outgoing.id, name);
    }
  } catch {
    // The channel is going away anyway.
  }
}

/**
 * One streamlocal channel opened ahead of the next exchange with a socket (the warm pool's, to which the
 * dispatcher hands each pass's start documents), so that exchange writes at once instead of waiting one round
 * trip for the channel to open. At most one is held, to the socket the last exchange opened; it is dropped when
 * it closes (the socket's server went away, the connection dropped) and never reopened until an exchange has
 * opened a channel to that socket again. An idle streamlocal channel is not one of sshd's sessions (MaxSessions
 * counts shells, commands and subsystems), and the executor's channel slots count it only while it is in use.
 */
export class ChannelAhead {
  private held: Held | null = null;

  /** True while a channel is held (opening or open). */
  get holding(): boolean {
    return this.held !== null;
  }

  /** The channel held for `path` on `client`, once open; null when none is (or it went away meanwhile). */
  take(client: SshClient, path: string): Promise<ClientChannel | null> | null {
    const held = this.held;
    if (held === null || held.client !== client || held.path !== path) return null;
    this.held = null;
    // The idle watch stops in the same turn as the taker goes on, before it reads from the channel.
    return held.opened.then((o) => {
      if (o === null) return null;
      for (const event of IDLE_EVENTS) o.channel.off(event, o.leave);
      return o.gone() ? null : o.channel;
    });
  }

  /** Opens the next one to `path` on `client`, unless it is held already; one held elsewhere is closed. */
  open(client: SshClient, path: string): void {
    if (this.held?.client === client && this.held.path === path) return;
    this.drop();
    // While idle the channel is read, so that its end is seen (ssh2 says `close` only once the stream has been
    // read to its end): a socket's server says nothing before a payload, so any data or an end means it is no
    // longer one to hand out.
    let gone = false;
    const held: Held = {
      client,
      path,
      opened: openStreamLocal(client, path).then(
        (channel) => {
          const leave = () => {
            gone = true;
            if (this.held === held) this.held = null;
            channel.close();
          };
          for (const event of IDLE_EVENTS) channel.on(event, leave);
          return { channel, leave, gone: () => gone };
        },
        () => {
          if (this.held === held) this.held = null;
          return null;
        },
      ),
    };
    this.held = held;
  }

  /** Closes the channel held, if any. */
  drop(): void {
    const held = this.held;
    this.held = null;
    void held?.opened.then((o) => o?.channel.close());
  }
}

const IDLE_EVENTS = ["error", "data", "end", "close"] as const;

interface Held {
  client: SshClient;
  path: string;
  opened: Promise<{ channel: ClientChannel; leave: () => void; gone: () => boolean } | null>;
}

/** Races `promise` with `signal`; rejects with the signal's reason. `onLate` gets a value that came too late. */
export function abortable<T>(
  promise: Promise<T>,
  signal: AbortSignal,
  onLate?: (value: T) => void,
): Promise<T> {
  if (signal.aborted) {
    promise.then(onLate, () => {});
    return Promise.reject(signal.reason);
  }
  return new Promise<T>((resolve, reject) => {
    let done = false;
    const onAbort = () => {
      done = true;
      reject(signal.reason);
    };
    signal.addEventListener("abort", onAbort, { once: true });
    promise.then(
      (value) => {
        signal.removeEventListener("abort", onAbort);
        if (done) onLate?.(value);
        else resolve(value);
      },
      (err: unknown) => {
        signal.removeEventListener("abort", onAbort);
        if (!done) reject(err);
      },
    );
  });
}

export function endClient(client: SshClient, clock: Clock): Promise<void> {
  return new Promise<void>((resolve) => {
    const giveUp = new AbortController();
    client.once("close", () => {
      giveUp.abort();
      resolve();
    });
    clock.sleep(2_000, giveUp.signal).then(
      () => {
        client.destroy();
        resolve();
      },
      () => {},
    );
    client.end();
  });
}

export function errMessage(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}
