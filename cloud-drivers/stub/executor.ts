/**
 * The stub cloud's executor: runs the commands the dispatcher sends an instance (the identity check, the boot
 * probe, sha256sum, the runner's deploy, --version, --list, --detach, --kill) against a StubVm, through a
 * small shell (shell.ts), with the same errors as the SSH executor. About 500 lines: one interpreter for the
 * command set the pool uses, kept in one place so that a new command is added here and nowhere else.
 */
import { posix } from "node:path";
import type { Clock } from "../../lib/clock.ts";
import type { ExecOptions, ExecResult, Executor } from "../../lib/executor.ts";
import { SshError } from "../../lib/executor.ts";
import { formatList } from "../../lib/runner-protocol.ts";
import { constantTimeEqual } from "../../lib/tokens.ts";
import { type CommandList, type Pipeline, parseShell, type Redirect, ShellSyntaxError } from "./shell.ts";
import type { StubVm } from "./vm.ts";

/** What the stub executor needs from the StubCloud (which implements it). */
export interface StubExecHost {
  readonly clock: Clock;
  vm(id: string): StubVm | undefined;
  readonly knobs: {
    readonly bootProbeCommand: string;
    readonly runnerDetachDelay: number;
    readonly runnersIgnoreTerm: boolean;
  };
  /** Draws from the seeded PRNG: true when the runner crash rate fires. */
  runnerCrashes(): boolean;
  /** Called once a runner is started (not for crashed ones): runs the onRunnerStart hook. */
  runnerStarted(vm: StubVm, uuid: string, doc: unknown): void;
  /** sha256 hex of a file's contents (cached per Buffer). */
  sha256(data: Buffer): string;
}

const RUNNER_NAME = /^crunch-run(~[0-9a-f]+)?$/;
const SIGNALS: Record<string, string> = { "1": "HUP", "2": "INT", "3": "QUIT", "9": "KILL", "15": "TERM" };
const EMPTY = Buffer.alloc(0);

/**
 * The Executor interface over a stub VM: interprets the commands the pool sends (a small sh subset with
 * the builtins true, false, :, echo, cat, mkdir, touch, chmod, mv, rm, sha256sum, test/[, umask, set, cd,
 * sudo, exec, env, sh -c, and `crunch-run~<hash>` with --list, --detach, --kill, --version). A command to a
 * VM that is not up (not booted, destroyed, gone) fails like a refused connection (ssh.connect_failed).
 */
export class StubExecutor implements Executor {
  private closed = false;
  private verified: boolean;
  private refused: SshError | null = null;

  /** `expectedSecret`: prove the VM's identity on the first connection (see StubCloud.executorFor). */
  constructor(
    private readonly host: StubExecHost,
    readonly vmId: string,
    private readonly expectedSecret?: string,
  ) {
    this.verified = expectedSecret === undefined;
  }

  async execute(command: string, opts: ExecOptions = {}): Promise<ExecResult> {
    if (this.closed) throw new SshError("ssh.closed", `executor for stub VM ${this.vmId} is closed`);
    if (this.refused !== null) throw this.refused;
    const vm = this.host.vm(this.vmId);
    const now = this.host.clock.now();
    if (vm === undefined || vm.destroyed) {
      throw new SshError("ssh.connect_failed", `stub VM ${this.vmId}: connection refused (no such VM)`);
    }
    if (!vm.isUp(now)) {
      throw new SshError(
        "ssh.connect_failed",
        `stub VM ${this.vmId} (${vm.address}): connection refused (not booted yet)`,
      );
    }
    if (!this.verified) this.verify(vm);
    const run = new Run(this.host, vm, opts, now);
    const exitCode = await run.main(command);
    const result: ExecResult = {
      stdout: concat(run.stdout.chunks),
      stderr: concat(run.stderr.chunks),
      exitCode,
      signal: null,
    };
    vm.fire("command", command, result);
    return result;
  }

  async close(): Promise<void> {
    this.closed = true;
  }

