/**
 * Warm spare supervisors: a pool of them per instance, kept by one small process, the warm pool.
 *
 * A Node process spends ~110 ms before running any code (~200-350 ms for the single executable, more on a busy
 * machine), and a supervisor started per bundle puts that between the dispatcher's start and the bundle's `start`
 * call. One warm spare per instance was not enough: it is consumed by each bundle, and a back-to-back bundle or a
 * burst arrives before the next one is ready (issue 21). So each instance keeps K spares ready:
 *
 * - The warm pool (`crunch-run --warm-pool K`, started in its own session by `--detach`) listens on the unix
 *   socket `${ROOT}/var/run/cr-spare-<hash>.sock` (the hash of the command that starts this runner, so a newly
 *   deployed runner never hands work to an old one's pool; mode 0600: the document holds the runner token). It
 *   keeps K spare processes (`crunch-run --spare`, each in its own session, spoken to over a Node IPC channel):
 *   supervisors that have loaded their modules, run their hand-off path once (spare-warmup.ts), and wait for one
 *   start document. K is the start document's `warmSupervisors` (the dispatcher sends
 *   min(dispatcher.warmSupervisors, the instance's slots)); every hand-off updates it, and a lower K lets the
 *   extra ready spares go. Spares are started again in the background (REFILL_DELAY_MS after a hand-off), at
 *   most half the CPUs' worth at a time (one on a 2-core instance, so that refilling does not slow the bundles
 *   just started), and at once for hand-offs that wait;
 *   spares that die before they are ready are started again later and later (1 s doubling to 1 min).
 * - A hand-off (`<mode> <uuid>\n<start document>`, lib/runner-protocol.ts; the dispatcher sends the starts of one
 *   pass as one `many <n>` request and gets a line per bundle) on the socket goes to the oldest ready spare, or
 *   waits for the next one to be ready (at most PENDING_MAX_MS, and never after its sender gave up). The spare
 *   checks the document and, for a hand-off straight from the dispatcher (`start`), takes the bundle's lock
 *   itself; it answers with its pid (`pid <pid>`, passed back on the socket) or why not. For such a hand-off the
 *   pool makes the bundle's runner `start` call as it hands the bundle over, when the checks the spare will make
 *   pass in the pool too (startableDoc; startTogether: one `starts` call for the bundles handed in one turn; its
 *   HTTP client and connection are warm, where a spare's are cold, a burst's spares do not each pay for theirs,
 *   and the call does not wait for the spares to wake), gives the spares their work once it is answered (at most
 *   HOLD_MAX_MS later), and passes the answer on; a call that fails in transit, or a pool that goes or is late,
 *   leaves the call to the spare. Having the answer, it leaves the IPC
 *   channel and is that bundle's supervisor, in its own session: the warm pool's death (or a
 *   restart of the dispatcher) does not touch it. For a hand-off from `--detach` (which holds the
 *   lock and writes the spare's pid into it), the spare calls `start` itself, once the lock names it.
 * - A supervisor whose bundle has ended comes back (RETURN_QUIET_MS after its final report, main.ts): it connects
 *   to the socket, sends `spare <pid>`, and then speaks the IPC channel's messages as lines of JSON on that
 *   connection. The pool takes it as a spare, or closes the connection (the supervisor exits) when it has the
 *   spares it wants. As soon as its bundle's command has exited, it says `ended <pid>` on a connection of its own,
 *   so that the refill counts it as on its way back however long its outputs take (ENDED_RETURN_MAX_MS).
 *   So a back-to-back bundle costs no new process: the replacement's start-up (hundreds of ms of CPU) no longer
 *   runs beside the next bundles' starts.
 * - A spare holds no lock while it waits; `--list` prints `spare <socket>` while the pool's socket exists. An
 *   idle spare exits when the pool goes (its IPC channel closes). The pool exits after SPARE_IDLE_MS without a
 *   hand-off, or as soon as its socket file is gone (the VM root was removed). A second pool for the same socket
 *   exits at once; a dead pool's socket is replaced.
 * - Anything unexpected (no pool, a refused or slow hand-off, a path too long for a unix socket) falls back to
 *   starting a supervisor directly (`--detach`).
 *
 * Each idle spare costs one Node process (~70 MB resident for the single executable); K is the knob.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { EventEmitter } from "node:events";
import { chmodSync, closeSync, existsSync, mkdirSync, openSync, unlinkSync } from "node:fs";
import net from "node:net";
import { availableParallelism } from "node:os";
import path from "node:path";
import {
  formatHandOff,
  LIST_REQUEST,
  MAX_HAND_OFF_REQUEST,
  MAX_WARM_SUPERVISORS,
  manyAnswer,
  parseHandOff,
  parseHandOffs,
  parsePidAnswer,
  pidAnswer,
  refusedAnswer,
  type SpareHandOff,
} from "../lib/runner-protocol.ts";
import type { StartsItem } from "./api-client.ts";
import { BUNDLE_UUID_RE, lockFile, type RunnerPaths } from "./paths.ts";
import { parseStartDocument } from "./start-doc.ts";

export const SPARE_IDLE_MS = 10 * 60_000;
const HAND_OFF_TIMEOUT_MS = 1000;
/** How long a hand-off may wait on the socket for a spare to be ready before it is refused. */
const PENDING_MAX_MS = 3000;
/**
 * How long after a hand-off the warm pool starts the spares that replace those handed out: long enough for a
 * short bundle's supervisor to come back (RETURN_QUIET_MS after its bundle ended) and be the replacement.
 */
