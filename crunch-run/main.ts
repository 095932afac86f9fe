/**
 * crunch-run: the runner the dispatcher copies to each instance (the same artifact as dispatch-cloud).
 *
 *   crunch-run --detach <uuid>          start document (JSON) on stdin; takes the bundle's lock, starts the
 *                                       supervisor in its own session, prints {"uuid","pid"}
 *   crunch-run --list                   one line per live bundle; `<uuid> stale`; `broken`; `preempted`;
 *                                       `spare <socket>`
 *   crunch-run --kill <signal> <uuid>   signals the supervisor; exit 0 once it is gone (within ~1 s)
 *   crunch-run --version
 *   crunch-run --supervise <uuid>       (internal) the supervisor; start document on stdin
 *   crunch-run --warm-pool <count>      (internal) keeps <count> warm spares on the spare socket (spare.ts)
 *   crunch-run --spare                  (internal) a warm supervisor of the pool waiting for a bundle
 *
 * Exit codes: 0 ok, 1 failed (lock held, still running, the instance is preempted, ...), 2 usage or bad start
 * document.
 * The lock semantics are described in lock.ts. This module loads only node built-ins and small local
 * modules: `--detach` is on the path the dispatcher's start latency is measured on, and `--list` runs on
 * every probe. The supervisor's heavier modules are imported only in `--supervise`.
 */
import { spawn } from "node:child_process";
import { closeSync, createWriteStream, existsSync, mkdirSync, openSync, type WriteStream } from "node:fs";
import { readdir } from "node:fs/promises";
import { constants as osConstants } from "node:os";
import { formatDigest } from "../lib/cas/digest.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import type { Logger } from "../lib/logger.ts";
import { formatDetachAnswer, formatList, MAX_WARM_SUPERVISORS, versionLine } from "../lib/runner-protocol.ts";
import { selfCommand } from "../lib/self.ts";
import { VERSION } from "../lib/version.ts";
import { readHeldManifests } from "./cas-cache.ts";
import {
  holderAlive,
  type LockInfo,
  parseLock,
  processGroupAlive,
  procStartTime,
  readLockText,
  releaseLock,
  removeDeadLock,
  replaceLock,
  tryCreateLock,
} from "./lock.ts";
import { BUNDLE_UUID_RE, lockFile, logFile, type RunnerPaths, runnerPaths } from "./paths.ts";
import {
  handToSpare,
  ipcChannel,
  MAX_BUNDLES_PER_SUPERVISOR,
  MAX_RETURN_RSS,
  notifyEnded,
  type PoolStart,
  RETURN_QUIET_MS,
  rejoinPool,
  runWarmPool,
  type SpareChannel,
  type SpareWork,
  spareSocketPath,
  startWarmPool,
  waitForWork,
} from "./spare.ts";
import { parseStartDocument, type StartDocument } from "./start-doc.ts";
import type { RetryHook } from "./supervisor.ts";

export interface CrunchRunIo {
  stdin: NodeJS.ReadableStream;
  out: (line: string) => void;
  err: (line: string) => void;
}

const defaultIo = (): CrunchRunIo => ({
  stdin: process.stdin,
  out: (line) => process.stdout.write(`${line}\n`),
  err: (line) => process.stderr.write(`${line}\n`),
});

const USAGE =
  "usage: crunch-run --detach <uuid> | --list | --kill <signal> <uuid> | --version  (start document on stdin for --detach)";
const MAX_START_DOCUMENT = 64 * 1024;