  /** The identity check the SSH executor runs on connect, against the VM's secret file. */
  private verify(vm: StubVm): void {
    const found = vm.secret;
    if (found === undefined || found === "") {
      throw new SshError("ssh.not_ready", `stub VM ${this.vmId} has no secret file yet (still booting?)`);
    }
    if (!constantTimeEqual(found, this.expectedSecret ?? "")) {
      this.refused = new SshError(
        "ssh.host_mismatch",
        `the host at ${vm.address} is not instance ${this.vmId}: its secret file does not match its tag; ` +
          "nothing more is sent to it",
      );
      throw this.refused;
    }
    this.verified = true;
  }
}

interface Sink {
  chunks: Buffer[];
  /** A file to write when the command is done; "/dev/null" discards. */
  path?: string;
  append?: boolean;
}

interface Io {
  stdin: () => Promise<Buffer>;
  stdout: Sink;
  stderr: Sink;
}

class TimeoutSignal extends Error {}

/** One command's run on a VM. */
class Run {
  readonly stdout: Sink = { chunks: [] };
  readonly stderr: Sink = { chunks: [] };
  private readonly deadline: number;
  private stdinData: Promise<Buffer> | undefined;

  constructor(
    private readonly host: StubExecHost,
    private readonly vm: StubVm,
    private readonly opts: ExecOptions,
    now: number,
  ) {
    this.deadline = opts.timeoutMs === undefined || opts.timeoutMs <= 0 ? Infinity : now + opts.timeoutMs;
  }

  async main(command: string): Promise<number> {
    const io: Io = { stdin: () => this.readStdin(), stdout: this.stdout, stderr: this.stderr };
    if (this.vm.commandsFail) {
      write(io.stderr, "stub: cannot fork: resource temporarily unavailable\n");
      return 2;
    }
    try {
      if (this.vm.commandDelay > 0) await this.sleep(this.vm.commandDelay);
      if (command.trim() === this.host.knobs.bootProbeCommand.trim()) return this.bootProbe();
      return await this.script(command, io);
    } catch (err) {
      if (err instanceof TimeoutSignal) {
        throw new SshError(
          "ssh.timeout",
          `stub VM ${this.vm.id}: command ran past its timeout of ${this.opts.timeoutMs} ms`,
        );
      }
      throw err;
    }
  }

  private bootProbe(): number {
    return this.vm.neverBoot ? 1 : 0;
  }

  private async script(src: string, io: Io): Promise<number> {
    let list: CommandList;
    try {
      list = parseShell(src);
    } catch (err) {
      if (!(err instanceof ShellSyntaxError)) throw err;
      write(io.stderr, `stub: unknown command (${err.message})\n`);
      return 127;
    }
    return this.list(list, io);
  }

  private readStdin(): Promise<Buffer> {
    this.stdinData ??= readAll(this.opts.stdin);
    return this.stdinData;
  }

  private async sleep(ms: number): Promise<void> {
    const now = this.host.clock.now();
    if (now + ms > this.deadline) {
      await this.host.clock.sleep(Math.max(0, this.deadline - now));
      throw new TimeoutSignal();
    }
    await this.host.clock.sleep(ms);
  }

  private async list(list: CommandList, io: Io): Promise<number> {
    let status = await this.pipeline(list.first, io);
    for (const { op, pipeline } of list.rest) {
      if (op === "&&" && status !== 0) continue;
      if (op === "||" && status === 0) continue;
      status = await this.pipeline(pipeline, io);
    }
    return status;
  }

  private async pipeline(cmds: Pipeline, io: Io): Promise<number> {
    let stdin = io.stdin;
    let status = 0;
    for (const [i, cmd] of cmds.entries()) {
      const last = i === cmds.length - 1;
      const out: Sink = last ? io.stdout : { chunks: [] };
      status = await this.command(cmd, { stdin, stdout: out, stderr: io.stderr });
      if (!last) {
        const data = concat(out.chunks);
        stdin = async () => data;
      }
    }
    return status;
  }