const REFILL_DELAY_MS = 3000;
/** A supervisor comes back to the pool after at most this many bundles (then it exits; a new spare replaces it). */
export const MAX_BUNDLES_PER_SUPERVISOR = 100;
/** ... or once its resident memory is above this. */
export const MAX_RETURN_RSS = 256 * 1024 * 1024;
/**
 * How long a supervisor waits after its bundle ended before it comes back to the pool: `--kill` for that bundle
 * checks the lock right before it signals the pid, and a signal still in flight after this long is not aimed at
 * the next bundle.
 */
export const RETURN_QUIET_MS = 250;
/** The first line a supervisor coming back sends on the pool's socket: `spare <pid>`. */
const RETURN_LINE = /^spare (\d{1,10})$/;
/** The one line a supervisor sends on the pool's socket when its bundle's command has exited: `ended <pid>`. */
const ENDED_LINE = /^ended (\d{1,10})$/;
/**
 * How long the refill counts a supervisor whose bundle has ended (it said `ended <pid>`) as on its way back: its
 * outputs and final report come first, which take seconds on a busy instance. One that exits instead is
 * forgotten as soon as the pool sees it gone.
 */
const ENDED_RETURN_MAX_MS = 30_000;
/** How often the pool looks whether a supervisor on its way back after `ended` is still there. */
const ENDED_CHECK_MS = 1000;
/** How long a spare may take to answer a hand-off before it is killed and the hand-off refused. */
const ANSWER_MAX_MS = 3000;
/**
 * How long a spare the pool started may take to be ready (its start-up is hundreds of ms, seconds on a busy
 * instance) before the pool kills it and starts another; a supervisor come back says so at once.
 */
const SPARE_READY_MAX_MS = 30_000;
const RETURN_READY_MAX_MS = 5_000;
/** sun_path holds 108 bytes with its NUL (so a local VM's root may be up to 74 bytes long for spares). */
const MAX_SOCKET_PATH = 107;

/** The spare socket of the runner started by `command`, or null when the path is too long for a socket. */
export function spareSocketPath(paths: RunnerPaths, command: readonly string[]): string | null {
  const hash = createHash("sha256").update(command.join("\0")).digest("hex").slice(0, 10);
  const file = `${paths.root}/var/run/cr-spare-${hash}.sock`;
  return Buffer.byteLength(file) <= MAX_SOCKET_PATH ? file : null;
}

/**
 * Hands a start document to the warm pool (from `--detach`, which holds the lock); resolves to the pid of the
 * process that is now the bundle's supervisor, or null when there is no pool or it did not take the document.
 */
export function handToSpare(socketPath: string, uuid: string, doc: string): Promise<number | null> {
  return new Promise((resolve) => {
    let answer = "";
    let settled = false;
    const done = (pid: number | null) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      sock.destroy();
      resolve(pid);
    };
    const sock = net.connect(socketPath);
    const timer = setTimeout(() => done(null), HAND_OFF_TIMEOUT_MS);
    sock.setEncoding("utf8");
    sock.on("error", () => done(null));
    sock.on("connect", () => sock.end(formatHandOff({ mode: "detach", uuid, doc })));
    sock.on("data", (chunk: string) => {
      answer += chunk;
    });
    sock.on("end", () => done(parsePidAnswer(answer)));
  });
}

/** Opens the spare log (append) for a child's stdout and stderr; null when it cannot. */
function openSpareLog(paths: RunnerPaths): number | null {
  try {
    mkdirSync(paths.logDir, { recursive: true });
    return openSync(path.join(paths.logDir, "spare.log"), "a");
  } catch {
    return null;
  }
}

/** Starts the warm pool in its own session, writing to the spare log; does not wait for it. */
export function startWarmPool(
  paths: RunnerPaths,
  command: readonly string[],
  env: NodeJS.ProcessEnv,
  count: number,
): void {
  if (count <= 0) return;
  const out = openSpareLog(paths);
  if (out === null) return;
  try {
    const [cmd, ...args] = command;
    const child = spawn(cmd as string, [...args, "--warm-pool", String(count)], {
      detached: true,
      stdio: ["ignore", out, out],
      env,
    });
    child.on("error", () => {});
    child.unref();
  } catch {
    // No pool: the next --detach starts its supervisor itself.
  } finally {
    closeSync(out);
  }
}

/**
 * The pool's runner `start` call for a spare that took a hand-off from the dispatcher (`start` mode): its answer,
 * the server's refusal, or `ok: null` when it was not made or failed in transit (the spare then calls `start`
 * itself, as it does for `--detach`'s hand-offs).
 */
export type PoolStart = StartsItem | { ok: null; why: string };

/** The warm pool's messages to a spare and the spare's answers (over the Node IPC channel). */
export type ToSpare =
  | { type: "work"; work: SpareHandOff }
  | { type: "started"; uuid: string; start: PoolStart };
export type FromSpare = { type: "ready" } | { type: "took"; pid: number } | { type: "refused"; why: string };

/** A hand-off the spare took (lib/runner-protocol.ts). */
export type SpareWork = SpareHandOff;

