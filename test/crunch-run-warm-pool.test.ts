/**
 * crunch-run's warm pool (crunch-run/spare.ts) with real processes: a REST server in process (PGlite), crunch-run
 * from sources with its own DISPATCH_VM_ROOT, hand-offs sent to the pool's socket as `--detach` and the
 * dispatcher send them (`start <uuid>\n<document>`, and several at once: `many <n>\n...`).
 */
import { spawn } from "node:child_process";
import { readFileSync, rmSync, statSync } from "node:fs";
import { readFile } from "node:fs/promises";
import http from "node:http";
import net from "node:net";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { findPids, isAlive, processState, readCmdline } from "../cloud-drivers/local/procs.ts";
import { holderAlive, parseLock, readLockText } from "../crunch-run/lock.ts";
import { lockFile, runnerPaths } from "../crunch-run/paths.ts";
import { spareSocketPath } from "../crunch-run/spare.ts";
import { probeList } from "../dispatcher/pool/probe.ts";
import { runnerCommands } from "../dispatcher/pool/runner-commands.ts";
import type { Executor } from "../lib/executor.ts";
import {
  detachAnswerSpare,
  formatHandOff,
  formatHandOffs,
  LIST_REQUEST,
  parseManyAnswers,
  parsePidAnswer,
} from "../lib/runner-protocol.ts";
import { hashToken, newRunnerToken } from "../lib/tokens.ts";
import { getBundle } from "../store/queries.ts";
import { startBundle } from "../store/transitions.ts";
import { type RunnerHarness, startRunnerHarness, stopProcessesOf } from "./crunch-run-harness.ts";
import { useTestDb } from "./db.ts";

type Started = { uuid: string; token: string; attempt: number };

