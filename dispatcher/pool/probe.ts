/**
 * One probe of one instance (dispatcher/README.md, "Instance states"): for a booting or unknown instance the
 * boot probe, the runner deployment (skipped when the hash matches) and `--list`; for a booted one `--list`.
 * The executor proves the instance's identity on connect, so the first command may fail with
 * ssh.not_ready (still booting) or ssh.host_mismatch (not our instance). Probes only report; the pool decides.
 */
import type { Executor } from "../../lib/executor.ts";
import { LIST_REQUEST, type ListedRunners, parseList, VERSION_LINE } from "../../lib/runner-protocol.ts";
import { checksumMatches, type RunnerCommands } from "./runner-commands.ts";

/** Bounds on one command of a probe (the real SSH executor also bounds connecting). */
export const PROBE_COMMAND_TIMEOUT_MS = 60_000;
export const DEPLOY_TIMEOUT_MS = 5 * 60_000;

/**
 * Where a probe failed. `runner`: the runner is in place but cannot run (`--version` or `--list` exits non-zero
 * or prints what is not its grammar): not a booting instance, a broken one.
 */
export type ProbeStage = "connect" | "boot" | "deploy" | "runner" | "list";

export type ProbeResult =
  | {
      ok: true;
      listed: ListedRunners;
      /** When `--list` was sent: runners started before then and alive would be in `listed`. */
      listSentAt: number;
      /** The runner was copied by this probe. */
      deployed: boolean;
      /** The boot probe passed (always true for a probe of a booted instance). */
      booted: boolean;
    }
  | {
      ok: false;
      stage: ProbeStage;
      message: string;
      /** The instance answered at least one command (SSH is up). */
      answered: boolean;
      /** The executor refused the host: its secret is not the one we gave our instance. */
      mismatch: boolean;
    };

export interface ProbeTarget {
  exec: Executor;
  /** The warm pool's socket from the last `--list` (its `spare` line): a booted instance's probe asks it first. */
  spareSocket?: string | null;
  cmds: RunnerCommands;
  runner: { content: Buffer; sha256: string };
  bootProbeCommand: string;
  now(): number;
}

class StageFailed extends Error {
  constructor(
    readonly stage: ProbeStage,
    message: string,
  ) {
    super(message);
  }
}

/**
 * Probes a booting (or, after a restart, unknown) instance. `runnerPresent`: this pool already found the
 * runner in place, so the checksum is skipped. An unknown instance whose boot probe fails is still listed:
 * a busy instance found after a restart may not pass a boot probe, but its runners are real.
 */
export async function probeBooting(
  t: ProbeTarget,
  opts: { unknown: boolean; runnerPresent: boolean },
): Promise<ProbeResult> {
  let answered = false;
  const run = async (
    stage: ProbeStage,
    command: string,
    stdin?: Buffer,
    timeoutMs = PROBE_COMMAND_TIMEOUT_MS,
  ) => {
    const res = await t.exec.execute(command, { timeoutMs, ...(stdin === undefined ? {} : { stdin }) });
    answered = true;
    if (res.exitCode !== 0) {
      if (stage === "runner") {
        const what = command === t.cmds.version ? "--version" : "--list";
        throw new StageFailed(
          stage,
          `crunch-run ${what} ${describeExit(res)}: ${quoteLine(firstErrorLine(res.stderr, res.stdout))}`,
        );
      }
      throw new StageFailed(stage, `${stage} command ${describeExit(res)}: ${tail(res.stderr)}`);
    }
    return res;
  };
  try {
    let booted = true;
    if (t.bootProbeCommand.trim() !== "") {
      try {
        await run("boot", t.bootProbeCommand);
      } catch (err) {
        if (!(err instanceof StageFailed) || !opts.unknown) throw err;
        booted = false;
      }
    }
    let deployed = false;
    if (booted && !opts.runnerPresent) {
      const sum = await t.exec.execute(t.cmds.checksum, { timeoutMs: PROBE_COMMAND_TIMEOUT_MS });
      answered = true;
      if (sum.exitCode !== 0 || !checksumMatches(sum.stdout.toString("utf8"), t.runner.sha256)) {
        await run("deploy", t.cmds.deploy, t.runner.content, DEPLOY_TIMEOUT_MS);
        deployed = true;
      }
      // The runner in place must run here: an artifact that cannot start fails this, not every later probe.
      const version = await run("runner", t.cmds.version);
      const line = version.stdout.toString("utf8").trim();
      if (!VERSION_LINE.test(line)) {
        throw new StageFailed("runner", `crunch-run --version printed ${quoteLine(line)}, not its version`);
      }
    }
    const listSentAt = t.now();
    // Booted, with the runner in place: a --list that fails or prints what is not its grammar is the runner's.
    const res = await run(booted ? "runner" : "list", t.cmds.list);
    const listed = parseList(res.stdout.toString("utf8"));
    if (booted && listed.unknown.length > 0) {
      throw new StageFailed(
        "runner",
        `crunch-run --list printed ${quoteLine(listed.unknown[0]!)}, which is not its grammar`,
      );
    }
    if (!booted && listed.runners.size === 0) {
      return { ok: false, stage: "boot", message: "boot probe failed", answered, mismatch: false };
    }
    return { ok: true, listed, listSentAt, deployed, booted };
  } catch (err) {
    return probeFailure(err, answered);
  }
}