/** warmSupervisors of a start document's text, or null when it names none (or is not one). */
function warmCountOf(doc: string): number | null {
  try {
    const v = (JSON.parse(doc) as { warmSupervisors?: unknown }).warmSupervisors;
    return typeof v === "number" && Number.isSafeInteger(v) && v >= 0 && v <= MAX_WARM_SUPERVISORS ? v : null;
  } catch {
    return null;
  }
}

/** What the pool needs of a spare: a process it started (IPC channel) or a supervisor come back (ReturnedSpare). */
interface SpareProc extends EventEmitter {
  send(message: ToSpare, callback: (err: Error | null) => void): boolean;
  kill(signal: NodeJS.Signals): boolean;
}

interface Spare {
  proc: SpareProc;
  ready: boolean;
  /** Holds a hand-off it has not answered yet. */
  busy: boolean;
}

interface Pending {
  work: SpareWork;
  /** Sends this hand-off's answer (a single hand-off's socket ends with it; a `many` one's after the last). */
  reply: (answer: string) => void;
  /** Its sender gave up (the socket closed): never handed to a spare after that. */
  closed: boolean;
  timer: NodeJS.Timeout;
}

/** A bundle whose runner `start` call the pool makes for the spare it handed the bundle to (startTogether). */
interface EarlyStart {
  uuid: string;
  apiUrl: string;
  token: string;
  /** The document's claimInFlight: an unknown token is asked for again (startsFor). */
  claimInFlight: boolean;
  proc: SpareProc;
}

export interface WarmPoolOptions {
  socketPath: string;
  paths: RunnerPaths;
  /** The command that starts this runner (a spare is `[...command, "--spare"]`). */
  command: readonly string[];
  env: NodeJS.ProcessEnv;
  /** Spares to keep ready until a hand-off says otherwise. */
  count: number;
  /** What `crunch-run --list` prints, for a probe's LIST_REQUEST on the socket. */
  list?: () => Promise<string>;
  idleMs?: number;
}

/**
 * The warm pool's life: resolves when it exits (idle, socket gone, or another pool has the socket). Idle spares
 * exit with it.
 */
