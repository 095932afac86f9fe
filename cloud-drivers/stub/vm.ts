import { EventEmitter } from "node:events";
import type { Clock } from "../../lib/clock.ts";
import type { ExecResult } from "../../lib/executor.ts";
import { INSTANCE_SECRET_FILE } from "../../lib/runner-protocol.ts";
import type { Tags } from "../types.ts";

/** Where the init script leaves the instance secret (with `${DISPATCH_VM_ROOT:-}` expanded to nothing). */
export const SECRET_FILE = INSTANCE_SECRET_FILE;

export type RunnerState = "running" | "exited" | "stale";

/** A fake crunch-run started by `--detach`. */
export interface StubRunner {
  readonly uuid: string;
  readonly pid: number;
  readonly startedAt: number;
  /** The JSON document the dispatcher sent on stdin, parsed. */
  readonly doc: unknown;
  /** True when the crash rate fired: the runner died right after starting. */
  readonly crashed: boolean;
  state: RunnerState;
  exitCode: number | null;
  /** The signal that ended it ("TERM", "KILL"...), or null. */
  signal: string | null;
  finishedAt: number | null;
}

/** Events of one VM; the StubCloud re-emits each with the VM as first argument. */
export interface StubVmEvents {
  command: [command: string, result: ExecResult];
  "runner:detach": [runner: StubRunner];
  "runner:kill": [runner: StubRunner, signal: string];
  "runner:exit": [runner: StubRunner];
}

export interface StubVmInit {
  id: string;
  serial: number;
  address: string;
  providerType: string;
  instanceType: string;
  imageId: string;
  tags: Tags;
  initCommand: string;
  publicKey: string;
  createdAt: number;
  clock: Clock;
  /** Receives every event for re-emission by the cloud. */
  forward: (event: keyof StubVmEvents, vm: StubVm, args: unknown[]) => void;
}

/**
 * One simulated VM. Nothing runs on a timer: "booted" is `clock.now() >= bootAt`, runners change state only
 * when a command or a test says so. Tests may change any public field at run time.
 */
export class StubVm extends EventEmitter<StubVmEvents> {
  readonly id: string;
  /** 1 for the first VM the cloud created, 2 for the next... (selectors like "every 7th" use it). */
  readonly serial: number;
  readonly providerType: string;
  /** The dispatcher's instance type name (InstanceType.name). */
  readonly instanceType: string;
  readonly imageId: string;
  readonly initCommand: string;
  readonly publicKey: string;
  readonly createdAt: number;
  readonly remoteUser = "root";
  /** `stub-<serial>`, or `127.0.0.1:<port>` once a real SSH server serves this VM. */
  address: string;
  /** Current tags (frozen; replaced whole by setTags). */
  tags: Readonly<Tags>;
  /** The tags before the last setTags, and when that call happened (for the staleTagsFor knob). */
  previousTags: Readonly<Tags> | null = null;
  tagsSetAt = Number.NEGATIVE_INFINITY;
  /** SSH answers and the boot probe can pass from this time on. */
  bootAt: number;
  destroyedAt: number | null = null;
  /** `crunch-run --list` prints `broken`. */
  broken = false;
  /**
   * A spot interruption notice arrived (a test sets it): `crunch-run --list` prints `preempted` and `--detach`
   * refuses to start anything (exit 1), as crunch-run does once its preempted file exists.
   */
  preempted = false;
  /**
   * What the instance's cache holds (a test sets it): manifest digests, most recently used first, printed by
   * `crunch-run --list` as its `cache` line (lib/runner-protocol.ts formatList); or a raw line to print as is.
   */
  cachedManifests: string[] = [];
  cacheLine: string | null = null;
  /** A warm pool's socket (a bench serves one): `crunch-run --list` names it on its `spare` line. */
  spareSocket: string | null = null;
  /** Every command fails (exit 2, "cannot fork"). */
  commandsFail = false;
  /** SSH answers but the boot probe never passes. */
  neverBoot = false;
  /**
   * Every command waits this long (on the cloud's clock) before it runs; Infinity: it never answers, and only the
   * caller's timeout ends it (ssh.timeout), as a hung instance does.
   */
  commandDelay = 0;
  /** The runner cannot be installed (writes to crunch-run* paths fail) and is never found. */
  runnerMissing = false;
  /**
   * The runner is installed but cannot run: every `crunch-run ...` prints this line on stderr and exits 1 (as an
   * artifact that Node cannot load does). Null: it runs.
   */
  runnerFails: string | null = null;
  /** Files on the VM: absolute path (with the VM root convention expanded to nothing) -> contents. */
  readonly files = new Map<string, Buffer>();
  readonly runners = new Map<string, StubRunner>();
  private readonly clock: Clock;
  private readonly forward: StubVmInit["forward"];
  private nextPid = 1000;