  private async command(cmd: Pipeline[number], io: Io): Promise<number> {
    const fds = new Map<number, Sink>([
      [1, io.stdout],
      [2, io.stderr],
    ]);
    let stdin = io.stdin;
    const files: Sink[] = [];
    for (const r of cmd.redirects) {
      const failed = this.redirect(r, fds, files, io.stderr);
      if (failed !== undefined) return failed;
      if (r.op === "<") {
        const data = this.vm.files.get(resolvePath(r.target)) ?? EMPTY;
        stdin = async () => data;
      }
    }
    const child: Io = { stdin, stdout: fds.get(1) ?? { chunks: [] }, stderr: fds.get(2) ?? { chunks: [] } };
    const status =
      cmd.kind === "group" ? await this.list(cmd.body, child) : await this.simple(cmd.words, child);
    for (const sink of files) {
      if (sink.path === undefined || sink.path === "/dev/null") continue;
      const data = concat(sink.chunks);
      const old = sink.append ? this.vm.files.get(sink.path) : undefined;
      this.vm.files.set(sink.path, old === undefined ? data : Buffer.concat([old, data]));
    }
    return status;
  }

  /** Applies one redirection to the fd table; returns an exit status if it fails. */
  private redirect(r: Redirect, fds: Map<number, Sink>, files: Sink[], stderr: Sink): number | undefined {
    if (r.op === "<") {
      if (!this.vm.files.has(resolvePath(r.target))) {
        write(stderr, `sh: 1: cannot open ${r.target}: No such file\n`);
        return 2;
      }
      return undefined;
    }
    if (r.op === ">&") {
      const target = fds.get(Number(r.target));
      if (target === undefined) {
        write(stderr, `sh: 1: ${r.target}: Bad file descriptor\n`);
        return 2;
      }
      fds.set(r.fd, target);
      return undefined;
    }
    const path = resolvePath(r.target);
    if (!this.writable(path)) {
      write(stderr, `sh: 1: cannot create ${r.target}: No space left on device\n`);
      return 2;
    }
    const sink: Sink = { chunks: [], path, append: r.op === ">>" };
    files.push(sink);
    fds.set(r.fd, sink);
    return undefined;
  }

  private writable(path: string): boolean {
    return !(this.vm.runnerMissing && posix.basename(path).startsWith("crunch-run"));
  }