export async function runWarmPool(opts: WarmPoolOptions): Promise<void> {
  const { socketPath, paths, command, env } = opts;
  const idleMs = opts.idleMs ?? SPARE_IDLE_MS;
  mkdirSync(path.dirname(socketPath), { recursive: true });
  const server = net.createServer({ allowHalfOpen: true });
  if (!(await listen(server, socketPath))) return;
  chmodSync(socketPath, 0o600);
  // The `start` calls the pool makes for its spares (startTogether) should not wait for this module's loading.
  void import("./api-client.ts").catch(() => {});
  let target = Math.min(MAX_WARM_SUPERVISORS, Math.max(0, opts.count));
  const parallel = Math.max(1, Math.floor(availableParallelism() / 2));
  const spares = new Set<Spare>();
  const pending: Pending[] = [];
  let closing = false;
  let earlyExits = 0;

  const count = (pred: (s: Spare) => boolean) => [...spares].filter(pred).length;

  /**
   * Supervisors lent out, by pid, with the time until which the refill counts them as spares on their way back, so
   * that back-to-back bundles cost no new process: REFILL_DELAY_MS from the hand-off, and ENDED_RETURN_MAX_MS from
   * the supervisor's `ended <pid>` (its bundle's command has exited; it comes back once its outputs and final
   * report are done, RETURN_QUIET_MS later). One whose bundle is still running after REFILL_DELAY_MS is taken to
   * run a long bundle, and replaced; so is one that said `ended` and is gone (looked at every ENDED_CHECK_MS).
   */
  const lent = new Map<number, { until: number; ended: boolean }>();
  /** How many supervisors are on their way back; forgets the others, and refills again when the next one is due. */
  const comingBack = (): number => {
    const now = Date.now();
    let next = Number.POSITIVE_INFINITY;
    for (const [pid, { until, ended }] of lent) {
      if (now >= until || (ended && !alive(pid))) lent.delete(pid);
      else next = Math.min(next, ended ? now + ENDED_CHECK_MS : until);
    }
    if (lent.size > 0) refillIn(next - now);
    return lent.size;
  };
  /** A lent supervisor's bundle has ended: it is on its way back for a while longer. */
  const ended = (pid: number) => {
    if (!lent.has(pid)) return;
    lent.set(pid, { until: Date.now() + ENDED_RETURN_MAX_MS, ended: true });
    refillIn(ENDED_CHECK_MS);
  };

  /**
   * Spawns spares: one at once per waiting hand-off that has none, and the background refill up to `target` free
   * ones (counting supervisors on their way back).
   */
  const fill = () => {
    if (closing) return;
    const free = count((s) => !s.busy);
    const warming = count((s) => !s.ready);
    const want = Math.max(pending.length - free, target + pending.length - free - comingBack());
    const now = Math.max(pending.length - warming, parallel - warming);
    for (let i = 0; i < Math.min(want, now); i++) spawnSpare();
  };

  /**
   * The background refill after a hand-off, REFILL_DELAY_MS later: a spare's start-up (a new Node process, hundreds
   * of ms of CPU) would otherwise compete with the supervisors just handed their bundles, whose `start` calls are
   * what the bundles wait for, and the supervisors of short bundles are back by then.
   */
  let refillTimer: NodeJS.Timeout | null = null;
  let refillDue = Number.POSITIVE_INFINITY;
  const refillIn = (ms: number) => {
    const due = Date.now() + Math.max(0, ms);
    if (refillTimer !== null && refillDue <= due) return;
    if (refillTimer !== null) clearTimeout(refillTimer);
    refillDue = due;
    refillTimer = setTimeout(
      () => {
        refillTimer = null;
        refillDue = Number.POSITIVE_INFINITY;
        fill();
      },
      Math.max(0, ms),
    );
  };
  const refillSoon = () => refillIn(REFILL_DELAY_MS);

  const spawnSpare = () => {
    const out = openSpareLog(paths);
    if (out === null) return;
    let proc: ChildProcess;
    try {
      const [cmd, ...args] = command;
      proc = spawn(cmd as string, [...args, "--spare"], {
        detached: true,
        stdio: ["ignore", out, out, "ipc"],
        env,
      });
    } catch {
      return;
    } finally {
      closeSync(out);
    }
    adopt(proc as SpareProc, false);
  };

  /**
   * Takes a spare in: one it started, or a supervisor come back after its bundle (`returned`). Either is let go
   * when it gets ready while the pool already has what it wants ready: a supervisor whose bundle outlasted
   * REFILL_DELAY_MS may come back while the spare started in its place still warms up, and whichever of the two
   * is ready second is one too many (kept, the pool would hold K + 1 spares until one is used).
   */
  const adopt = (proc: SpareProc, returned: boolean) => {
    const spare: Spare = { proc, ready: false, busy: false };
    spares.add(spare);
    proc.on("error", () => {});
    // One that is never ready would count as warming up for ever, and hold back the refill (fill).
    const notReady = setTimeout(
      () => {
        if (!spares.has(spare) || spare.ready) return;
        proc.kill("SIGKILL");
        lost(spare, returned);
      },
      returned ? RETURN_READY_MAX_MS : SPARE_READY_MAX_MS,
    );
    notReady.unref();
    proc.on("message", (m: FromSpare) => {
      if (m?.type !== "ready" || !spares.has(spare) || spare.ready) return;
      clearTimeout(notReady);
      if (count((s) => s.ready && !s.busy) >= target + pending.length) {
        spares.delete(spare);
        proc.kill("SIGTERM");
        return;
      }
      spare.ready = true;
      earlyExits = 0;
      dispatch();
      fill();
    });
    proc.once("exit", () => {
      clearTimeout(notReady);
      lost(spare, returned);
    });
  };

  /** A spare gone (it exited, or was let go for never being ready): the pool starts another in its place. */
  const lost = (spare: Spare, returned: boolean) => {
    if (!spares.delete(spare)) return;
    // A spare that died while it held a hand-off answered nothing: the hand-off's own listener refuses it.
    if (returned) {
      fill();
      return;
    }
    // Spares that die before they are ready are started again later and later (1 s, doubling, at most 1 min).
    if (!spare.ready) earlyExits++;
    setTimeout(fill, Math.min(60_000, 1000 * 2 ** Math.min(6, earlyExits))).unref();
  };

  /**
   * Lets ready spares go, newest first, while the pool holds more than it wants: a hand-off that lowered K (the
   * operator lowered dispatcher.warmSupervisors) would otherwise leave the extra processes idle until the pool
   * exits. Spares still warming up go when they are ready (adopt).
   */
  const retireExtra = () => {
    const free = [...spares].filter((s) => s.ready && !s.busy);
    for (const spare of free.slice(target + pending.length)) {
      spares.delete(spare);
      spare.proc.kill("SIGTERM");
    }
  };

  const answer = (p: Pending, text: string) => {
    clearTimeout(p.timer);
    if (!p.closed) p.reply(text);
  };

  /**
   * Gives waiting hand-offs to ready spares, oldest first. For hand-offs straight from the dispatcher, the pool
   * makes the bundles' `start` calls as it hands them over (startableDoc, startTogether), and the spares get their
   * work once those calls are answered (at most HOLD_MAX_MS later): ten spares waking at once (each parses its
   * document, takes its lock and starts its bundle) would take the CPU from the calls the bundles wait for. Other
   * hand-offs go to their spares in the next turn of the event loop.
   */
  const dispatch = () => {
    const held: { spare: Spare; p: Pending }[] = [];
    const now: { spare: Spare; p: Pending }[] = [];
    const early: EarlyStart[] = [];
    for (;;) {
      while (pending.length > 0 && pending[0]?.closed) pending.shift();
      const p = pending[0];
      const spare = [...spares].find((s) => s.ready && !s.busy);
      if (p === undefined || spare === undefined) break;
      pending.shift();
      spare.busy = true;
      clearTimeout(p.timer);
      const doc = p.work.mode === "start" ? startableDoc(p.work, paths) : null;
      if (doc === null) now.push({ spare, p });
      else {
        held.push({ spare, p });
        early.push({ uuid: p.work.uuid, ...doc, proc: spare.proc });
      }
    }
    if (early.length > 0)
      void startTogether(early, () => {
        for (const g of held) giveTo(g.spare, g.p, true);
      });
    if (now.length > 0)
      setImmediate(() => {
        for (const g of now) giveTo(g.spare, g.p, false);
      });
  };

  /** Sends a busy spare its hand-off (`early`: the pool makes its `start` call) and waits for its answer. */
  const giveTo = (spare: Spare, p: Pending, early: boolean) => {
    const settle = (text: string) => {
      spare.proc.off("message", onAnswer);
      spare.proc.off("exit", onExit);
      clearTimeout(noAnswer);
      answer(p, text);
    };
    const onAnswer = (m: FromSpare) => {
      if (m?.type === "took") {
        // It is that bundle's supervisor now; the pool forgets it (its exit is none of the pool's business),
        // once it has the pool's `start` call's answer for a hand-off straight from the dispatcher.
        spares.delete(spare);
        spare.proc.removeAllListeners("message");
        spare.proc.removeAllListeners("exit");
        // One the pool made no call for (it did not look startable, yet the spare took it) makes its own.
        if (p.work.mode === "start" && !early) {
          const start: PoolStart = { ok: null, why: "the pool made no start call" };
          spare.proc.send({ type: "started", uuid: p.work.uuid, start } satisfies ToSpare, () => {});
        }
        settle(pidAnswer(m.pid));
        lent.set(m.pid, { until: Date.now() + REFILL_DELAY_MS, ended: false });
        refillSoon();
      } else if (m?.type === "refused") {
        spare.busy = false;
        settle(refusedAnswer(m.why));
        dispatch();
      }
    };
    const onExit = () => settle(refusedAnswer("the spare exited"));
    const noAnswer = setTimeout(() => {
      settle(refusedAnswer("the spare did not answer"));
      spares.delete(spare);
      spare.proc.kill("SIGKILL");
      fill();
    }, ANSWER_MAX_MS);
    spare.proc.on("message", onAnswer);
    spare.proc.once("exit", onExit);
    spare.proc.send({ type: "work", work: p.work } satisfies ToSpare, (err) => {
      if (err) settle(refusedAnswer("the spare is gone"));
    });
  };

  let idle: NodeJS.Timeout;
  const resetIdle = () => {
    clearTimeout(idle);
    idle = setTimeout(() => close(true), idleMs);
  };
  let done: () => void = () => {};
  const finished = new Promise<void>((resolve) => {
    done = resolve;
  });
  const close = (unlink: boolean) => {
    if (closing) return;
    closing = true;
    clearTimeout(idle);
    if (refillTimer !== null) clearTimeout(refillTimer);
    clearInterval(watch);
    server.close();
    if (unlink) {
      try {
        unlinkSync(socketPath);
      } catch {
        // Already gone.
      }
    }
    for (const p of pending.splice(0)) answer(p, refusedAnswer("the warm pool is closing"));
    for (const s of spares) if (!s.busy) s.proc.kill("SIGTERM");
    done();
  };
  resetIdle();
  const watch = setInterval(() => {
    if (!existsSync(socketPath)) close(false);
  }, 2000);

  server.on("connection", (sock) => {
    let text = "";
    sock.setEncoding("utf8");
    sock.on("error", () => {});
    const onData = (chunk: string) => {
      text += chunk;
      if (text.length > MAX_HAND_OFF_REQUEST) sock.destroy();
      const nl = text.indexOf("\n");
      // A supervisor whose bundle has ended (`ended <pid>`): nothing more comes on this connection.
      const endedPid = nl < 0 ? null : ENDED_LINE.exec(text.slice(0, nl))?.[1];
      if (endedPid !== undefined && endedPid !== null) {
        sock.off("data", onData);
        sock.removeAllListeners("end");
        sock.destroy();
        ended(Number(endedPid));
        return;
      }
      // A supervisor coming back (`spare <pid>`, then messages as lines of JSON) rather than a hand-off.
      const pid = nl < 0 ? null : RETURN_LINE.exec(text.slice(0, nl))?.[1];
      if (pid === undefined || pid === null) return;
      sock.off("data", onData);
      sock.removeAllListeners("end");
      if (closing) {
        sock.destroy();
        return;
      }
      const rest = text.slice(nl + 1);
      text = "";
      lent.delete(Number(pid));
      adopt(new ReturnedSpare(sock, rest), true);
    };
    sock.on("data", onData);
    sock.on("end", () => {
      // A probe's listing: answered from this process (no `--list` process), and no reason to stay up.
      if (text === LIST_REQUEST && opts.list !== undefined && !closing) {
        opts.list().then(
          (listing) => sock.end(listing),
          () => sock.destroy(),
        );
        return;
      }
      // One hand-off (`--detach`'s), or several of one instance at once (the dispatcher's, `many`).
      const many = text.startsWith("many ") ? parseHandOffs(text) : null;
      const one = many === null ? parseHandOff(text) : null;
      const works = many ?? (one === null ? [] : [one]);
      if (closing || works.length === 0) {
        sock.end(refusedAnswer(works.length === 0 ? "not a hand-off" : "the warm pool is closing"));
        return;
      }
      resetIdle();
      const k = warmCountOf(works[0]!.doc);
      if (k !== null) target = k;
      let left = works.length;
      const ps = works.map((work) => {
        const p: Pending = {
          work,
          reply:
            many === null
              ? (a) => sock.end(a)
              : (a) => {
                  left--;
                  sock.write(manyAnswer(work.uuid, a));
                  if (left === 0) sock.end();
                },
          closed: false,
          timer: setTimeout(() => {
            const i = pending.indexOf(p);
            if (i >= 0) pending.splice(i, 1);
            answer(p, refusedAnswer("no spare ready in time"));
          }, PENDING_MAX_MS),
        };
        return p;
      });
      // Its sender gave up (--detach's or the dispatcher's timeout): never hand it to a spare after that.
      sock.on("close", () => {
        for (const p of ps) p.closed = true;
      });
      pending.push(...ps);
      dispatch();
      if (k !== null) retireExtra();
      // A hand-off still waiting needs a spare now; else the refill waits until the one just handed has started.
      if (pending.length > 0) fill();
      else refillSoon();
    });
  });

  fill();
  await finished;
}