  constructor(init: StubVmInit) {
    super();
    this.id = init.id;
    this.serial = init.serial;
    this.address = init.address;
    this.providerType = init.providerType;
    this.instanceType = init.instanceType;
    this.imageId = init.imageId;
    this.initCommand = init.initCommand;
    this.publicKey = init.publicKey;
    this.createdAt = init.createdAt;
    this.bootAt = init.createdAt;
    this.tags = Object.freeze({ ...init.tags });
    this.clock = init.clock;
    this.forward = init.forward;
    const secret = parseInitSecret(init.initCommand);
    if (secret !== undefined) this.files.set(SECRET_FILE, Buffer.from(secret));
  }

  /** The contents of the secret file, or undefined if there is none. Setting it rewrites the file. */
  get secret(): string | undefined {
    return this.files.get(SECRET_FILE)?.toString();
  }

  set secret(value: string | undefined) {
    if (value === undefined) this.files.delete(SECRET_FILE);
    else this.files.set(SECRET_FILE, Buffer.from(value));
  }

  get destroyed(): boolean {
    return this.destroyedAt !== null;
  }

  /** Reachable over (simulated) SSH: not destroyed and past bootAt. */
  isUp(now = this.clock.now()): boolean {
    return this.destroyedAt === null && now >= this.bootAt;
  }

  /** Runners whose lock is held (state running or stale). */
  liveRunners(): StubRunner[] {
    return [...this.runners.values()].filter((r) => r.state !== "exited");
  }

  /** Starts a fake runner (what `--detach` does); a crashed one is exited at once. */
  startRunner(uuid: string, doc: unknown, crashed = false): StubRunner {
    const runner: StubRunner = {
      uuid,
      pid: this.nextPid++,
      startedAt: this.clock.now(),
      doc,
      crashed,
      state: "running",
      exitCode: null,
      signal: null,
      finishedAt: null,
    };
    this.runners.set(uuid, runner);
    this.fire("runner:detach", runner);
    if (crashed) this.endRunner(uuid, 1, null);
    return runner;
  }

  /** Makes a running runner exit with `exitCode` (as if its bundle finished). */
  finishRunner(uuid: string, exitCode = 0): StubRunner {
    return this.endRunner(uuid, exitCode, null);
  }

  /** The runner's process died but its lock is still held: `--list` prints `<uuid> stale`. */
  markStale(uuid: string): StubRunner {
    const runner = this.mustGet(uuid);
    runner.state = "stale";
    return runner;
  }

  /** Ends a runner (no-op if already exited). */
  endRunner(uuid: string, exitCode: number | null, signal: string | null): StubRunner {
    const runner = this.mustGet(uuid);
    if (runner.state === "exited") return runner;
    runner.state = "exited";
    runner.exitCode = exitCode;
    runner.signal = signal;
    runner.finishedAt = this.clock.now();
    this.fire("runner:exit", runner);
    return runner;
  }

  /** @internal Emits on the VM and forwards to the cloud. */
  fire<K extends keyof StubVmEvents>(event: K, ...args: StubVmEvents[K]): void {
    (this.emit as (e: K, ...a: StubVmEvents[K]) => boolean)(event, ...args);
    this.forward(event, this, args);
  }

  private mustGet(uuid: string): StubRunner {
    const runner = this.runners.get(uuid);
    if (runner === undefined) throw new Error(`stub VM ${this.id} has no runner ${uuid}`);
    return runner;
  }
}

/**
 * The secret the init script writes: the word after `echo -n` in a command that redirects into the secret
 * file, e.g. `echo -n 'abc…' >"${DISPATCH_VM_ROOT:-}/var/run/dispatch-cloud-instance-secret"`.
 */
export function parseInitSecret(initCommand: string): string | undefined {
  const m = /echo\s+-n\s+(['"]?)([A-Za-z0-9+/=_-]+)\1\s*>\s*\S*dispatch-cloud-instance-secret/.exec(
    initCommand,
  );
  return m?.[2];
}