/** Runs one crunch-run command; resolves to the process exit code. */
export async function runCrunchRun(
  argv: string[],
  env: NodeJS.ProcessEnv = process.env,
  io: CrunchRunIo = defaultIo(),
): Promise<number> {
  const paths = runnerPaths(env);
  const [mode, ...rest] = argv;
  const usage = (why: string) => {
    io.err(`crunch-run: ${why}\n${USAGE}`);
    return 2;
  };
  const uuidArg = (value: string | undefined): string | null =>
    value !== undefined && BUNDLE_UUID_RE.test(value) ? value : null;
  try {
    switch (mode) {
      case "--version":
        io.out(versionLine(VERSION));
        return 0;
      case "--list":
        if (rest.length > 0) return usage("--list takes no arguments");
        for (const line of await listBundles(paths, env)) io.out(line);
        return 0;
      case "--detach": {
        const uuid = uuidArg(rest[0]);
        if (rest.length !== 1 || uuid === null)
          return usage("--detach needs one bundle uuid (xxxxx-bndl-...)");
        return await detach(uuid, paths, env, io);
      }
      case "--kill": {
        const uuid = uuidArg(rest[1]);
        const signal = parseSignal(rest[0]);
        if (rest.length !== 2 || uuid === null) return usage("--kill needs a signal and a bundle uuid");
        if (signal === null) return usage(`unknown signal ${JSON.stringify(rest[0])}`);
        return await kill(signal, uuid, paths, env, io);
      }
      case "--supervise": {
        const uuid = uuidArg(rest[0]);
        if (rest.length !== 1 || uuid === null) return usage("--supervise needs one bundle uuid");
        process.title = `crunch-run ${uuid}`;
        const doc = parseStartDocument(await readStdin(io.stdin), uuid);
        return exitSoon(await superviseBundle(doc, paths, env));
      }
      case "--spare":
        if (rest.length > 0) return usage("--spare takes no arguments");
        return await spare(paths, env, io);
      case "--warm-pool": {
        const count = Number(rest[0]);
        if (rest.length !== 1 || !/^\d+$/.test(rest[0] ?? "") || count > MAX_WARM_SUPERVISORS)
          return usage(`--warm-pool needs a number of spares from 0 to ${MAX_WARM_SUPERVISORS}`);
        return await warmPool(count, paths, env);
      }
      default:
        return usage(mode === undefined ? "no mode given" : `unknown mode ${JSON.stringify(mode)}`);
    }
  } catch (err) {
    if (err instanceof DispatchCloudError) {
      io.err(`crunch-run: ${err.message} [${err.code}]`);
      return err.code === "crunchrun.invalid_start_document" || err.code === "crunchrun.usage" ? 2 : 1;
    }
    io.err(`crunch-run: ${(err as Error).message}`);
    return 1;
  }
}

/** How long a supervisor waits for its `start` call's answer before it sets up anyway (superviseBundle). */
const ANSWER_WAIT_MS = 100;

/**
 * What a spare's supervision adds (spareOnce): its own log, the answer to the `start` call its pool made, a stop
 * signal that came before the supervision began, and a word to the pool when the bundle's command has exited.
 */
interface AsSpare {
  makeLogger?: () => Logger;
  poolStart?: PoolStart | null;
  earlySignal?: NodeJS.Signals | null;
  /** The bundle's command has exited (SuperviseOptions.onEnded). */
  onEnded?: () => void;
}

/**
 * Supervises one bundle. The runner `start` call goes out first (unless a spare's warm pool made it:
 * `poolStart`), and the supervisor's set-up (`makeLogger`, a
 * spare's log; supervise() and its heavier modules) waits for its answer, at most ANSWER_WAIT_MS: on a small
 * instance that set-up's CPU would otherwise slow the very call the bundle waits for (docs/performance.md).
 * A stop signal meanwhile is passed on to supervise() once it has its handlers, and retries meanwhile are
 * logged once it has its logger.
 */