/**
 * The start document of a hand-off straight from the dispatcher whose spare will take it, as far as the pool can
 * tell (the checks a spare makes: the uuid, the document, the instance not preempted, no lock on the bundle
 * yet); null otherwise. The pool makes the `start` call only for such a hand-off: a bundle whose spare then
 * refuses it anyway (a lock taken meanwhile by another supervisor, which holds the bundle; a notice of
 * preemption meanwhile; a spare that dies) is running with no supervisor here, which the dispatcher handles as
 * it does a supervisor's death (its hand-off was refused, so it runs `--detach`, whose supervisor's own `start`
 * under the same token succeeds; else the bundle is not listed and is requeued).
 */
function startableDoc(
  work: SpareWork,
  paths: RunnerPaths,
): Pick<EarlyStart, "apiUrl" | "token" | "claimInFlight"> | null {
  if (!BUNDLE_UUID_RE.test(work.uuid)) return null;
  try {
    const doc = parseStartDocument(work.doc, work.uuid);
    if (existsSync(paths.preemptedFile) || existsSync(lockFile(paths, work.uuid))) return null;
    return { apiUrl: doc.apiUrl, token: doc.token, claimInFlight: doc.claimInFlight };
  } catch {
    return null;
  }
}

/**
 * The runner `start` calls of bundles the pool handed to spares (startableDoc), made by the pool in one `starts`
 * call per server; `give` sends the spares their work once the answers are back, or HOLD_MAX_MS after the call
 * left, whichever is first. Each answer then goes to its spare (which keeps it until it has taken the bundle, when
 * the call was late). The pool's HTTP client and its connection to the server are warm, where a spare's are cold,
 * a burst's spares do not each make a call of their own, and neither the call nor its statement on the server
 * shares the CPU with the spares waking (docs/performance.md). One attempt; anything but the server's answer for a
 * bundle leaves its call to the spare.
 */
