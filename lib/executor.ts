/**
 * The contract between the dispatcher and an instance: run a command, get its output and exit status.
 * `createSshExecutor` (dispatcher/sshexec/executor.ts) implements it over SSH; the stub driver's stub executor
 * implements it in process. Here, below both, so that a driver never imports the dispatcher.
 */
import { DispatchCloudError } from "./errors.ts";

export interface ExecOptions {
  stdin?: Buffer | string | NodeJS.ReadableStream;
  timeoutMs?: number;
}
// No env option: secrets travel on stdin, never in a command line.

export interface ExecResult {
  stdout: Buffer;
  stderr: Buffer;
  exitCode: number | null;
  signal: string | null;
}

export interface Executor {
  /** Runs `command` with `sh -c` semantics on the instance. Rejects with SshError on transport failure,
   *  timeout (code "ssh.timeout"), or identity mismatch ("ssh.host_mismatch"); a non-zero exit is NOT an error. */
  execute(command: string, opts?: ExecOptions): Promise<ExecResult>;
  /**
   * Sends `payload` to the unix socket `socketPath` on the instance and resolves to everything the socket
   * answers until it closes (over SSH: a streamlocal channel on the same connection). Optional: an executor
   * without it makes the pool start runners with `crunch-run --detach` only. A promised payload is sent once it
   * is made, the channel opening meanwhile; a payload of null closes the channel unused and resolves to nothing.
   */
  exchange?(
    socketPath: string,
    payload: string | Promise<string | null>,
    opts?: { timeoutMs?: number },
  ): Promise<Buffer>;
  /**
   * Opens the connection now if it is not open (and proves the instance's identity); resolves once commands can
   * be sent without a handshake. Optional: an executor without it has nothing to set up. A caller that waits
   * here holds nothing else (the pool takes a probe slot only after it).
   */
  connect?(): Promise<void>;
  close(): Promise<void>;
}

export type SshErrorCode =
  | "ssh.connect_failed"
  | "ssh.timeout"
  | "ssh.host_mismatch"
  | "ssh.closed"
  | "ssh.not_ready"
  | "ssh.invalid_key";

/** A failure to run a command on an instance (never a non-zero exit: that is in ExecResult.exitCode). */
export class SshError extends DispatchCloudError {
  declare readonly code: SshErrorCode;

  constructor(code: SshErrorCode, message: string, options: { cause?: unknown } = {}) {
    super(code, message, options);
    this.name = "SshError";
  }
}