async function superviseBundle(
  doc: StartDocument,
  paths: RunnerPaths,
  env: NodeJS.ProcessEnv,
  asSpare: AsSpare = {},
): Promise<number> {
  const { makeLogger, poolStart = null, earlySignal = null, onEnded } = asSpare;
  // The last check against a start racing a spot interruption notice (--detach and the spare check first):
  // without `start`, the bundle stays starting and the dispatcher requeues it when this runner is not listed.
  if (existsSync(paths.preemptedFile)) {
    process.stderr.write(`crunch-run: refused: this instance is preempted; not starting ${doc.uuid}\n`);
    return 1;
  }
  const { createRunnerClient, RunnerApiError } = await import("./api-client.ts");
  const abort = new AbortController();
  const retryHook: RetryHook = {};
  const earlyRetries: [string, unknown, number][] = [];
  const client = createRunnerClient({
    apiUrl: doc.apiUrl,
    token: doc.token,
    signal: abort.signal,
    onRetry: (what, err, delayMs) =>
      retryHook.onRetry === undefined
        ? earlyRetries.push([what, err, delayMs])
        : retryHook.onRetry(what, err, delayMs),
  });
  let stopSignal: NodeJS.Signals | null = earlySignal;
  const stop = (sig: NodeJS.Signals) => {
    stopSignal ??= sig;
  };
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
  // A spare's warm pool may have made the call already (spare.ts startTogether); else (or when it could not) this
  // process makes it.
  const started: Promise<unknown> =
    poolStart?.ok === true
      ? Promise.resolve(poolStart.body)
      : poolStart?.ok === false
        ? Promise.reject(new RunnerApiError(poolStart.status, poolStart.code, poolStart.message, "start"))
        : client.start();
  let waited: NodeJS.Timeout | undefined;
  await Promise.race([
    started.catch(() => {}), // the error is supervise()'s to handle
    new Promise((resolve) => {
      waited = setTimeout(resolve, ANSWER_WAIT_MS);
    }),
  ]);
  clearTimeout(waited);
  const logger = makeLogger?.();
  const { supervise } = await import("./supervisor.ts");
  const supervising = supervise({
    doc,
    paths,
    env,
    ...(logger === undefined ? {} : { logger }),
    early: { client, abort, started, retryHook },
    ...(onEnded === undefined ? {} : { onEnded }),
  });
  // supervise() has its own signal handlers and the retry hook now (set before its first await).
  process.off("SIGTERM", stop);
  process.off("SIGINT", stop);
  for (const [what, err, delayMs] of earlyRetries.splice(0)) retryHook.onRetry?.(what, err, delayMs);
  // Straight to supervise()'s handler: a signal sent again could arrive after a refused start's clean-up has
  // removed it, and kill the process before its lock is released.
  if (stopSignal !== null) process.emit(stopSignal, stopSignal);
  return await supervising;
}

/** Whatever a runtime left behind (a stuck socket) must not keep a finished supervisor alive. */
function exitSoon(code: number): number {
  setTimeout(() => process.exit(code), 2000).unref();
  return code;
}

/**
 * `--spare`: a warm supervisor waiting for the warm pool to hand it a bundle (spare.ts). Once the bundle has
 * ended it goes back to the pool (RETURN_QUIET_MS later, over the pool's socket) as a spare again, so that a
 * bundle does not cost a new process: at most MAX_BUNDLES_PER_SUPERVISOR bundles and while its memory stays
 * under MAX_RETURN_RSS. A supervisor stopped by a signal exits.
 */