async function startTogether(taken: EarlyStart[], give: () => void): Promise<void> {
  let given = false;
  const giveOnce = () => {
    if (given) return;
    given = true;
    give();
  };
  const late = setTimeout(giveOnce, HOLD_MAX_MS);
  const starts = await startsFor(taken);
  clearTimeout(late);
  giveOnce();
  for (const [i, t] of taken.entries()) {
    const start = starts[i] ?? { ok: null, why: "no answer" };
    t.proc.send({ type: "started", uuid: t.uuid, start } satisfies ToSpare, () => {});
  }
}

/**
 * The longest the pool holds a spare's work back for its `start` call (startTogether). A spare does nothing with a
 * bundle but take its lock before it has the answer, so holding costs the bundle that much; a slow server costs
 * this, and the spare's own call (POOL_START_WAIT_MS after it took the bundle) stays within the dispatcher's
 * 5 s hand-off exchange.
 */
const HOLD_MAX_MS = 1000;

/**
 * When the pool asks again for a token the server did not know, if its document says the claim was in flight
 * (claimInFlight; a REST server other than the dispatcher's own): ms after each answer, the last repeated, for at
 * most UNKNOWN_TOKEN_RETRY_FOR_MS after the first call left. Within HOLD_MAX_MS + POOL_START_WAIT_MS, so the
 * spare still has the pool's answer before it would call itself.
 */
const UNKNOWN_TOKEN_RETRIES_MS = [2, 5, 10, 20, 50, 100, 200, 300, 500];
const UNKNOWN_TOKEN_RETRY_FOR_MS = 2500;

/**
 * The `start` answers for these runners, in their order (startTogether): one `starts` call per server, then again
 * for the tokens it did not know whose claim may still have been in flight (UNKNOWN_TOKEN_RETRIES_MS).
 */
async function startsFor(taken: readonly EarlyStart[]): Promise<PoolStart[]> {
  const out: PoolStart[] = taken.map(() => ({ ok: null, why: "no answer" }));
  const byServer = new Map<string, number[]>();
  for (const [index, { apiUrl }] of taken.entries()) {
    const list = byServer.get(apiUrl) ?? [];
    list.push(index);
    byServer.set(apiUrl, list);
  }
  await Promise.all(
    [...byServer].map(async ([apiUrl, all]) => {
      let list = all;
      try {
        const { createRunnerClient } = await import("./api-client.ts");
        const client = createRunnerClient({ apiUrl, token: null, caller: "warm pool" });
        const until = Date.now() + UNKNOWN_TOKEN_RETRY_FOR_MS;
        for (let round = 0; ; round++) {
          const items = await client.starts(list.map((index) => taken[index]!.token));
          const again: number[] = [];
          for (const [i, index] of list.entries()) {
            const item = items[i];
            if (item === undefined) continue;
            out[index] = item.ok
              ? item
              : item.status >= 500
                ? { ok: null, why: `${item.status} ${item.code}` }
                : item;
            if (!item.ok && item.code === "auth.invalid_token" && taken[index]!.claimInFlight)
              again.push(index);
          }
          const wait = UNKNOWN_TOKEN_RETRIES_MS[Math.min(round, UNKNOWN_TOKEN_RETRIES_MS.length - 1)]!;
          if (again.length === 0 || Date.now() + wait > until) return;
          await new Promise((resolve) => setTimeout(resolve, wait));
          list = again;
        }
      } catch (err) {
        const why = err instanceof Error ? err.message : String(err);
        for (const index of list) out[index] = { ok: null, why };
      }
    }),
  );
  return out;
}

