import { SshError } from "../../lib/executor.ts";

export interface BackoffOptions {
  /** Delay before the second attempt, after the first failure. */
  initialMs: number;
  factor: number;
  maxMs: number;
}

export const DEFAULT_BACKOFF: BackoffOptions = { initialMs: 1_000, factor: 2, maxMs: 30_000 };

/** Delay before the next connect attempt after `failures` (>= 1) consecutive failures. */
export function backoffDelay(failures: number, opts: BackoffOptions): number {
  if (failures <= 0) return 0;
  return Math.min(opts.maxMs, opts.initialMs * opts.factor ** (failures - 1));
}

/** Splits "host", "host:port", "[v6]:port" or a bare IPv6 address into host and port. */
export function parseAddress(address: string, defaultPort: number): { host: string; port: number } {
  const bad = () => new SshError("ssh.connect_failed", `invalid instance address "${address}"`);
  let host = address.trim();
  let portText: string | undefined;
  const bracketed = /^\[([^\]]+)\](?::(.*))?$/.exec(host);
  if (bracketed) {
    host = bracketed[1] ?? "";
    portText = bracketed[2];
  } else if (host.split(":").length === 2) {
    [host = "", portText] = host.split(":");
  }
  if (host === "" || /\s/.test(host)) throw bad();
  if (portText === undefined) return { host, port: defaultPort };
  if (!/^\d{1,5}$/.test(portText)) throw bad();
  const port = Number(portText);
  if (port < 1 || port > 65535) throw bad();
  return { host, port };
}

/** The first word of a command, for error messages that must stay short and free of arguments. */
export function firstWord(command: string): string {
  const word = command.trim().split(/\s+/)[0] ?? "";
  return word.length > 40 ? `${word.slice(0, 40)}...` : word;
}

/** Collects a stream's chunks up to `max` bytes; past that it drops data and remembers it did. */
export class CappedBuffer {
  private chunks: Buffer[] = [];
  private size = 0;
  truncated = false;

  constructor(private readonly max: number) {}

  push(chunk: Buffer): void {
    const room = this.max - this.size;
    if (chunk.length > room) {
      this.truncated = true;
      if (room <= 0) return;
      chunk = chunk.subarray(0, room);
    }
    this.chunks.push(chunk);
    this.size += chunk.length;
  }

  toBuffer(): Buffer {
    return Buffer.concat(this.chunks, this.size);
  }
}
