/**
 * One SSH channel's mechanics for the executor (executor.ts): opening exec and streamlocal channels, telling a
 * refused open from a dead connection, signalling, racing a promise with a deadline, ending a client. Nothing
 * here knows about instances, identity or limits.
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