/**
 * A supervisor that came back to the pool after its bundle, spoken to over its connection to the pool's socket:
 * messages are lines of JSON both ways. Its process is not the pool's child, and the pid it names is only its
 * word: the pool never signals it. Any kill closes the connection (the supervisor then exits, as a spare does
 * when its pool goes).
 */
class ReturnedSpare extends EventEmitter implements SpareProc {
  readonly #sock: net.Socket;
  #gone = false;

  constructor(sock: net.Socket, buffered: string) {
    super();
    this.#sock = sock;
    readLines(sock, buffered, MAX_LINE, (line) => {
      let m: unknown;
      try {
        m = JSON.parse(line);
      } catch {
        sock.destroy();
        return;
      }
      this.emit("message", m);
    });
    sock.on("close", () => {
      this.#gone = true;
      this.emit("exit");
    });
  }

  send(message: ToSpare, callback: (err: Error | null) => void): boolean {
    if (this.#gone) {
      queueMicrotask(() => callback(new Error("the supervisor is gone")));
      return false;
    }
    return this.#sock.write(`${JSON.stringify(message)}\n`, (err) => callback(err ?? null));
  }

  kill(): boolean {
    this.#sock.destroy();
    return true;
  }
}

/** The longest line either side sends on a returned supervisor's connection (a document is at most MAX_HAND_OFF_DOC). */
const MAX_LINE = 160 * 1024;

/** Calls `onLine` for each line read from `sock` (after `buffered`); a line longer than `max` ends it. */
function readLines(sock: net.Socket, buffered: string, max: number, onLine: (line: string) => void): void {
  let text = buffered;
  const drain = () => {
    for (let nl = text.indexOf("\n"); nl >= 0; nl = text.indexOf("\n")) {
      const line = text.slice(0, nl);
      text = text.slice(nl + 1);
      onLine(line);
    }
    if (text.length > max) sock.destroy();
  };
  sock.setEncoding("utf8");
  sock.on("data", (chunk: string) => {
    text += chunk;
    drain();
  });
  // What came with the first line is read once the caller has its listeners in place.
  process.nextTick(drain);
}

/** A spare's side of its channel to the pool: the IPC channel it was started with, or its socket come back. */
export interface SpareChannel {
  send(message: FromSpare, callback?: (err: Error | null) => void): void;
  onMessage(listener: (message: ToSpare) => void): void;
  /** `listener` runs once when the pool is gone (the channel closed without a `leave`). */
  onClose(listener: () => void): void;
  /** Leaves the channel: this process is a bundle's supervisor now. */
  leave(): void;
}

/** The IPC channel of a spare the pool started; null when there is none. */
export function ipcChannel(): SpareChannel | null {
  const send = process.send?.bind(process);
  if (send === undefined) return null;
  let left = false;
  return {
    send: (message, callback) => {
      send(message, callback ?? (() => {}));
    },
    onMessage: (listener) => {
      process.on("message", listener);
    },
    onClose: (listener) => {
      process.once("disconnect", () => {
        if (!left) listener();
      });
    },
    leave: () => {
      left = true;
      process.removeAllListeners("message");
      process.disconnect();
    },
  };
}

/** Whether a process exists (a zombie too: it is reaped moments later). */
function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}

/**
 * A supervisor's word to its pool that its bundle's command has exited and that it will be back (`ended <pid>`),
 * so that the pool does not start a spare in its place meanwhile. Sent and forgotten: a pool that is gone, or
 * does not answer, changes nothing here.
 */
export function notifyEnded(socketPath: string): void {
  const sock = net.connect(socketPath);
  sock.on("error", () => {});
  sock.unref();
  sock.end(`ended ${process.pid}\n`);
}

/**
 * A finished supervisor's way back to the pool: connects to its socket and says so (`spare <pid>`). Null when
 * there is no pool to go back to.
 */
export function rejoinPool(socketPath: string): Promise<SpareChannel | null> {
  return new Promise((resolve) => {
    const sock = net.connect(socketPath);
    sock.once("error", () => resolve(null));
    sock.once("connect", () => {
      sock.on("error", () => {});
      sock.write(`spare ${process.pid}\n`);
      let left = false;
      const listeners: ((m: ToSpare) => void)[] = [];
      readLines(sock, "", MAX_LINE, (line) => {
        let m: ToSpare;
        try {
          m = JSON.parse(line) as ToSpare;
        } catch {
          sock.destroy();
          return;
        }
        for (const l of listeners) l(m);
      });
      resolve({
        send: (message, callback) => {
          sock.write(`${JSON.stringify(message)}\n`, (err) => callback?.(err ?? null));
        },
        onMessage: (listener) => {
          listeners.push(listener);
        },
        onClose: (listener) => {
          sock.once("close", () => {
            if (!left) listener();
          });
        },
        leave: () => {
          left = true;
          listeners.length = 0;
          sock.end();
        },
      });
    });
  });
}