async function spare(paths: RunnerPaths, env: NodeJS.ProcessEnv, io: CrunchRunIo): Promise<number> {
  let channel = ipcChannel();
  if (channel === null) {
    io.err("crunch-run: --spare runs only under the warm pool (--warm-pool)");
    return 2;
  }
  // Load what supervising needs now, so that a hand-off calls `start` at once.
  await Promise.all([import("./api-client.ts"), import("./supervisor.ts"), import("../lib/logger.ts")]);
  // And run the hand-off's path once, so the real one does not pay its one-time set-up (spare-warmup.ts).
  await (await import("./spare-warmup.ts")).warmUpSpare();
  const socketPath = spareSocketPath(paths, selfCommand());
  const comesBack = (served: number) =>
    socketPath !== null && served < MAX_BUNDLES_PER_SUPERVISOR && process.memoryUsage().rss <= MAX_RETURN_RSS;
  for (let served = 1; ; served++) {
    // The pool counts this process as on its way back from its bundle's end (spare.ts, notifyEnded).
    const onEnded = () => {
      if (socketPath !== null && comesBack(served)) notifyEnded(socketPath);
    };
    const result = await spareOnce(channel, paths, env, onEnded);
    if (result.code === null) return exitSoon(0);
    const { code, signalled } = result;
    if (signalled || !comesBack(served)) return exitSoon(code);
    process.title = "crunch-run returning";
    await new Promise((r) => setTimeout(r, RETURN_QUIET_MS));
    channel = socketPath === null || !existsSync(socketPath) ? null : await rejoinPool(socketPath);
    if (channel === null) return exitSoon(code);
  }
}

/**
 * One bundle of a spare: waits on `channel` for a hand-off, then supervises it. `code` is null when no bundle
 * came (the pool went, or could not pass the pid on); `signalled` says a stop signal came while supervising.
 */
async function spareOnce(
  channel: SpareChannel,
  paths: RunnerPaths,
  env: NodeJS.ProcessEnv,
  onEnded?: () => void,
): Promise<{ code: number | null; signalled: boolean }> {
  // The title says it is ready (tests and the benchmark count ready spares by it).
  process.title = "crunch-run spare";
  let doc: StartDocument | null = null;
  let locked: string | null = null;
  let signalled = false;
  /** A stop signal that came once this spare took a bundle, before its supervision began (passed on to it). */
  let early: NodeJS.Signals | null = null;
  const onSignal = (sig: NodeJS.Signals) => {
    signalled = true;
    early ??= sig;
  };
  const accept = async (w: SpareWork): Promise<string | null> => {
    if (!BUNDLE_UUID_RE.test(w.uuid)) return "not a bundle uuid";
    try {
      doc = parseStartDocument(w.doc, w.uuid);
    } catch (err) {
      return (err as Error).message;
    }
    if (existsSync(paths.preemptedFile)) return "instance preempted";
    if (w.mode === "detach") return null;
    // From the dispatcher directly: no --detach holds the lock for this process.
    const refusal = await takeLock(w.uuid, paths, env);
    if (refusal === null) locked = w.uuid;
    return refusal;
  };
  const got = await waitForWork(channel, async (w) => {
    const refusal = await accept(w);
    // Taken: a stop signal from now on (while the pool makes the `start` call) is noted, not the default death,
    // which would leave the lock behind; supervise() acts on it.
    if (refusal === null) {
      process.on("SIGTERM", onSignal);
      process.on("SIGINT", onSignal);
    }
    return refusal;
  });
  if (got === null || doc === null) {
    process.off("SIGTERM", onSignal);
    process.off("SIGINT", onSignal);
    // The pool could not pass our pid on: the bundle is not ours.
    if (locked !== null) await releaseLock(lockFile(paths, locked), process.pid);
    return { code: null, signalled: false };
  }
  const { work, start } = got;
  process.title = `crunch-run ${work.uuid}`;
  // From --detach: supervise only once the lock names this process (--detach writes it on our answer; if its
  // sender gave up meanwhile, it started a supervisor of its own instead).
  if (work.mode === "detach" && !(await lockNames(lockFile(paths, work.uuid), process.pid))) {
    process.off("SIGTERM", onSignal);
    process.off("SIGINT", onSignal);
    process.stderr.write(`crunch-run: ${work.uuid}: the lock never named this spare; not starting it\n`);
    return { code: 1, signalled: false };
  }
  // onSignal stays beside supervise()'s own handlers (which stop the bundle): it notes that this process is to end.
  const { createLogger } = await import("../lib/logger.ts");
  const uuid = work.uuid;
  let destination: WriteStream | null = null;
  try {
    const code = await superviseBundle(doc, paths, env, {
      makeLogger: () => {
        mkdirSync(paths.logDir, { recursive: true });
        destination = createWriteStream(logFile(paths, uuid), { flags: "a" });
        return createLogger({ level: "info", format: "json", destination });
      },
      poolStart: start,
      earlySignal: early,
      // Not after a stop signal: such a supervisor exits instead of coming back.
      onEnded: () => {
        if (!signalled) onEnded?.();
      },
    });
    return { code, signalled };
  } finally {
    process.off("SIGTERM", onSignal);
    process.off("SIGINT", onSignal);
    (destination as WriteStream | null)?.end();
  }
}