// Each test starts real processes (a spare is a Node process: 1-3 s on a slow machine, several times that while
// the rest of the suite runs beside it) and some wait out the pool's own delays: the bounds are generous so that
// a loaded machine is not taken for a pool that fails.
describe("crunch-run warm pool (process runtime)", { timeout: 120_000 }, () => {
  const getDb = useTestDb("pglite");
  let h: RunnerHarness;
  beforeAll(async () => {
    h = await startRunnerHarness(getDb());
  });
  afterAll(async () => {
    for (const pid of pidsTitled(h.root, "crunch-run warm-pool")) kill(pid);
    await h?.close();
  });

  const doc = (b: Started, extra: Record<string, unknown> = {}) =>
    `${JSON.stringify({
      uuid: b.uuid,
      attempt: b.attempt,
      apiUrl: h.apiUrl,
      token: b.token,
      instanceType: "small",
      gpuDevices: [],
      runtimeEngine: "process",
      heartbeatIntervalMs: 200,
      ...extra,
    })}\n`;

  /** The socket the pool of crunch-run (as the harness runs it) listens on, from its --list line. */
  const socketOf = async (): Promise<string> => {
    const line = /^spare (\S+)$/m.exec((await h.crunchRun(["--list"])).stdout)?.[1];
    if (line === undefined) throw new Error("--list shows no spare socket");
    return line;
  };

  /** Waits until the pool's ready spares are `k` processes, the same ones a second apart, and returns them. */
  const steadySpares = async (k: number): Promise<number[]> => {
    let spares: number[] = [];
    await waitFor(async () => {
      const before = pidsTitled(h.root, "crunch-run spare");
      await new Promise((r) => setTimeout(r, 1000));
      spares = pidsTitled(h.root, "crunch-run spare");
      return before.length === k && spares.length === k && before.every((p) => spares.includes(p));
    });
    return spares;
  };

  /** Starts the pool through a first --detach with `warmSupervisors: k`, and waits for k ready spares. */
  const poolOf = async (k: number): Promise<number[]> => {
    const first = await h.newStartingBundle({ command: ["true"] });
    const res = await h.detach(first, { warmSupervisors: k });
    expect(res.code, res.stderr).toBe(0);
    expect((await h.waitFinal(first.uuid)).state).toBe("ready");
    let spares: number[] = [];
    await waitFor(async () => {
      spares = pidsTitled(h.root, "crunch-run spare");
      return spares.length === k;
    }).catch(() => {
      throw new Error(
        `the pool has ${spares.length} ready spares after 60 s, not ${k}; ${runnerProcesses(h.root)}`,
      );
    });
    // --detach named the pool it started: the socket --list shows.
    expect(detachAnswerSpare(res.stdout)).toBe(await socketOf());
    return spares;
  };

  /**
   * Stops (SIGSTOP) the next spare process to appear, while it warms up (before its title says it is ready).
   * `pid()` is its pid once stopped; `done()` ends the watch and lets it go on (SIGCONT).
   */
  const stopNextSpare = () => {
    let stopped: number | undefined;
    let watching = true;
    const watch = (async () => {
      while (watching && stopped === undefined) {
        for (const pid of findPids({ env: ["DISPATCH_VM_ROOT", h.root] })) {
          if ((readCmdline(pid) ?? []).at(-1) !== "--spare") continue;
          process.kill(pid, "SIGSTOP");
          stopped = pid;
          break;
        }
        await new Promise((r) => setTimeout(r, 2));
      }
    })();
    return {
      pid: () => stopped,
      async done() {
        watching = false;
        await watch;
        if (stopped !== undefined) kill(stopped, "SIGCONT");
      },
    };
  };

  it("keeps K spares ready; back-to-back starts and a burst of K each go to a spare that was waiting", async () => {
    const spares = await poolOf(3);
    const socket = await socketOf();
    // Mode 0600: the hand-off carries the runner token.
    expect(statSync(socket).mode & 0o777).toBe(0o600);
    // Exactly one pool, which names no token on its command line.
    const pools = pidsTitled(h.root, "crunch-run warm-pool");
    expect(pools).toHaveLength(1);

    // Back to back: the second hand-off follows the first's answer at once, before any new spare could be ready.
    const a = await h.newStartingBundle({ command: ["sh", "-c", 'echo a > "$DISPATCH_OUTPUT_DIR/x"'] });
    const b = await h.newStartingBundle({ command: ["sh", "-c", 'echo b > "$DISPATCH_OUTPUT_DIR/x"'] });
    const pidA = await handOff(socket, "start", a.uuid, doc(a, { warmSupervisors: 3 }));
    const pidB = await handOff(socket, "start", b.uuid, doc(b, { warmSupervisors: 3 }));
    expect(spares).toContain(pidA);
    expect(spares).toContain(pidB);
    expect(pidB).not.toBe(pidA);
    expect((await h.waitFinal(a.uuid)).state).toBe("ready");
    expect((await h.waitFinal(b.uuid)).state).toBe("ready");
    expect(await h.output(a.uuid, "x")).toEqual({ status: 200, body: "a\n" });
    expect(await h.output(b.uuid, "x")).toEqual({ status: 200, body: "b\n" });

    // The pool fills up again, then a burst of K hand-offs in one exchange, as the dispatcher sends one pass's
    // starts on an instance (`many`): every one goes to a spare already waiting, each answered on its own line.
    let ready: number[] = [];
    await waitFor(async () => {
      ready = pidsTitled(h.root, "crunch-run spare");
      return ready.length === 3;
    });
    const burst = await Promise.all([0, 1, 2].map(() => h.newStartingBundle({ command: ["true"] })));
    const answers = parseManyAnswers(
      await exchange(
        socket,
        formatHandOffs(
          burst.map((x) => ({ mode: "start", uuid: x.uuid, doc: doc(x, { warmSupervisors: 3 }) })),
        ),
      ),
    );
    expect([...answers.keys()].sort()).toEqual(burst.map((x) => x.uuid).sort());
    const pids = burst.map((x) => parsePidAnswer(answers.get(x.uuid) ?? "") ?? -1);
    expect(new Set(pids).size).toBe(3);
    for (const pid of pids) expect(ready).toContain(pid);
    for (const x of burst) expect((await h.waitFinal(x.uuid)).state).toBe("ready");
    // Still one pool; nothing it or its spares logged holds a token.
    expect(pidsTitled(h.root, "crunch-run warm-pool")).toEqual(pools);
    const spareLog = readFileSync(join(h.root, "var", "log", "crunch-run", "spare.log"), "utf8");
    for (const x of [a, b, ...burst]) expect(spareLog).not.toContain(x.token);
  });

  it("a spare takes the lock in its own name, and a second start of a bundle it runs is refused", async () => {
    const socket = await socketOf();
    const x = await h.newStartingBundle({ command: ["sleep", "30"] });
    const pid = await handOff(socket, "start", x.uuid, doc(x));
    expect(pid).toBeGreaterThan(0);
    await h.waitState(x.uuid, ["running"]);
    // The spare took the bundle's lock in its own name: --list shows the bundle.
    const lock = parseLock((await readLockText(lockFile(runnerPaths(h.env), x.uuid))) ?? "");
    expect(lock?.pid).toBe(pid);
    expect(await h.listBundles()).toContain(x.uuid);
    const again = await exchange(socket, formatHandOff({ mode: "start", uuid: x.uuid, doc: doc(x) }));
    expect(again).toMatch(/^refused bundle .* is already running/);
    // In one exchange with another bundle: that one refused, the other taken, each on its own line.
    const y = await h.newStartingBundle({ command: ["true"] });
    const both = parseManyAnswers(
      await exchange(
        socket,
        formatHandOffs([
          { mode: "start", uuid: x.uuid, doc: doc(x) },
          { mode: "start", uuid: y.uuid, doc: doc(y) },
        ]),
      ),
    );
    expect(both.get(x.uuid)).toMatch(/^refused bundle .* is already running/);
    expect(parsePidAnswer(both.get(y.uuid) ?? "")).toBeGreaterThan(0);
    expect((await h.waitFinal(y.uuid)).state).toBe("ready");
    // Not a well-formed `many` request: refused as a whole.
    expect(
      await exchange(socket, `many 2\n${formatHandOff({ mode: "start", uuid: y.uuid, doc: doc(y) })}`),
    ).toBe("refused not a hand-off\n");
    expect((await h.crunchRun(["--kill", "TERM", x.uuid])).code).toBe(0);
  });

  it("when the pool is killed: idle spares go, a running bundle survives, --detach starts its own supervisor and a new pool", async () => {
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length >= 1);
    const socket = await socketOf();
    const long = await h.newStartingBundle({ command: ["sleep", "30"] });
    const supervisor = await handOff(socket, "start", long.uuid, doc(long));
    await h.waitState(long.uuid, ["running"]);

    const [pool] = pidsTitled(h.root, "crunch-run warm-pool");
    expect(pool).toBeDefined();
    process.kill(pool as number, "SIGKILL");
    // Idle spares leave with their pool; the bundle's supervisor (no longer the pool's) stays.
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length === 0);
    const lock = parseLock((await readLockText(lockFile(runnerPaths(h.env), long.uuid))) ?? "");
    expect(lock?.pid).toBe(supervisor);
    expect(lock !== null && holderAlive(lock)).toBe(true);
    expect(await h.listBundles()).toContain(long.uuid);
    expect((await h.waitState(long.uuid, ["running"])).state).toBe("running");

    // The dispatcher's hand-off now fails (nobody listens); --detach, its fallback, starts the bundle itself.
    await expect(handOff(socket, "start", long.uuid, doc(long))).rejects.toThrow();
    const next = await h.newStartingBundle({ command: ["true"] });
    const res = await h.detach(next, { warmSupervisors: 2 });
    expect(res.code, res.stderr).toBe(0);
    const { pid } = JSON.parse(res.stdout) as { pid: number };
    expect(pid).not.toBe(supervisor);
    expect(detachAnswerSpare(res.stdout)).toBe(socket);
    expect((await h.waitFinal(next.uuid)).state).toBe("ready");
    // ...and a new pool replaces the dead one's socket.
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length === 2);
    expect(pidsTitled(h.root, "crunch-run warm-pool")).toHaveLength(1);
    expect(await handOff(socket, "start", (await h.newStartingBundle({ command: ["true"] })).uuid, "{")).toBe(
      -1,
    );

    expect((await h.crunchRun(["--kill", "TERM", long.uuid])).code).toBe(0);
  });

  it("a stop signal that comes while a handed spare waits for its start answer reaches the supervisor", async () => {
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length >= 1);
    const socket = await socketOf();
    // The server's answer to `start` (the pool's call) comes 1 s late; the spare, which has taken the bundle,
    // waits for it.
    const slow = await apiProxy(h.apiUrl, "/api/v1/runner/start", { delayMs: 1000 });
    try {
      const x = await h.newStartingBundle({ command: ["sleep", "30"] });
      const pid = await handOff(socket, "start", x.uuid, doc(x, { apiUrl: slow.url }));
      expect(pid).toBeGreaterThan(0);
      // The `start` call has left: the spare now waits for the answer, with its stop handlers in place.
      await slow.held;
      process.kill(pid, "SIGTERM");
      // Not lost (the bundle would run for 30 s) and not the default death (which leaves the lock behind): the
      // supervisor stops the bundle and releases its lock.
      await waitFor(async () => !isAlive(pid));
      expect(await readLockText(lockFile(runnerPaths(h.env), x.uuid))).toBeNull();
      const log = readFileSync(join(h.root, "var", "log", "crunch-run", `${x.uuid}.log`), "utf8");
      expect(log).toContain("stop requested");
    } finally {
      await slow.close();
    }
  });

  it("the pool makes the `start` calls of the bundles it was handed together in one; when it cannot, the spare does", async () => {
    await poolOf(2);
    const socket = await socketOf();
    const started = await apiProxy(h.apiUrl, "/api/v1/runner/start", {});
    try {
      const burst = await Promise.all([0, 1].map(() => h.newStartingBundle({ command: ["true"] })));
      const answers = parseManyAnswers(
        await exchange(
          socket,
          formatHandOffs(
            burst.map((x) => ({ mode: "start", uuid: x.uuid, doc: doc(x, { apiUrl: started.url }) })),
          ),
        ),
      );
      for (const x of burst) expect(parsePidAnswer(answers.get(x.uuid) ?? "")).toBeGreaterThan(0);
      for (const x of burst) expect((await h.waitFinal(x.uuid)).state).toBe("ready");
      // One call for both, by the pool.
      expect(started.callers).toEqual(["/api/v1/runner/starts crunch-run (warm pool)"]);
    } finally {
      await started.close();
    }

    // The pool's call fails in transit (the connection is dropped): the spare makes its own, and the bundle runs.
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length >= 1);
    const dropping = await apiProxy(h.apiUrl, "/api/v1/runner/start", {
      drop: (userAgent) => userAgent.includes("warm pool"),
    });
    try {
      const x = await h.newStartingBundle({ command: ["true"] });
      const pid = await handOff(socket, "start", x.uuid, doc(x, { apiUrl: dropping.url }));
      expect(pid).toBeGreaterThan(0);
      expect((await h.waitFinal(x.uuid)).state).toBe("ready");
      expect(dropping.callers).toEqual([
        "/api/v1/runner/starts crunch-run (warm pool)",
        "/api/v1/runner/start crunch-run (supervisor)",
      ]);
    } finally {
      await dropping.close();
    }

    // The server refuses the pool's call for a token (not this bundle's): the spare takes that as its own start
    // refused, does not call again, and releases the lock; the bundle is left starting.
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length >= 1);
    const refused = await apiProxy(h.apiUrl, "/api/v1/runner/start", {});
    try {
      const y = await h.newStartingBundle({ command: ["true"] });
      await handOff(socket, "start", y.uuid, doc(y, { apiUrl: refused.url, token: newRunnerToken() }));
      const logOf = join(h.root, "var", "log", "crunch-run", `${y.uuid}.log`);
      await waitFor(async () => {
        const log = await readFile(logOf, "utf8").catch(() => "");
        return log.includes("runner start refused");
      });
      await waitFor(async () => (await readLockText(lockFile(runnerPaths(h.env), y.uuid))) === null);
      expect(refused.callers).toEqual(["/api/v1/runner/starts crunch-run (warm pool)"]);
      expect((await getBundle(getDb(), y.uuid))?.state).toBe("starting");
    } finally {
      await refused.close();
    }
  });

  it("the pool asks again for a token the server does not know yet when the document says its claim is in flight", async () => {
    await poolOf(1);
    const socket = await socketOf();
    const proxy = await apiProxy(h.apiUrl, "/api/v1/runner/start", {});
    try {
      // Handed over before the claim (the dispatcher's early hand-off): the token is in no row yet.
      const uuid = await h.newStagedBundle({ command: ["true"] });
      const token = newRunnerToken();
      const answered = handOff(
        socket,
        "start",
        uuid,
        doc({ uuid, token, attempt: 1 }, { apiUrl: proxy.url, claimInFlight: true }),
      );
      await waitFor(async () => proxy.answered() >= 1, 5000, 1);
      // The claim commits after the pool's first call was answered (the token unknown): a later call finds it.
      const claim = {
        instanceId: "i-test",
        instanceType: "small",
        runnerTokenHash: hashToken(token),
        gpuDevices: [],
      };
      expect((await startBundle(getDb(), uuid, { ...claim, actor: "test" })).ok).toBe(true);
      expect(await answered).toBeGreaterThan(0);
      expect((await h.waitFinal(uuid)).state).toBe("ready");
      // Every call was the pool's (at least two); the spare made none of its own.
      expect(proxy.callers.length).toBeGreaterThanOrEqual(2);
      expect(new Set(proxy.callers)).toEqual(new Set(["/api/v1/runner/starts crunch-run (warm pool)"]));
    } finally {
      await proxy.close();
    }
  });

  it("the pool's `start` call leaves as it hands the bundle over: the bundle is running while its spare has not woken", async () => {
    await poolOf(1);
    const socket = await socketOf();
    const proxy = await apiProxy(h.apiUrl, "/api/v1/runner/start", {});
    // Every spare stopped: none can take a bundle, answer, or call anything until it is continued. The pool gives
    // a spare that has not answered ANSWER_MAX_MS (3 s) up, so each wait below ends well before that.
    const stopped = pidsTitled(h.root, "crunch-run spare");
    expect(stopped.length).toBeGreaterThan(0);
    for (const pid of stopped) process.kill(pid, "SIGSTOP");
    let answered: Promise<number> | null = null;
    try {
      const x = await h.newStartingBundle({ command: ["true"] });
      answered = handOff(socket, "start", x.uuid, doc(x, { apiUrl: proxy.url }));
      await waitFor(async () => (await getBundle(getDb(), x.uuid))?.state === "running", 2500, 20);
      expect(proxy.callers).toEqual(["/api/v1/runner/starts crunch-run (warm pool)"]);
      for (const pid of stopped) process.kill(pid, "SIGCONT");
      const pid = await answered;
      expect(stopped).toContain(pid);
      expect((await h.waitFinal(x.uuid)).state).toBe("ready");
      // The spare used the pool's answer: no call of its own.
      expect(proxy.callers).toEqual(["/api/v1/runner/starts crunch-run (warm pool)"]);
    } finally {
      for (const pid of stopped) kill(pid, "SIGCONT");
      // Bounded, so a failure above is what the test reports.
      await Promise.race([answered?.catch(() => {}), new Promise((r) => setTimeout(r, 5000))]);
      await proxy.close();
    }
  });

  it("a spare gets its bundle once the pool's `start` call is answered, or a second after the call left; a held spare that dies refuses it", async () => {
    await poolOf(2);
    const socket = await socketOf();
    const lockOf = (uuid: string) => readLockText(lockFile(runnerPaths(h.env), uuid));
    /** Hands a new bundle over while the server answers `start` calls `delayMs` late; `check` runs once one is. */
    const slowStart = async (
      delayMs: number,
      check: (x: { uuid: string }, answered: Promise<string>, proxy: { callers: string[] }) => Promise<void>,
    ) => {
      const proxy = await apiProxy(h.apiUrl, "/api/v1/runner/start", { delayMs });
      try {
        const x = await h.newStartingBundle({ command: ["true"] });
        const answered = exchange(
          socket,
          formatHandOff({ mode: "start", uuid: x.uuid, doc: doc(x, { apiUrl: proxy.url }) }),
        );
        await proxy.held;
        await check(x, answered, proxy);
      } finally {
        await proxy.close();
      }
    };

    // The server answers 400 ms late: until then no spare has taken the bundle (its lock is the spare's first act).
    const spares = pidsTitled(h.root, "crunch-run spare");
    await slowStart(400, async (x, answered, proxy) => {
      await new Promise((r) => setTimeout(r, 250));
      expect(await lockOf(x.uuid)).toBeNull();
      expect((await getBundle(getDb(), x.uuid))?.state).toBe("starting");
      const pid = parsePidAnswer(await answered);
      expect((await getBundle(getDb(), x.uuid))?.state).toBe("running");
      expect(spares).toContain(pid);
      expect((await h.waitFinal(x.uuid)).state).toBe("ready");
      expect(proxy.callers).toEqual(["/api/v1/runner/starts crunch-run (warm pool)"]);
    });

    // Answered 1.8 s late: the spare takes the bundle a second after the call left, before the answer, and then
    // uses the pool's answer when it comes (its own call would come POOL_START_WAIT_MS, 2 s, after it took it).
    await slowStart(1800, async (y, answered, proxy) => {
      await waitFor(async () => (await lockOf(y.uuid)) !== null, 1500, 20);
      expect((await getBundle(getDb(), y.uuid))?.state).toBe("starting");
      await answered;
      expect((await h.waitFinal(y.uuid)).state).toBe("ready");
      expect(proxy.callers).toEqual(["/api/v1/runner/starts crunch-run (warm pool)"]);
    });

    // The spares die while the pool holds their work back: the hand-off is refused (the dispatcher then runs
    // --detach, whose `start` under the same token finds the bundle running), never answered with a dead pid.
    await slowStart(500, async (z, answered) => {
      for (const pid of pidsTitled(h.root, "crunch-run spare")) kill(pid);
      const answer = await answered;
      expect(parsePidAnswer(answer)).toBeNull();
      expect(answer).toMatch(/spare/);
      expect((await getBundle(getDb(), z.uuid))?.state).toBe("running");
      expect(await lockOf(z.uuid)).toBeNull();
    });
  });

  it("a supervisor whose bundle ended goes back to the pool and supervises the next bundle; one stopped by a signal exits", async () => {
    await poolOf(1);
    // The pool's one spare, once no supervisor of an earlier bundle is still on its way back (they are let go).
    let first: number | undefined;
    await waitFor(async () => {
      const before = pidsTitled(h.root, "crunch-run spare");
      await new Promise((r) => setTimeout(r, 1500));
      const after = pidsTitled(h.root, "crunch-run spare");
      first = after[0];
      return before.length === 1 && after.length === 1 && before[0] === first;
    });
    const socket = await socketOf();
    const a = await h.newStartingBundle({ command: ["sh", "-c", 'echo a > "$DISPATCH_OUTPUT_DIR/x"'] });
    expect(await handOff(socket, "start", a.uuid, doc(a, { warmSupervisors: 1 }))).toBe(first);
    expect((await h.waitFinal(a.uuid)).state).toBe("ready");
    // RETURN_QUIET_MS after its bundle (the refill counts it as on its way back meanwhile): the same
    // process is the pool's one spare again, and no other was started.
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").includes(first as number));
    expect(await readLockText(lockFile(runnerPaths(h.env), a.uuid))).toBeNull();
    await new Promise((r) => setTimeout(r, 3500));
    expect(pidsTitled(h.root, "crunch-run spare")).toEqual([first]);

    // It supervises the next bundle as a fresh spare would: its lock, its own output, its own log.
    const b = await h.newStartingBundle({ command: ["sh", "-c", 'echo b > "$DISPATCH_OUTPUT_DIR/x"'] });
    expect(await handOff(socket, "start", b.uuid, doc(b, { warmSupervisors: 1 }))).toBe(first);
    expect((await h.waitFinal(b.uuid)).state).toBe("ready");
    expect(await h.output(b.uuid, "x")).toEqual({ status: 200, body: "b\n" });
    const logB = readFileSync(join(h.root, "var", "log", "crunch-run", `${b.uuid}.log`), "utf8");
    expect(logB).not.toContain(a.uuid);
    expect(logB).not.toContain(b.token);

    // A bundle that outlasts the refill: the pool starts a new spare meanwhile, and whichever of the two is ready
    // second is let go: the supervisor coming back to a pool that has what it wants, or, when the new spare's
    // start-up outlasts the bundle (a loaded machine), that spare. The pool keeps one either way.
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").includes(first as number));
    const c = await h.newStartingBundle({ command: ["sleep", "4"] });
    expect(await handOff(socket, "start", c.uuid, doc(c, { warmSupervisors: 1 }))).toBe(first);
    // --kill of a bundle that has ended signals nobody: its supervisor is another bundle's now.
    expect((await h.crunchRun(["--kill", "TERM", b.uuid])).code).toBe(0);
    expect((await h.waitFinal(c.uuid)).state).toBe("ready");
    const [second] = await steadySpares(1);
    expect(second).toBeDefined();
    if (second !== first) await waitFor(async () => !isAlive(first as number));

    // Stopped by --kill, the supervisor stops its bundle and exits instead of coming back.
    const d = await h.newStartingBundle({ command: ["sleep", "30"] });
    expect(await handOff(socket, "start", d.uuid, doc(d, { warmSupervisors: 1 }))).toBe(second);
    await h.waitState(d.uuid, ["running"]);
    expect((await h.crunchRun(["--kill", "TERM", d.uuid])).code).toBe(0);
    await waitFor(async () => !isAlive(second as number));
    expect(await readLockText(lockFile(runnerPaths(h.env), d.uuid))).toBeNull();
  });

  it("the refill counts a supervisor on its way back as a spare: back-to-back bundles start no new process", async () => {
    await poolOf(2);
    const two = await steadySpares(2);
    const socket = await socketOf();
    // The first hand-off sets the refill 3 s later; the second bundle is still running then (its supervisor
    // away), and comes back 1 s after: without counting it, the pool would start a third process at 3 s.
    const a = await h.newStartingBundle({ command: ["true"] });
    const pidA = await handOff(socket, "start", a.uuid, doc(a, { warmSupervisors: 2 }));
    await new Promise((r) => setTimeout(r, 2500));
    const b = await h.newStartingBundle({ command: ["sleep", "1.5"] });
    const pidB = await handOff(socket, "start", b.uuid, doc(b, { warmSupervisors: 2 }));
    expect(new Set([pidA, pidB])).toEqual(new Set(two));
    expect((await h.waitFinal(b.uuid)).state).toBe("ready");
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length === 2);
    await new Promise((r) => setTimeout(r, 1500));
    expect(new Set(pidsTitled(h.root, "crunch-run spare"))).toEqual(new Set(two));
  });

  it("counts a supervisor whose bundle's command has exited as on its way back, however long its outputs take", async () => {
    await poolOf(2);
    const two = await steadySpares(2);
    const socket = await socketOf();
    // The command exits at once, but the child it leaves holds the log's pipe for 4 s, which the supervisor
    // drains before its final report: it is back about 4.5 s after the hand-off, past the refill (3 s after it).
    // It said `ended <pid>` when the command exited, so the refill starts no process in its place.
    const a = await h.newStartingBundle({ command: ["sh", "-c", "sleep 4 & exit 0"] });
    const seen = new Set<number>();
    const watch = setInterval(() => {
      for (const pid of sparePids(h.root)) seen.add(pid);
    }, 50);
    let pidA: number | null = null;
    try {
      pidA = await handOff(socket, "start", a.uuid, doc(a, { warmSupervisors: 2 }));
      const final = await h.waitFinal(a.uuid);
      expect(final.state).toBe("ready");
      // It did outlast the refill (the test would prove nothing otherwise).
      expect((final.finishedAt?.getTime() ?? 0) - (final.runningAt?.getTime() ?? 0)).toBeGreaterThan(3500);
      // Back as a spare, or let go (it exits) because the pool started another in its place meanwhile.
      await waitFor(
        async () =>
          !isAlive(pidA as number) || pidsTitled(h.root, "crunch-run spare").includes(pidA as number),
        15_000,
      );
      await new Promise((r) => setTimeout(r, 1500));
    } finally {
      clearInterval(watch);
    }
    expect(two).toContain(pidA);
    expect(new Set(pidsTitled(h.root, "crunch-run spare"))).toEqual(new Set(two));
    expect([...seen].filter((pid) => !two.includes(pid))).toEqual([]);
  });

  it("forgets a supervisor that said its bundle ended and then exits instead of coming back", async () => {
    await poolOf(1);
    await waitFor(
      async () => sparePids(h.root).length === 1 && pidsTitled(h.root, "crunch-run spare").length === 1,
    );
    const socket = await socketOf();
    const x = await h.newStartingBundle({ command: ["sleep", "30"] });
    const pidX = await handOff(socket, "start", x.uuid, doc(x, { warmSupervisors: 1 }));
    await h.waitState(x.uuid, ["running"]);
    // Its word, as its supervisor would send it once the command had exited: the refill (3 s after the hand-off)
    // counts it as on its way back and starts nothing.
    await new Promise<void>((resolve, reject) => {
      const sock = net.connect(socket);
      sock.on("error", reject).on("close", () => resolve());
      sock.on("connect", () => sock.end(`ended ${pidX}\n`));
    });
    await new Promise((r) => setTimeout(r, 4000));
    expect(sparePids(h.root)).toEqual([]);
    // It goes instead (killed here): the pool sees it gone within a second and starts a spare in its place.
    kill(pidX);
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length === 1, 15_000);
    expect(sparePids(h.root)).not.toContain(pidX);
  });

  it("answers a probe's listing as --list does, so a probe starts no process; a probe whose pool does not answer runs --list", async () => {
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length >= 1);
    const socket = await socketOf();
    const x = await h.newStartingBundle({ command: ["sleep", "30"] });
    expect(await handOff(socket, "start", x.uuid, doc(x))).toBeGreaterThan(0);
    await h.waitState(x.uuid, ["running"]);
    // The instance's side as the dispatcher's executor reaches it, without SSH: commands run crunch-run itself
    // (`--list` is the only one a probe of a booted instance sends), socket exchanges go to the real socket.
    const commands: string[] = [];
    const exec: Executor = {
      async execute(command) {
        commands.push(command);
        const r = await h.crunchRun(["--list"]);
        return {
          exitCode: r.code,
          signal: null,
          stdout: Buffer.from(r.stdout),
          stderr: Buffer.from(r.stderr),
        };
      },
      exchange: async (path, payload) => Buffer.from(await exchange(path, (await payload) ?? "")),
      close: async () => {},
    };
    const target = {
      exec,
      cmds: runnerCommands("/tmp/dispatch-cloud", "0".repeat(64)),
      runner: { content: Buffer.alloc(0), sha256: "0".repeat(64) },
      bootProbeCommand: "",
      spareSocket: socket,
      now: () => Date.now(),
    };
    const byPool = await probeList(target);
    expect(commands).toEqual([]);
    expect(byPool.ok && byPool.listed.runners.get(x.uuid)).toBe("running");
    expect(byPool.ok && byPool.listed.spare).toBe(socket);
    // Line for line what --list prints.
    const lines = (t: string) =>
      t
        .split("\n")
        .filter((l) => l !== "")
        .sort();
    expect(lines(await exchange(socket, LIST_REQUEST))).toEqual(
      lines((await h.crunchRun(["--list"])).stdout),
    );

    // No pool on that socket (it went, or was never there): the probe runs --list, and learns the same.
    const fallback = await probeList({
      ...target,
      spareSocket: join(h.root, "var", "run", "cr-spare-none.sock"),
    });
    expect(commands).toHaveLength(1);
    expect(fallback.ok && fallback.listed.runners.get(x.uuid)).toBe("running");
    // A pool that does not know the request (an older runner) refuses it: --list again.
    const refusing = net.createServer((sock) => sock.end("refused not a hand-off"));
    const other = join(h.root, "var", "run", "cr-spare-old.sock");
    await new Promise<void>((resolve) => refusing.listen(other, resolve));
    try {
      const old = await probeList({ ...target, spareSocket: other });
      expect(commands).toHaveLength(2);
      expect(old.ok && old.listed.runners.get(x.uuid)).toBe("running");
    } finally {
      refusing.close();
    }
    expect((await h.crunchRun(["--kill", "TERM", x.uuid])).code).toBe(0);
  });

  it("a peer that says it is a supervisor coming back is never trusted with a signal, and one that speaks garbage is dropped", async () => {
    await poolOf(1);
    const socket = await socketOf();
    // Nonsense after the return line: the pool drops the connection and goes on.
    const garbage = net.connect(socket);
    await new Promise<void>((resolve) => garbage.on("connect", resolve));
    const dropped = new Promise<void>((resolve) => garbage.on("close", () => resolve()));
    garbage.on("error", () => {});
    garbage.write("spare 1\nnot json\n");
    await dropped;

    // A hand-off to a "supervisor" that never answers: refused after ANSWER_MAX_MS, and the process it named
    // (here a bystander of the test's own) is left alone.
    const bystander = spawn("sleep", ["60"], { stdio: "ignore" });
    const holds: string[] = [];
    try {
      // Every real spare busy, so that the liar is the one the next hand-off goes to. A supervisor of an earlier
      // bundle may still be on its way back to the pool: wait until it is taken in or let go, then keep busy
      // whatever is free (the refill comes 3 s after a hand-off, long after the liar's turn).
      await waitFor(async () => pidsTitled(h.root, "crunch-run returning").length === 0);
      await new Promise((r) => setTimeout(r, 300));
      do {
        const hold = await h.newStartingBundle({ command: ["sleep", "30"] });
        expect(await handOff(socket, "start", hold.uuid, doc(hold, { warmSupervisors: 1 }))).toBeGreaterThan(
          0,
        );
        holds.push(hold.uuid);
        // The supervisor renames itself once it has the bundle.
        await new Promise((r) => setTimeout(r, 100));
      } while (pidsTitled(h.root, "crunch-run spare").length > 0);
      const liar = net.connect(socket);
      await new Promise<void>((resolve) => liar.on("connect", resolve));
      liar.on("error", () => {});
      const closed = new Promise<void>((resolve) => liar.on("close", () => resolve()));
      let got = "";
      liar.setEncoding("utf8");
      liar.on("data", (d: string) => {
        got += d;
      });
      liar.write(`spare ${bystander.pid}\n${JSON.stringify({ type: "ready" })}\n`);
      const x = await h.newStartingBundle({ command: ["true"] });
      expect(await handOff(socket, "start", x.uuid, doc(x, { warmSupervisors: 1 }))).toBe(-1);
      expect(got).toContain(x.uuid);
      await closed;
      await new Promise((r) => setTimeout(r, 300));
      expect(bystander.signalCode).toBeNull();
      expect(bystander.exitCode).toBeNull();
    } finally {
      bystander.kill("SIGKILL");
      for (const uuid of holds) expect((await h.crunchRun(["--kill", "TERM", uuid])).code).toBe(0);
    }
  });

  it("keeps K spares when a lent supervisor comes back while the spare started in its place still warms up", async () => {
    // A pool of one spare, started afresh.
    for (const pid of pidsTitled(h.root, "crunch-run warm-pool")) kill(pid);
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length === 0, 10_000);
    const [lent] = await poolOf(1);
    const socket = await socketOf();
    // The spare the pool starts in the lent one's place (REFILL_DELAY_MS, 3 s, after the hand-off) is stopped
    // while it warms up, before its title says it is ready.
    const stopped = stopNextSpare();
    try {
      // A bundle that outlasts the pool's wait for its supervisor (REFILL_DELAY_MS), by a little.
      const x = await h.newStartingBundle({ command: ["sleep", "3.5"] });
      expect(await handOff(socket, "start", x.uuid, doc(x, { warmSupervisors: 1 }))).toBe(lent);
      await waitFor(async () => stopped.pid() !== undefined, 10_000);
      const fresh = stopped.pid() as number;
      expect((await h.waitFinal(x.uuid)).state).toBe("ready");
      // The supervisor comes back while the new spare is still stopped: the pool takes it as its one spare.
      await waitFor(async () => pidsTitled(h.root, "crunch-run spare").includes(lent as number), 10_000);
      kill(fresh, "SIGCONT");
      // Once ready, the new spare is one too many and goes.
      await waitFor(async () => !isAlive(fresh), 10_000);
      await new Promise((r) => setTimeout(r, 500));
      expect(pidsTitled(h.root, "crunch-run spare")).toEqual([lent]);
    } finally {
      await stopped.done();
    }
  });

  it("a hand-off that lowers K lets the extra ready spares go at once, and keeps K afterwards", async () => {
    for (const pid of pidsTitled(h.root, "crunch-run warm-pool")) kill(pid);
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length === 0, 10_000);
    const spares = await poolOf(3);
    const socket = await socketOf();
    // The operator lowered dispatcher.warmSupervisors to 1: the next start document says so.
    const x = await h.newStartingBundle({ command: ["true"] });
    const pid = await handOff(socket, "start", x.uuid, doc(x, { warmSupervisors: 1 }));
    expect(spares).toContain(pid);
    const others = spares.filter((p) => p !== pid);
    // One of the two spares left goes at once.
    await waitFor(async () => others.filter((p) => isAlive(p)).length === 1, 5_000).catch(() => {
      throw new Error(`spares ${others.join(", ")} are all still alive 5 s after a hand-off with K = 1`);
    });
    expect((await h.waitFinal(x.uuid)).state).toBe("ready");
    // Past the refill (REFILL_DELAY_MS after the hand-off) and the supervisor's return: still one spare.
    await new Promise((r) => setTimeout(r, 4_000));
    expect(pidsTitled(h.root, "crunch-run spare")).toEqual(others.filter((p) => isAlive(p)));
    expect(pidsTitled(h.root, "crunch-run spare")).toHaveLength(1);
  });

  it("a supervisor come back that never says it is ready is let go, and a new spare takes its place", async () => {
    for (const pid of pidsTitled(h.root, "crunch-run warm-pool")) kill(pid);
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length === 0, 10_000);
    const [lent] = await poolOf(1);
    const socket = await socketOf();
    // Its one spare takes a long bundle; a peer then comes back in its name and says nothing more, as a
    // supervisor stuck on its way back would. Counted as warming up, it would hold back the refill for ever.
    const x = await h.newStartingBundle({ command: ["sleep", "30"] });
    try {
      expect(await handOff(socket, "start", x.uuid, doc(x, { warmSupervisors: 1 }))).toBe(lent);
      const stuck = net.connect(socket);
      await new Promise<void>((resolve) => stuck.on("connect", resolve));
      stuck.on("error", () => {});
      const dropped = new Promise<number>((resolve) => stuck.on("close", () => resolve(Date.now())));
      const t0 = Date.now();
      stuck.write(`spare ${lent}\n`);
      // Let go after RETURN_READY_MAX_MS (5 s); then a spare of the pool's own is started and ready.
      const droppedAt = await Promise.race([
        dropped,
        new Promise<number>((_, reject) =>
          setTimeout(() => reject(new Error("the pool still holds the stuck peer after 15 s")), 15_000),
        ),
      ]);
      expect(droppedAt - t0).toBeGreaterThanOrEqual(4_500);
      let spares: number[] = [];
      await waitFor(async () => {
        spares = pidsTitled(h.root, "crunch-run spare");
        return spares.length === 1;
      });
      expect(spares).not.toContain(lent);
    } finally {
      expect((await h.crunchRun(["--kill", "TERM", x.uuid])).code).toBe(0);
    }
  });

  it("kills a spare it started that is not ready within 30 s, and starts another", async () => {
    for (const pid of pidsTitled(h.root, "crunch-run warm-pool")) kill(pid);
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length === 0, 10_000);
    // The first spare the new pool starts is stopped before it is ready: counted as warming up, it would hold
    // back the refill (one spare at a time on a 2-core instance) for ever.
    const stopped = stopNextSpare();
    try {
      const first = await h.newStartingBundle({ command: ["true"] });
      const res = await h.detach(first, { warmSupervisors: 1 });
      expect(res.code, res.stderr).toBe(0);
      await waitFor(async () => stopped.pid() !== undefined, 10_000);
      const stuck = stopped.pid() as number;
      const t0 = Date.now();
      await waitFor(async () => !isAlive(stuck), 45_000);
      expect(Date.now() - t0).toBeGreaterThan(25_000);
      let spares: number[] = [];
      await waitFor(async () => {
        spares = pidsTitled(h.root, "crunch-run spare");
        return spares.length === 1;
      });
      expect(spares).not.toContain(stuck);
    } finally {
      await stopped.done();
    }
  }, 150_000);

  it("a connection held idle, as the dispatcher opens one ahead, carries a hand-off written later; one written as the pool closes is refused", async () => {
    for (const pid of pidsTitled(h.root, "crunch-run warm-pool")) kill(pid);
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length === 0, 10_000);
    const spares = await poolOf(2);
    const socket = await socketOf();
    const connectTo = async () => {
      const sock = net.connect(socket);
      sock.setEncoding("utf8");
      sock.on("error", () => {});
      await new Promise<void>((resolve) => sock.on("connect", resolve));
      let answer = "";
      sock.on("data", (d: string) => {
        answer += d;
      });
      const answered = new Promise<string>((resolve) => sock.on("close", () => resolve(answer)));
      return { sock, answered };
    };
    // Held open and idle while a hand-off and a probe's listing go on connections of their own.
    const held = await connectTo();
    const a = await h.newStartingBundle({ command: ["true"] });
    const pidA = await handOff(socket, "start", a.uuid, doc(a, { warmSupervisors: 2 }));
    expect(spares).toContain(pidA);
    expect(await exchange(socket, LIST_REQUEST)).toContain(`spare ${socket}`);
    await new Promise((r) => setTimeout(r, 500));
    const b = await h.newStartingBundle({ command: ["true"] });
    held.sock.end(formatHandOff({ mode: "start", uuid: b.uuid, doc: doc(b, { warmSupervisors: 2 }) }));
    const pidB = parsePidAnswer(await held.answered);
    expect(spares).toContain(pidB);
    expect(pidB).not.toBe(pidA);
    for (const x of [a, b]) expect((await h.waitFinal(x.uuid)).state).toBe("ready");

    // The pool closes once its socket is gone (its idle spares go at once); until it exits, a hand-off on a
    // connection it had accepted is refused rather than left unanswered.
    const late = await connectTo();
    const pool = pidsTitled(h.root, "crunch-run warm-pool");
    rmSync(socket);
    await waitFor(async () => pidsTitled(h.root, "crunch-run spare").length === 0, 10_000);
    const c = await h.newStartingBundle({ command: ["true"] });
    late.sock.end(formatHandOff({ mode: "start", uuid: c.uuid, doc: doc(c, { warmSupervisors: 2 }) }));
    expect(await late.answered).toBe("refused the warm pool is closing\n");
    await waitFor(async () => pool.every((pid) => !isAlive(pid)), 10_000);
  });

  it("--detach with warmSupervisors 0 starts no pool and names none in its answer", async () => {
    expect(await stopProcessesOf(h.root)).toEqual([]);
    const b = await h.newStartingBundle({ command: ["true"] });
    const res = await h.detach(b, { warmSupervisors: 0 });
    expect(res.code, res.stderr).toBe(0);
    expect(Object.keys(JSON.parse(res.stdout) as object).sort()).toEqual(["pid", "uuid"]);
    expect(detachAnswerSpare(res.stdout)).toBeNull();
    expect((await h.waitFinal(b.uuid)).state).toBe("ready");
    expect(pidsTitled(h.root, "crunch-run warm-pool")).toEqual([]);
  });

  it("names its socket after the runner's own command, so a new deployment never reaches an old pool", () => {
    const paths = runnerPaths({ DISPATCH_VM_ROOT: "/r" });
    const old = spareSocketPath(paths, ["/tmp/dispatch-cloud/crunch-run~aaaa"]);
    const fresh = spareSocketPath(paths, ["/tmp/dispatch-cloud/crunch-run~bbbb"]);
    expect(old).toMatch(/^\/r\/var\/run\/cr-spare-[0-9a-f]{10}\.sock$/);
    expect(fresh).not.toBe(old);
  });
});