/**
 * A spare's wait (the child side): tells the pool it is ready, then takes the first hand-off that `accept`
 * takes (it resolves to null, or to why it refuses) and resolves to it once the pool has its pid; resolves to
 * null when the pool goes first. Refused hand-offs leave the spare waiting. For a hand-off straight from the
 * dispatcher (`start`) it then waits for the pool's `start` call (`start`; at most POOL_START_WAIT_MS, and
 * `ok: null` when the pool goes or is late: the spare calls `start` itself). The pool makes that call as it
 * hands the bundle over, so its answer may come while the spare still takes the bundle: it is kept until then.
 */
export function waitForWork(
  channel: SpareChannel,
  accept: (work: SpareWork) => Promise<string | null>,
): Promise<{ work: SpareWork; start: PoolStart | null } | null> {
  return new Promise((resolve) => {
    let settled = false;
    let late: NodeJS.Timeout | undefined;
    const settle = (got: { work: SpareWork; start: PoolStart | null } | null) => {
      if (settled) return;
      settled = true;
      clearTimeout(late);
      if (got !== null) channel.leave();
      resolve(got);
    };
    const startedBy = (work: SpareWork, start: PoolStart) => settle({ work, start });
    /** The pool has this spare's `took` (sent): from then on the bundle is this process's, pool or no pool. */
    let tookSent: SpareWork | null = null;
    /**
     * The hand-off this spare is taking or took (from its `work` to its refusal, or for good), and the pool's
     * answer for it so far. While there is one, other hand-offs are not looked at (the pool gives a spare one at a
     * time).
     */
    let current: SpareWork | null = null;
    let kept: PoolStart | null = null;
    channel.onClose(() =>
      tookSent === null ? settle(null) : startedBy(tookSent, { ok: null, why: "the pool went" }),
    );
    channel.onMessage((m: ToSpare) => {
      if (m?.type === "started") {
        // Only for the bundle this spare is taking or took (an answer for one it refused is stale).
        if (current === null || m.uuid !== current.uuid) return;
        const start = isPoolStart(m.start) ? m.start : { ok: null, why: "not a start answer" };
        if (tookSent !== null) startedBy(tookSent, start);
        else kept ??= start;
        return;
      }
      if (current !== null || m?.type !== "work") return;
      const work = m.work;
      current = work;
      kept = null;
      accept(work).then(
        (refusal) => {
          if (refusal !== null) {
            current = null;
            channel.send({ type: "refused", why: refusal });
            return;
          }
          channel.send({ type: "took", pid: process.pid }, (err: Error | null) => {
            if (err) {
              // The pool cannot pass the pid on: whoever handed the bundle over falls back; not this process.
              settle(null);
              return;
            }
            tookSent = work;
            if (work.mode !== "start") {
              settle({ work, start: null });
              return;
            }
            if (kept !== null) {
              startedBy(work, kept);
              return;
            }
            late = setTimeout(
              () => startedBy(work, { ok: null, why: "the pool's start call was late" }),
              POOL_START_WAIT_MS,
            );
          });
        },
        (err: unknown) => {
          current = null;
          channel.send({ type: "refused", why: String(err) });
        },
      );
    });
    channel.send({ type: "ready" });
  });
}

/** How long a spare that took a bundle waits for the pool's `start` call before it makes its own. */
const POOL_START_WAIT_MS = 2000;

function isPoolStart(v: unknown): v is PoolStart {
  if (typeof v !== "object" || v === null) return false;
  const o = v as Record<string, unknown>;
  if (o["ok"] === true) {
    const b = o["body"] as Record<string, unknown> | null;
    return (
      typeof b === "object" &&
      b !== null &&
      typeof b["uuid"] === "string" &&
      typeof b["state"] === "string" &&
      typeof b["attempt"] === "number"
    );
  }
  if (o["ok"] === false)
    return (
      typeof o["status"] === "number" && typeof o["code"] === "string" && typeof o["message"] === "string"
    );
  return o["ok"] === null && typeof o["why"] === "string";
}

/** Listens on the socket; false when another live pool has it. A dead pool's socket file is replaced. */
async function listen(server: net.Server, socketPath: string): Promise<boolean> {
  for (let attempt = 0; attempt < 2; attempt++) {
    const err = await new Promise<NodeJS.ErrnoException | null>((resolve) => {
      server.once("error", resolve);
      server.listen({ path: socketPath, readableAll: false, writableAll: false }, () => resolve(null));
    });
    if (err === null) return true;
    if (err.code !== "EADDRINUSE") return false;
    const alive = await new Promise<boolean>((resolve) => {
      const probe = net.connect(socketPath);
      probe.on("connect", () => {
        probe.destroy();
        resolve(true);
      });
      probe.on("error", () => resolve(false));
    });
    if (alive) return false;
    try {
      unlinkSync(socketPath);
    } catch {
      return false;
    }
  }
  return false;
}
