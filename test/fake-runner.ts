/**
 * Fake crunch-runs for the stub cloud that speak the REAL runner API. When `--detach` starts a stub runner,
 * the fake one calls `POST /api/v1/runner/start` with the token from the start document (on a REST server
 * built by createRestServer, through fastify's inject: no port), reads `/api/v1/runner/spec`, "runs" for a
 * while on the injected Clock (`sleep N` in the bundle's command = N seconds), calls `/finish` and ends the
 * stub runner, so `--list` stops showing it. A stub runner that is killed or whose VM is destroyed stops at
 * once without calling `/finish`, as would a crunch-run whose process is gone.
 */
import type { FastifyInstance } from "fastify";
import type { StubCloud } from "../cloud-drivers/stub/driver.ts";
import { mulberry32 } from "../cloud-drivers/stub/driver.ts";
import type { StubRunner, StubVm } from "../cloud-drivers/stub/vm.ts";
import type { Clock } from "../lib/clock.ts";

/** What `/api/v1/runner/spec` answers (the fields the fake runner reads). */
export interface RunnerSpec {
  uuid: string;
  attempt: number;
  command: string[];
  instanceType: string | null;
  gpuDevices: number[];
}

export type FakeRunnerEvent =
  | "started" // /start accepted
  | "rejected" // /start refused (the attempt no longer owns the bundle)
  | "finished" // /finish accepted
  | "finish_rejected"
  | "stopped" // the stub runner was killed or its VM destroyed
  | "died"; // the fake process died after /start, without /finish

export interface FakeRunnerLogEntry {
  event: FakeRunnerEvent;
  uuid: string;
  attempt: number;
  vmId: string;
  at: number;
}

export interface FakeRunnerOptions {
  cloud: StubCloud;
  /** A REST server from createRestServer on the dispatcher's database. */
  api: FastifyInstance;
  clock: Clock;
  /** How long the bundle runs, in ms; default `sleep N` in its command = N s, else 1 s. */
  duration?: (spec: RunnerSpec) => number;
  /** Its exit code; default 0, or N for a command ending in `exit N`. */
  exitCode?: (spec: RunnerSpec) => number;
  /** Probability that the runner dies (process gone, lock released) after /start, before /finish (seeded). */
  dieRate?: number;
  seed?: number;
}

export interface FakeRunners {
  /** Every step of every fake runner, in order. */
  readonly log: readonly FakeRunnerLogEntry[];
  /** Unexpected failures (an API answer other than success or runner.not_current). */
  readonly errors: readonly unknown[];
  /** Fake runners between their start and their end. */
  readonly active: number;
  /** Uuids whose runner has its spec and is doing its work (a kill from now on reaches it, not its /spec call). */
  readonly working: ReadonlySet<string>;
  /** Called after every log entry. */
  onEvent(fn: (entry: FakeRunnerLogEntry) => void): () => void;
  /** Stops driving new runners (running ones carry on). */
  detach(): void;
}

/** `sleep N` (seconds) anywhere in the command, as in ["sleep", "30"] or ["sh", "-c", "sleep 30; exit 1"]. */
export function defaultDuration(spec: Pick<RunnerSpec, "command">): number {
  const m = /(?:^|\s|;)sleep\s+(\d+(?:\.\d+)?)/.exec(spec.command.join(" "));
  return m?.[1] === undefined ? 1000 : Math.round(Number(m[1]) * 1000);
}

export function defaultExitCode(spec: Pick<RunnerSpec, "command">): number {
  const m = /(?:^|\s|;)exit\s+(\d+)\s*$/.exec(spec.command.join(" "));
  return m?.[1] === undefined ? 0 : Number(m[1]);
}