/**
 * One hand-off on the pool's socket; resolves to the pid it answers, -1 for a refusal; rejects when nobody
 * listens.
 */
async function handOff(socket: string, mode: "start" | "detach", uuid: string, doc: string): Promise<number> {
  const answer = await exchange(socket, formatHandOff({ mode, uuid, doc }));
  return parsePidAnswer(answer) ?? -1;
}

function exchange(socket: string, payload: string): Promise<string> {
  return new Promise((resolve, reject) => {
    let answer = "";
    const sock = net.connect(socket);
    sock.setEncoding("utf8");
    sock.on("error", reject);
    sock.on("connect", () => sock.end(payload));
    sock.on("data", (d: string) => {
      answer += d;
    });
    sock.on("end", () => resolve(answer));
  });
}

/** Spares of the pool under `root`, ready or still starting (`... --spare`). */
function sparePids(root: string): number[] {
  return findPids({ env: ["DISPATCH_VM_ROOT", root] }).filter((pid) => {
    const args = readCmdline(pid) ?? [];
    return args.join(" ") === "crunch-run spare" || args.at(-1) === "--spare";
  });
}

/** The processes of the runner under `root`, each as `pid title (state)`: what a failed wait says it found. */
function runnerProcesses(root: string): string {
  const procs = findPids({ env: ["DISPATCH_VM_ROOT", root] }).map(
    (pid) => `${pid} ${(readCmdline(pid) ?? []).join(" ")} (${processState(pid) ?? "gone"})`,
  );
  return `the runner's processes: ${procs.join(", ") || "none"}`;
}