/** Waits (up to 3 s) until the lock file names `pid`. */
async function lockNames(file: string, pid: number): Promise<boolean> {
  for (let i = 0; i < 600; i++) {
    const text = await readLockText(file).catch(() => null);
    if (text !== null && parseLock(text)?.pid === pid) return true;
    await new Promise((r) => setTimeout(r, 5));
  }
  return false;
}

/** `--warm-pool <count>`: keeps warm spares for this runner until idle (spare.ts). */
async function warmPool(count: number, paths: RunnerPaths, env: NodeJS.ProcessEnv): Promise<number> {
  process.title = "crunch-run warm-pool";
  const command = selfCommand();
  const socketPath = spareSocketPath(paths, command);
  if (socketPath === null) return 0;
  const list = async () => (await listBundles(paths, env)).map((line) => `${line}\n`).join("");
  await runWarmPool({ socketPath, paths, command, env, count, list });
  return 0;
}

/** A signal given as a number (15) or a name (TERM, SIGTERM, term); null if unknown. */
export function parseSignal(text: string | undefined): NodeJS.Signals | null {
  if (text === undefined) return null;
  const signals = osConstants.signals as Record<string, number>;
  if (/^\d+$/.test(text)) {
    const n = Number(text);
    const name = Object.keys(signals).find((k) => signals[k] === n);
    return (name as NodeJS.Signals | undefined) ?? null;
  }
  const name = text.toUpperCase().startsWith("SIG") ? text.toUpperCase() : `SIG${text.toUpperCase()}`;
  return name in signals ? (name as NodeJS.Signals) : null;
}

async function readStdin(stdin: NodeJS.ReadableStream): Promise<string> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of stdin) {
    const b = typeof chunk === "string" ? Buffer.from(chunk) : (chunk as Buffer);
    size += b.length;
    if (size > MAX_START_DOCUMENT) {
      throw new DispatchCloudError(
        "crunchrun.invalid_start_document",
        `start document is larger than ${MAX_START_DOCUMENT} bytes`,
        { path: "" },
      );
    }
    chunks.push(b);
  }
  return Buffer.concat(chunks).toString("utf8");
}

/** What of the bundle still runs without its supervisor: its docker container or its process group. */
async function bundleStillRuns(
  info: LockInfo | null,
  uuid: string,
  paths: RunnerPaths,
  env: NodeJS.ProcessEnv,
): Promise<boolean> {
  if (info?.container?.runtime === "process") return processGroupAlive(info.container.pgid);
  const { createDockerClient, listBundleContainers } = await import("./docker-api.ts");
  const docker = createDockerClient(env);
  if (!existsSync(docker.socketPath)) return false;
  try {
    return (await listBundleContainers(docker, paths.root, { uuid, timeoutMs: 2000 })).length > 0;
  } catch {
    return false; // no daemon: nothing of the bundle can be running in it
  }
}