/** How long a probe waits for the warm pool's listing before it runs `--list` instead. */
const POOL_LIST_TIMEOUT_MS = 5000;

/**
 * Probes a booted instance: `--list`. When the last one named the instance's warm pool, the pool is asked for the
 * same listing over the connection (LIST_REQUEST), which starts no process on the instance; a pool that is gone,
 * slow, refuses, or answers what is not a listing of itself falls back to running `--list`.
 */
export async function probeList(t: ProbeTarget): Promise<ProbeResult> {
  const listSentAt = t.now();
  const fromPool = await listFromPool(t);
  if (fromPool !== null) return { ok: true, listed: fromPool, listSentAt, deployed: false, booted: true };
  try {
    const res = await t.exec.execute(t.cmds.list, { timeoutMs: PROBE_COMMAND_TIMEOUT_MS });
    if (res.exitCode !== 0) {
      return {
        ok: false,
        stage: "list",
        message: `list command ${describeExit(res)}: ${tail(res.stderr)}`,
        answered: true,
        mismatch: false,
      };
    }
    return {
      ok: true,
      listed: parseList(res.stdout.toString("utf8")),
      listSentAt,
      deployed: false,
      booted: true,
    };
  } catch (err) {
    return probeFailure(err, false);
  }
}

/** The warm pool's listing, or null when there is no pool to ask or its answer is not one (then `--list`). */
async function listFromPool(t: ProbeTarget): Promise<ListedRunners | null> {
  const socket = t.spareSocket ?? null;
  if (socket === null || t.exec.exchange === undefined) return null;
  let answer: string;
  try {
    answer = (await t.exec.exchange(socket, LIST_REQUEST, { timeoutMs: POOL_LIST_TIMEOUT_MS })).toString(
      "utf8",
    );
  } catch {
    return null;
  }
  const listed = parseList(answer);
  // A listing of a live pool names its own socket; anything else (a refusal, an old runner) is not one.
  return listed.unknown.length === 0 && listed.spare === socket ? listed : null;
}

/** A probe that ended in `err` (a stage's failure, or the executor's error: connect, timeout, mismatch). */
export function probeFailure(err: unknown, answered: boolean): ProbeResult {
  if (err instanceof StageFailed)
    return { ok: false, stage: err.stage, message: err.message, answered, mismatch: false };
  const code = (err as { code?: unknown }).code;
  const message = err instanceof Error ? err.message : String(err);
  return { ok: false, stage: "connect", message, answered, mismatch: code === "ssh.host_mismatch" };
}

function describeExit(res: { exitCode: number | null; signal: string | null }): string {
  return res.exitCode === null ? `was killed by ${res.signal ?? "a signal"}` : `exited ${res.exitCode}`;
}

/**
 * The line of a failed program's output that says what went wrong: the first `SomethingError:` line (Node's
 * uncaught errors print the source line and a caret first), else the first line mentioning an error, else the
 * first line of stderr, else of stdout. Empty when both are empty.
 */
export function firstErrorLine(stderr: Buffer, stdout: Buffer = Buffer.alloc(0)): string {
  const lines = (b: Buffer) =>
    b
      .toString("utf8")
      .split("\n")
      .map((l) => l.trim())
      .filter((l) => l !== "");
  const err = lines(stderr);
  const line =
    err.find((l) => /^[A-Za-z_$.]*(Error|Exception)\b/.test(l)) ??
    err.find((l) => /error/i.test(l)) ??
    err[0] ??
    lines(stdout)[0] ??
    "";
  return line.length > 200 ? `${line.slice(0, 200)}...` : line;
}

/** A line of a program's output inside a message: quoted, control characters escaped, at most 200 characters. */
function quoteLine(line: string): string {
  return line === "" ? "nothing" : JSON.stringify(line.length > 200 ? `${line.slice(0, 200)}...` : line);
}

/** The end of a command's stderr, short enough for a log line. */
export function tail(stderr: Buffer, max = 300): string {
  const text = stderr.toString("utf8").trim();
  return text.length > max ? `...${text.slice(-max)}` : text;
}