  private async simple(argv: string[], io: Io): Promise<number> {
    let words = argv;
    while (words.length > 0 && /^[A-Za-z_][A-Za-z0-9_]*=/.test(words[0] as string)) words = words.slice(1);
    const [name, ...args] = words;
    if (name === undefined) return 0;
    const probe = this.host.knobs.bootProbeCommand.trim();
    if (probe !== "" && words.join(" ") === probe) return this.bootProbe();
    const files = this.vm.files;
    switch (name) {
      case "true":
      case ":":
      case "umask":
      case "set":
      case "cd":
      case "mkdir":
        return 0;
      case "false":
        return 1;
      case "sudo": {
        let rest = args;
        while (rest[0]?.startsWith("-")) rest = rest.slice(rest[0] === "-u" ? 2 : 1);
        return this.simple(rest, io);
      }
      case "exec":
      case "env":
        return this.simple(args, io);
      case "sh":
      case "bash": {
        if (args[0] !== "-c" || args[1] === undefined) return unknown(io, name);
        return this.script(args[1], io);
      }
      case "echo": {
        const newline = args[0] !== "-n";
        const text = (newline ? args : args.slice(1)).join(" ");
        write(io.stdout, newline ? `${text}\n` : text);
        return 0;
      }
      case "cat": {
        let status = 0;
        const paths = args.filter((a) => a !== "--");
        if (paths.length === 0) io.stdout.chunks.push(await io.stdin());
        for (const p of paths) {
          const data = p === "-" ? await io.stdin() : files.get(resolvePath(p));
          if (data === undefined) {
            write(io.stderr, `cat: ${p}: No such file or directory\n`);
            status = 1;
          } else io.stdout.chunks.push(data);
        }
        return status;
      }
      case "touch":
        for (const p of operands(args)) {
          const path = resolvePath(p);
          if (!this.writable(path)) return fail(io, `touch: cannot touch '${p}': No space left on device`);
          if (!files.has(path)) files.set(path, EMPTY);
        }
        return 0;
      case "chmod": {
        const [, ...paths] = operands(args);
        for (const p of paths) {
          if (!files.has(resolvePath(p))) {
            return fail(io, `chmod: cannot access '${p}': No such file or directory`);
          }
        }
        return 0;
      }
      case "mv": {
        const [from, to] = operands(args);
        if (from === undefined || to === undefined) return fail(io, "mv: missing file operand");
        const data = files.get(resolvePath(from));
        if (data === undefined) return fail(io, `mv: cannot stat '${from}': No such file or directory`);
        if (!this.writable(resolvePath(to)))
          return fail(io, `mv: cannot move '${from}': No space left on device`);
        files.delete(resolvePath(from));
        files.set(resolvePath(to), data);
        return 0;
      }
      case "rm": {
        const force = args.some((a) => /^-[a-zA-Z]*f/.test(a));
        for (const p of operands(args)) {
          if (!files.delete(resolvePath(p)) && !force) {
            return fail(io, `rm: cannot remove '${p}': No such file or directory`);
          }
        }
        return 0;
      }
      case "sha256sum": {
        let status = 0;
        const paths = operands(args);
        if (paths.length === 0) write(io.stdout, `${this.host.sha256(await io.stdin())}  -\n`);
        for (const p of paths) {
          const data = files.get(resolvePath(p));
          if (data === undefined) {
            write(io.stderr, `sha256sum: ${p}: No such file or directory\n`);
            status = 1;
          } else write(io.stdout, `${this.host.sha256(data)}  ${p}\n`);
        }
        return status;
      }
      case "test":
      case "[":
        return this.test(name === "[" ? args.slice(0, -1) : args);
    }
    if (RUNNER_NAME.test(posix.basename(name))) return this.runner(name, args, io);
    return unknown(io, name);
  }

  private test(args: string[]): number {
    const [flag, p] = args;
    if (p === undefined || !["-e", "-f", "-x", "-s"].includes(flag as string)) return 2;
    const data = this.vm.files.get(resolvePath(p));
    if (data === undefined) return 1;
    return flag === "-s" && data.length === 0 ? 1 : 0;
  }

  private async runner(name: string, args: string[], io: Io): Promise<number> {
    const vm = this.vm;
    if (vm.runnerMissing || !vm.files.has(resolvePath(name))) {
      write(io.stderr, `sh: 1: ${name}: not found\n`);
      return 127;
    }
    if (vm.runnerFails !== null) {
      write(io.stderr, `${vm.runnerFails}\n`);
      return 1;
    }
    if (args.includes("--list")) {
      write(io.stdout, stubListing(vm));
      return 0;
    }
    if (args.includes("--version")) {
      const sha = this.host.sha256(vm.files.get(resolvePath(name)) as Buffer);
      write(io.stdout, `crunch-run (dispatch-cloud) stub-${sha.slice(0, 12)}\n`);
      return 0;
    }
    const kill = args.indexOf("--kill");
    if (kill >= 0) return this.kill(args[kill + 1], args[kill + 2], io);
    if (args.includes("--detach")) {
      const uuid = args.filter((a) => !a.startsWith("-")).at(-1);
      if (uuid === undefined) return fail(io, "crunch-run: --detach needs a bundle uuid", 2);
      return this.detach(uuid, io);
    }
    return fail(io, `crunch-run: unknown arguments: ${args.join(" ")}`, 2);
  }