export function attachFakeRunners(opts: FakeRunnerOptions): FakeRunners {
  const { cloud, api, clock } = opts;
  const duration = opts.duration ?? defaultDuration;
  const exitCode = opts.exitCode ?? defaultExitCode;
  const dieRate = opts.dieRate ?? 0;
  const rng = mulberry32(opts.seed ?? 7);
  const log: FakeRunnerLogEntry[] = [];
  const errors: unknown[] = [];
  const listeners = new Set<(e: FakeRunnerLogEntry) => void>();
  const stops = new Map<StubRunner, AbortController>();
  let active = 0;
  const working = new Set<string>();

  const record = (event: FakeRunnerEvent, uuid: string, attempt: number, vm: StubVm) => {
    const entry = { event, uuid, attempt, vmId: vm.id, at: clock.now() };
    log.push(entry);
    for (const fn of listeners) fn(entry);
  };

  const call = async (path: string, token: string, body: unknown) => {
    const res = await api.inject({
      method: path === "spec" ? "GET" : "POST",
      url: `/api/v1/runner/${path}`,
      headers: {
        authorization: `Bearer ${token}`,
        ...(body === undefined ? {} : { "content-type": "application/json" }),
      },
      ...(body === undefined ? {} : { payload: JSON.stringify(body) }),
    });
    const json = res.json() as { error?: { code: string; message: string } };
    if (res.statusCode === 200) return { ok: true as const, json };
    const code = json.error?.code ?? `http.${res.statusCode}`;
    // A token that no longer works is what a superseded attempt sees: not an error of the test harness.
    if (code !== "runner.not_current" && code !== "auth.invalid_token") {
      errors.push(new Error(`${path}: ${res.statusCode} ${res.body}`));
    }
    return { ok: false as const, json };
  };

  const run = async (vm: StubVm, runner: StubRunner, doc: unknown): Promise<void> => {
    const stop = new AbortController();
    stops.set(runner, stop);
    active++;
    const d = doc as { token?: unknown; attempt?: unknown };
    const attempt = typeof d.attempt === "number" ? d.attempt : 0;
    const end = (code: number | null) => {
      if (vm.runners.get(runner.uuid) === runner && runner.state !== "exited") {
        vm.endRunner(runner.uuid, code, null);
      }
    };
    try {
      if (typeof d.token !== "string") throw new Error(`start document of ${runner.uuid} has no token`);
      const token = d.token;
      const started = await call("start", token, {});
      if (stop.signal.aborted) return record("stopped", runner.uuid, attempt, vm);
      if (!started.ok) {
        record("rejected", runner.uuid, attempt, vm);
        return end(1);
      }
      record("started", runner.uuid, attempt, vm);
      const spec = await call("spec", token, undefined);
      if (!spec.ok) return end(1);
      const s = spec.json as unknown as RunnerSpec;
      if (dieRate > 0 && rng() < dieRate) {
        await clock.sleep(Math.floor(duration(s) / 2), stop.signal);
        record("died", runner.uuid, attempt, vm);
        return end(null);
      }
      working.add(runner.uuid);
      await clock.sleep(duration(s), stop.signal);
      const code = exitCode(s);
      const finished = await call("finish", token, { exitCode: code });
      record(finished.ok ? "finished" : "finish_rejected", runner.uuid, attempt, vm);
      end(code);
    } catch (err) {
      if (stop.signal.aborted) record("stopped", runner.uuid, attempt, vm);
      else {
        errors.push(err);
        end(1);
      }
    } finally {
      working.delete(runner.uuid);
      active--;
      stops.delete(runner);
    }
  };

  const onStart = (vm: StubVm, uuid: string, doc: unknown) => {
    const runner = vm.runners.get(uuid);
    if (runner === undefined) return;
    void run(vm, runner, doc);
  };
  const onEnd = (_vm: StubVm, runner: StubRunner) => stops.get(runner)?.abort(new Error("runner ended"));
  const onKill = (vm: StubVm, runner: StubRunner, signal: string) => {
    if (signal === "KILL" || !cloud.knobs.runnersIgnoreTerm) onEnd(vm, runner);
  };
  const onError = (err: unknown) => errors.push(err);

  cloud.knobs.onRunnerStart = onStart;
  cloud.on("runner:kill", onKill);
  cloud.on("runner:exit", onEnd);
  cloud.on("hook:error", onError);

  return {
    log,
    errors,
    get active() {
      return active;
    },
    working,
    onEvent(fn) {
      listeners.add(fn);
      return () => listeners.delete(fn);
    },
    detach() {
      if (cloud.knobs.onRunnerStart === onStart) cloud.knobs.onRunnerStart = null;
      cloud.off("runner:kill", onKill);
      cloud.off("runner:exit", onEnd);
      cloud.off("hook:error", onError);
    },
  };
}
