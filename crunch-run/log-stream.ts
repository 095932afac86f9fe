/**
 * One of a bundle's log streams (stdout or stderr): every byte is appended to a local file at once, and a
 * pusher sends what the server does not have yet in chunks of at most 1 MiB, each with its byte offset,
 * at least every ~250 ms while output flows. The file is the buffer, so a REST server that is away for
 * minutes costs disk, not memory. A chunk the server already has is accepted and ignored, so retries are
 * safe; a gap answer (runner.log_gap) moves the offset back to what the server expects. Once the server
 * says the stream reached its limit (restServer.maxLogBytesPerStream; it stored a truncation notice), later
 * bytes are dropped here too, file included, so a bundle that writes without end fills neither side's disk
 * (docker's own copy of the container's log is capped apart: runtime-docker.ts, containerLogMaxBytes).
 */
import { closeSync, openSync, readSync, writeSync } from "node:fs";
import { RunnerApiError, type RunnerClient } from "./api-client.ts";

export const MAX_LOG_CHUNK = 1024 * 1024;
const FLUSH_INTERVAL_MS = 250;

export class LogStream {
  private readonly fd: number;
  private written = 0;
  private sent = 0;
  private timer: NodeJS.Timeout | null = null;
  private pushing: Promise<void> | null = null;
  private closed = false;
  /** The server keeps no more of this stream. */
  private truncated = false;
  /** Set when pushing failed for good (the error is kept; the supervisor decides). */
  failure: unknown = null;

  constructor(
    readonly stream: "stdout" | "stderr",
    file: string,
    private readonly client: RunnerClient,
    private readonly onFailure: (err: unknown) => void,
  ) {
    this.fd = openSync(file, "w+", 0o600);
  }

  get bytesWritten(): number {
    return this.written;
  }

  write(data: Buffer | string): void {
    if (this.closed || this.truncated) return;
    const buf = typeof data === "string" ? Buffer.from(data) : data;
    if (buf.length === 0) return;
    let off = 0;
    while (off < buf.length) off += writeSync(this.fd, buf, off, buf.length - off, this.written + off);
    this.written += buf.length;
    if (this.timer === null && this.failure === null) {
      this.timer = setTimeout(() => {
        this.timer = null;
        void this.push();
      }, FLUSH_INTERVAL_MS);
    }
  }

  /** Sends everything written so far (waits for a push in flight first). */
  async flush(): Promise<void> {
    if (this.timer !== null) {
      clearTimeout(this.timer);
      this.timer = null;
    }
    await this.push();
    await this.push();
  }

  private push(): Promise<void> {
    if (this.pushing === null) {
      this.pushing = this.pushAll().finally(() => {
        this.pushing = null;
      });
      return this.pushing;
    }
    return this.pushing;
  }

  private async pushAll(): Promise<void> {
    while (this.sent < this.written && this.failure === null) {
      const size = Math.min(MAX_LOG_CHUNK, this.written - this.sent);
      const chunk = Buffer.alloc(size);
      const n = readSync(this.fd, chunk, 0, size, this.sent);
      try {
        const answer = await this.client.logs(this.stream, this.sent, chunk.subarray(0, n));
        this.sent += n;
        if (answer.truncated) {
          this.truncated = true;
          this.sent = this.written;
        }
      } catch (err) {
        const expected = gapOffset(err);
        if (expected !== null && expected < this.sent) {
          this.sent = expected;
          continue;
        }
        this.failure = err;
        this.onFailure(err);
      }
    }
  }

  close(): void {
    if (this.closed) return;
    this.closed = true;
    if (this.timer !== null) clearTimeout(this.timer);
    closeSync(this.fd);
  }
}

/** The offset the server expects, from a runner.log_gap answer; null for any other error. */
function gapOffset(err: unknown): number | null {
  if (!(err instanceof RunnerApiError) || err.code !== "runner.log_gap") return null;
  const m = /expectedOffset\D*(\d+)/.exec(err.apiMessage) ?? /(\d+)/.exec(err.apiMessage);
  return m === null ? null : Number(m[1]);
}
