import { DispatchCloudError } from "../lib/errors.ts";

/** What a command may touch, passed in so tests run commands in-process. */
export interface CliIo {
  argv: string[];
  env: Record<string, string | undefined>;
  cwd: string;
  out(line: string): void;
  err(line: string): void;
  /** Progress lines (waits, uploads): stderr, so stdout stays parseable. */
  progress(line: string): void;
  signal?: AbortSignal;
}

export type Command = (io: CliIo) => Promise<number>;

export const EXIT_OK = 0;
export const EXIT_FAILED = 1;
export const EXIT_USAGE = 2;

export function usageError(message: string): DispatchCloudError {
  return new DispatchCloudError("cli.usage", message);
}

/** Prints an error the way every command does: code, message, and the bad field's path when known. */
export function reportError(io: CliIo, err: unknown): number {
  if (err instanceof DispatchCloudError) {
    const at = err.path === undefined || err.message.startsWith(err.path) ? "" : ` (at ${err.path})`;
    io.err(`dispatch-cloud: ${err.message}${at} [${err.code}]`);
    return err.code === "cli.usage" ? EXIT_USAGE : EXIT_FAILED;
  }
  io.err(`dispatch-cloud: ${err instanceof Error ? err.message : String(err)}`);
  return EXIT_FAILED;
}