  private async detach(uuid: string, io: Io): Promise<number> {
    const vm = this.vm;
    const existing = vm.runners.get(uuid);
    if (existing !== undefined && existing.state !== "exited") {
      return fail(io, `crunch-run: ${uuid}: lock is held by pid ${existing.pid}`);
    }
    const input = (await io.stdin()).toString();
    if (vm.preempted) {
      return fail(
        io,
        `crunch-run: refused: this instance is preempted; not starting ${uuid} [crunchrun.preempted]`,
      );
    }
    let doc: unknown;
    try {
      doc = JSON.parse(input);
    } catch {
      return fail(io, "crunch-run: stdin is not a JSON document", 2);
    }
    const crashed = this.host.runnerCrashes();
    const runner = vm.startRunner(uuid, doc, crashed);
    if (!crashed) this.host.runnerStarted(vm, uuid, doc);
    const delay = this.host.knobs.runnerDetachDelay;
    if (delay > 0) await this.sleep(delay);
    write(io.stdout, `${JSON.stringify({ uuid, pid: runner.pid })}\n`);
    return 0;
  }

  private kill(signalArg: string | undefined, uuid: string | undefined, io: Io): number {
    if (signalArg === undefined || uuid === undefined) {
      return fail(io, "crunch-run: usage: --kill <signal> <uuid>", 2);
    }
    const signal = SIGNALS[signalArg] ?? signalArg.replace(/^SIG/, "");
    if (!Object.values(SIGNALS).includes(signal))
      return fail(io, `crunch-run: unknown signal ${signalArg}`, 2);
    const runner = this.vm.runners.get(uuid);
    if (runner === undefined || runner.state !== "running") return 0;
    this.vm.fire("runner:kill", runner, signal);
    if (signal !== "KILL" && this.host.knobs.runnersIgnoreTerm) {
      return fail(io, `crunch-run: ${uuid} (pid ${runner.pid}) is still running after SIG${signal}`);
    }
    this.vm.endRunner(uuid, null, signal);
    return 0;
  }
}

/** `${DISPATCH_VM_ROOT:-}` is already expanded to nothing; relative paths are taken from `/`. */
function resolvePath(p: string): string {
  return posix.resolve("/", p);
}

function operands(args: string[]): string[] {
  return args.filter((a) => !a.startsWith("-") || a === "-");
}

function write(sink: Sink, text: string): void {
  sink.chunks.push(Buffer.from(text));
}

function fail(io: Io, message: string, status = 1): number {
  write(io.stderr, `${message}\n`);
  return status;
}

function unknown(io: Io, name: string): number {
  write(io.stderr, `stub: unknown command: ${name}\n`);
  return 127;
}

function concat(chunks: Buffer[]): Buffer {
  if (chunks.length === 0) return EMPTY;
  if (chunks.length === 1) return chunks[0] as Buffer;
  return Buffer.concat(chunks);
}

async function readAll(stdin: ExecOptions["stdin"]): Promise<Buffer> {
  if (stdin === undefined) return EMPTY;
  if (typeof stdin === "string") return Buffer.from(stdin);
  if (Buffer.isBuffer(stdin)) return stdin;
  // Events, not `for await`: the async iterator destroys the stream at the end, and an SSH channel passed
  // in as stdin must stay open for the exit status.
  const stream = stdin;
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    stream.on("data", (chunk: Buffer | string) =>
      chunks.push(typeof chunk === "string" ? Buffer.from(chunk) : chunk),
    );
    stream.once("end", () => resolve(concat(chunks)));
    stream.once("error", reject);
  });
}

/** What the stub VM's `crunch-run --list` prints (and a warm pool of a bench answers a listing with). */
export function stubListing(vm: StubVm): string {
  const runners = new Map<string, "running" | "stale">();
  for (const r of vm.runners.values()) if (r.state !== "exited") runners.set(r.uuid, r.state);
  const lines = formatList({
    runners,
    broken: vm.broken,
    preempted: vm.preempted,
    spare: vm.spareSocket,
    cachedManifests: vm.cacheLine === null ? vm.cachedManifests : [],
  });
  if (vm.cacheLine !== null) lines.push(vm.cacheLine);
  return lines.map((l) => `${l}\n`).join("");
}