/** Processes of the instance whose root is `root` whose title is `title`. */
function pidsTitled(root: string, title: string): number[] {
  return findPids({ env: ["DISPATCH_VM_ROOT", root] }).filter(
    (pid) => (readCmdline(pid) ?? []).join(" ") === title,
  );
}

/**
 * A proxy to `target` that holds requests for `path` for `delayMs` before it passes them on (`held` resolves
 * when the first such request comes), or drops those that `drop` picks (the connection is destroyed); `callers`
 * lists the path and User-Agent of each request for `path`.
 */
async function apiProxy(
  target: string,
  path: string,
  opts: { delayMs?: number; drop?: (userAgent: string) => boolean },
): Promise<{
  url: string;
  held: Promise<void>;
  callers: string[];
  /** How many of the calls to `path` the server has answered (the answers are on their way back). */
  answered: () => number;
  close(): Promise<void>;
}> {
  let holding = () => {};
  const held = new Promise<void>((resolve) => {
    holding = resolve;
  });
  const callers: string[] = [];
  let answered = 0;
  const server = http.createServer((req, res) => {
    const mine = (req.url ?? "").startsWith(path);
    if (mine) {
      const userAgent = req.headers["user-agent"] ?? "";
      callers.push(`${req.url} ${userAgent}`);
      if (opts.drop?.(userAgent)) {
        req.socket.destroy();
        return;
      }
      holding();
    }
    const body: Buffer[] = [];
    req.on("data", (c: Buffer) => body.push(c));
    req.on("end", () => {
      setTimeout(
        () => {
          const out = http.request(
            new URL(req.url ?? "/", target),
            { method: req.method, headers: req.headers },
            (answer) => {
              if (mine) answered++;
              res.writeHead(answer.statusCode ?? 502, answer.headers);
              answer.pipe(res);
            },
          );
          out.on("error", () => res.destroy());
          out.end(Buffer.concat(body));
        },
        mine ? (opts.delayMs ?? 0) : 0,
      );
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address() as net.AddressInfo;
  return {
    url: `http://127.0.0.1:${port}`,
    held,
    callers,
    answered: () => answered,
    close: () => {
      server.closeAllConnections();
      return new Promise((resolve) => server.close(() => resolve()));
    },
  };
}

function kill(pid: number, signal: NodeJS.Signals = "SIGKILL"): void {
  try {
    process.kill(pid, signal);
  } catch {
    // gone
  }
}

async function waitFor(cond: () => Promise<boolean>, timeoutMs = 60_000, everyMs = 100): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error("condition not met in time");
    await new Promise((r) => setTimeout(r, everyMs));
  }
}