export async function listBundles(paths: RunnerPaths, env: NodeJS.ProcessEnv): Promise<string[]> {
  let names: string[];
  try {
    names = await readdir(paths.lockDir);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== "ENOENT") throw err;
    names = [];
  }
  const runners = new Map<string, "running" | "stale">();
  for (const name of names.sort()) {
    const m = /^crunch-run-([a-z0-9]{5}-bndl-[a-z0-9]{15})\.lock$/.exec(name);
    if (m === null) continue;
    const uuid = m[1] as string;
    const file = lockFile(paths, uuid);
    const text = await readLockText(file);
    if (text === null) continue;
    const info = parseLock(text);
    if (info !== null && holderAlive(info)) {
      runners.set(uuid, "running");
    } else if (await bundleStillRuns(info, uuid, paths, env)) {
      runners.set(uuid, "stale");
    } else if (!(await removeDeadLock(file, text))) {
      runners.set(uuid, "running"); // someone took the lock just now
    }
  }
  const socket = spareSocketPath(paths, selfCommand());
  return formatList({
    runners,
    broken: existsSync(paths.brokenFile),
    preempted: existsSync(paths.preemptedFile),
    spare: socket !== null && existsSync(socket) ? socket : null,
    cachedManifests: (await readHeldManifests(paths.casCacheDir)).map(formatDigest),
  });
}

/**
 * Takes the bundle's lock for this process; resolves to null, or to why not (a live supervisor holds it, or
 * the bundle still runs without one). A dead holder's lock is removed and retaken.
 */
async function takeLock(uuid: string, paths: RunnerPaths, env: NodeJS.ProcessEnv): Promise<string | null> {
  mkdirSync(paths.lockDir, { recursive: true });
  const file = lockFile(paths, uuid);
  const self: LockInfo = { uuid, pid: process.pid, startTime: procStartTime(process.pid) ?? "" };
  if (tryCreateLock(file, self)) return null;
  const held = await readLockText(file);
  const info = held === null ? null : parseLock(held);
  if (info !== null && holderAlive(info))
    return `bundle ${uuid} is already running (supervisor pid ${info.pid})`;
  if (await bundleStillRuns(info, uuid, paths, env))
    return `bundle ${uuid} is stale: its supervisor is gone but it still runs`;
  if (held !== null) await removeDeadLock(file, held);
  if (tryCreateLock(file, self)) return null;
  return `bundle ${uuid} is already running (lock taken meanwhile)`;
}

async function detach(
  uuid: string,
  paths: RunnerPaths,
  env: NodeJS.ProcessEnv,
  io: CrunchRunIo,
): Promise<number> {
  const text = await readStdin(io.stdin);
  const doc = parseStartDocument(text, uuid);
  // A start that races a spot interruption notice fails fast; the dispatcher requeues the bundle.
  if (existsSync(paths.preemptedFile)) {
    io.err(
      `crunch-run: refused: this instance is preempted (spot interruption notice); not starting ${uuid} [crunchrun.preempted]`,
    );
    return 1;
  }
  const file = lockFile(paths, uuid);
  const refusal = await takeLock(uuid, paths, env);
  if (refusal !== null) {
    io.err(`crunch-run: ${refusal} [crunchrun.already_running]`);
    return 1;
  }
  const command = selfCommand();
  const socket = spareSocketPath(paths, command);
  const sparePid = socket === null ? null : await handToSpare(socket, uuid, text);
  if (sparePid !== null) {
    try {
      await replaceLock(file, { uuid, pid: sparePid, startTime: procStartTime(sparePid) ?? "" });
    } catch (err) {
      await releaseLock(file, process.pid);
      throw err;
    }
    io.out(formatDetachAnswer({ uuid, pid: sparePid, spare: socket }));
    return 0;
  }
  let child: ReturnType<typeof spawn>;
  try {
    mkdirSync(paths.logDir, { recursive: true });
    const out = openSync(logFile(paths, uuid), "a");
    const [cmd, ...args] = command;
    try {
      child = spawn(cmd as string, [...args, "--supervise", uuid], {
        detached: true,
        stdio: ["pipe", out, out],
        env,
      });
    } finally {
      closeSync(out);
    }
    if (child.pid === undefined) {
      const err = await new Promise<Error>((resolve) => child.once("error", resolve));
      throw err;
    }
    await replaceLock(file, { uuid, pid: child.pid, startTime: procStartTime(child.pid) ?? "" });
  } catch (err) {
    await releaseLock(file, process.pid);
    throw err;
  }
  child.on("error", () => {});
  const stdin = child.stdin;
  if (stdin !== null) {
    stdin.on("error", () => {});
    await new Promise<void>((resolve) => stdin.end(text, () => resolve()));
  }
  child.unref();
  // No pool took it: start one (a second pool for a live one's socket exits at once), and name its socket.
  const pool = socket !== null && doc.warmSupervisors > 0 ? socket : null;
  io.out(formatDetachAnswer({ uuid, pid: child.pid, spare: pool }));
  if (pool !== null) startWarmPool(paths, command, env, doc.warmSupervisors);
  return 0;
}

async function kill(
  signal: NodeJS.Signals,
  uuid: string,
  paths: RunnerPaths,
  env: NodeJS.ProcessEnv,
  io: CrunchRunIo,
): Promise<number> {
  const file = lockFile(paths, uuid);
  const text = await readLockText(file);
  const info = text === null ? null : parseLock(text);
  // A supervisor outlives its bundle (it goes back to the warm pool for the next one, spare.ts): its pid is
  // this bundle's only while the lock is the one read here. So the lock is read again right before the signal,
  // and a supervisor that released it has let the bundle go.
  const holding = async (held: LockInfo) => holderAlive(held) && (await readLockText(file)) === text;
  if (info !== null && (await holding(info))) {
    try {
      process.kill(info.pid, signal);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== "ESRCH") throw err;
    }
    for (let i = 0; i < 20 && (await holding(info)); i++) await new Promise((r) => setTimeout(r, 50));
    if (await holding(info)) {
      io.err(`crunch-run: bundle ${uuid}'s supervisor (pid ${info.pid}) is still running after ${signal}`);
      return 1;
    }
    return 0;
  }
  // No live supervisor. A leftover container or process group (stale) gets the signal itself.
  if (text === null) return 0;
  if (info?.container?.runtime === "process") {
    const pgid = info.container.pgid;
    if (processGroupAlive(pgid)) process.kill(-pgid, signal);
    for (let i = 0; i < 20 && processGroupAlive(pgid); i++) await new Promise((r) => setTimeout(r, 50));
    if (processGroupAlive(pgid)) return 1;
  } else {
    const { createDockerClient, listBundleContainers } = await import("./docker-api.ts");
    const docker = createDockerClient(env);
    if (existsSync(docker.socketPath)) {
      const running = await listBundleContainers(docker, paths.root, { uuid, timeoutMs: 2000 }).catch(
        () => [],
      );
      for (const c of running) {
        // As the supervisor would have done: TERM/INT stop it (with a short grace, then SIGKILL).
        const polite = signal === "SIGTERM" || signal === "SIGINT";
        const call = polite ? `/containers/${c.Id}/stop?t=1` : `/containers/${c.Id}/kill?signal=${signal}`;
        await docker.call("POST", call, undefined, { timeoutMs: 30_000 }).catch(() => {});
      }
      if (running.length > 0) {
        for (let i = 0; i < 20; i++) {
          const left = await listBundleContainers(docker, paths.root, { uuid, timeoutMs: 2000 }).catch(
            () => [],
          );
          if (left.length === 0) break;
          await new Promise((r) => setTimeout(r, 50));
        }
        const all = await listBundleContainers(docker, paths.root, { uuid, all: true }).catch(() => []);
        for (const c of all) {
          if (c.State !== "running")
            await docker.call("DELETE", `/containers/${c.Id}?force=true`).catch(() => {});
        }
        if ((await listBundleContainers(docker, paths.root, { uuid }).catch(() => [])).length > 0) return 1;
      }
    }
  }
  await removeDeadLock(file, text);
  return 0;
}
