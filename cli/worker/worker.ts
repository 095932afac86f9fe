/**
 * `dispatch-cloud worker`: a user's own machine running that user's bundles (docs/workers.md). It checks in
 * with the REST server in a long-poll loop (lib/worker-protocol.ts), reporting its resources, slots, tags,
 * version, cache and running bundles, and acts on the answer's messages: run (crunch-run --detach), kill
 * (crunch-run --kill TERM, then KILL after a grace), drain (take nothing new), upgrade (replace its program
 * when nothing runs). It opens no listening socket: every call goes out from it.
 *
 * startWorker runs one in this process and returns a handle (tests use it; the CLI command wraps it with
 * signal handling and the relaunch after an upgrade).
 */

import { mkdir } from "node:fs/promises";
import path from "node:path";
import { procStartTime } from "../../crunch-run/lock.ts";
import type { Logger } from "../../lib/logger.ts";
import { abortableSleep } from "../../lib/retry.ts";
import type { RuntimeEngine, StartDocumentSent } from "../../lib/runner-protocol.ts";
import { VERSION } from "../../lib/version.ts";
import {
  type CheckinRequest,
  type CheckinResponse,
  MAX_SLOTS,
  type WorkerMessage,
} from "../../lib/worker-protocol.ts";
import { WorkerApi, WorkerApiError } from "./api.ts";
import { ownProgramFile, sha256File } from "./program-file.ts";
import { detectGpus, detectResources, type GpuReport } from "./resources.ts";
import { LocalRunners } from "./runners.ts";
import { replaceProgram, verifyArtifact } from "./upgrade.ts";

export type StopMode = "finish" | "hand-back";

export interface WorkerOptions {
  apiUrl: string;
  /** The worker token (`dcw_...`); never logged. */
  token: string;
  workerId: string;
  tags: string[];
  /** How many bundles at once; default: the machine's vCPUs. */
  slots?: number;
  /** crunch-run's DISPATCH_VM_ROOT: locks, logs, work directories and the CAS cache live below it. */
  workDir: string;
  /** Overrides the start documents' runtimeEngine (default: the server's dispatcher.runtimeEngine). */
  runtime?: RuntimeEngine;
  /** What the first stop() does (the second always hands back). */
  onStop: StopMode;
  logger: Logger;
  /** The environment crunch-run runs in (plus DISPATCH_VM_ROOT). */
  env?: NodeJS.ProcessEnv;
  /** The program the upgrade replaces; default: this program's own file (null from sources: no upgrades). */
  programFile?: string | null;
  /** The nvidia-smi to ask about GPUs (default: `nvidia-smi` on PATH). */
  nvidiaSmi?: string;
}

export type WorkerExit = { kind: "stopped" } | { kind: "upgraded"; programFile: string };

export interface WorkerHandle {
  /** What the worker reports at each check-in (resources as detected at start, bar free disk). */
  readonly report: Readonly<
    Pick<CheckinRequest, "workerId" | "version" | "artifactSha256" | "slots" | "tags">
  > & {
    gpu: GpuReport | null;
  };
  /** Stops: the first call as `onStop` says (or `mode`), a later one hands back. */
  stop(mode?: StopMode): void;
  /** Resolves when the worker has checked out (stopped) or replaced its program (upgraded). */
  readonly done: Promise<WorkerExit>;
}

/** Back-off between failed check-ins. */
const FIRST_RETRY_MS = 1000;
const MAX_RETRY_MS = 30_000;
/** A check-in is not repeated sooner than this after the last (a server answering at once must not spin us). */
const MIN_CYCLE_MS = 250;
/** Between `--kill TERM` failing to stop a bundle and `--kill KILL`. */
const KILL_GRACE_MS = 10_000;
/** How long an upgrade whose download failed is not tried again. */
const UPGRADE_RETRY_MS = 5 * 60_000;
/**
 * While nothing runs here, `crunch-run --list` (a process start each time) is asked this often rather than at
 * every check-in: with no runner of ours, only a leftover of an earlier worker process could show up in it.
 */
const IDLE_LIST_MS = 30_000;
/** How long stopping tries to check out before it gives up (the server then finds the worker lost). */
const CHECKOUT_BUDGET_MS = 30_000;

export async function startWorker(opts: WorkerOptions): Promise<WorkerHandle> {
  const workDir = path.resolve(opts.workDir);
  // 0711: the process runtime's bundle users (when the worker runs as root) pass through to their work dirs.
  await mkdir(workDir, { recursive: true, mode: 0o711 });
  const programFile = opts.programFile === undefined ? ownProgramFile() : opts.programFile;
  const artifactSha256 = programFile === null ? "" : await sha256File(programFile);
  const gpu = await detectGpus(opts.nvidiaSmi);
  const vcpus = (await detectResources(workDir, gpu)).vcpus;
  const w = new WorkerLoop({ ...opts, workDir }, programFile, {
    workerId: opts.workerId,
    version: VERSION,
    artifactSha256,
    slots: Math.min(MAX_SLOTS, opts.slots ?? vcpus),
    tags: opts.tags,
    gpu,
  });
  const done = w.run();
  return { report: w.report, stop: (mode) => w.stop(mode), done };
}

class WorkerLoop {
  private readonly api: WorkerApi;
  private readonly runners: LocalRunners;
  private readonly log: Logger;
  /** Told to drain: takes no new bundles (reports draining: true) until it upgrades or restarts. */
  private draining = false;
  private stopMode: StopMode | null = null;
  /** Aborted by stop(): cuts a long poll or a back-off short. */
  private wake = new AbortController();
  /** Bundles whose --detach is under way: uuid -> attempt. */
  private readonly starting = new Map<string, { attempt: number; started: Promise<void> }>();
  /** Bundles it runs (listed by --list): uuid -> attempt. */
  private readonly attempts = new Map<string, number>();
  private readonly killing = new Map<string, Promise<void>>();
  private pendingUpgrade: Extract<WorkerMessage, { type: "upgrade" }> | null = null;
  private refusedUpgrade: { sha256: string; until: number } | null = null;
  private cache: string[] = [];
  private failure: { key: string; count: number } | null = null;
  private retryMs = FIRST_RETRY_MS;
  private checkedIn = false;
  private listProblem: string | null = null;
  private listedAt = 0;

  constructor(
    private readonly opts: WorkerOptions,
    private readonly programFile: string | null,
    readonly report: WorkerHandle["report"],
  ) {
    this.api = new WorkerApi(opts.apiUrl, opts.token);
    this.runners = new LocalRunners(opts.workDir, opts.env);
    this.log = opts.logger.child({ component: "worker", workerId: opts.workerId });
  }

  stop(mode?: StopMode): void {
    const next: StopMode = this.stopMode !== null ? "hand-back" : (mode ?? this.opts.onStop);
    if (this.stopMode === next) return;
    this.stopMode = next;
    this.log.info(
      next === "finish"
        ? "stopping: taking no new bundles, finishing the running ones, then checking out (stop again to hand them back)"
        : "stopping: handing the bundles back to the queue, then stopping their runners",
    );
    this.wake.abort();
  }

  async run(): Promise<WorkerExit> {
    this.log.info(
      {
        apiUrl: this.opts.apiUrl,
        workDir: this.opts.workDir,
        slots: this.report.slots,
        tags: this.report.tags,
        version: this.report.version,
        artifactSha256: this.report.artifactSha256 || "(from sources)",
        gpu: this.report.gpu,
      },
      "worker starting",
    );
    for (;;) {
      if (this.wake.signal.aborted) this.wake = new AbortController();
      if (this.stopMode === "hand-back") {
        await this.handBack();
        return { kind: "stopped" };
      }
      const running = await this.running();
      if (this.stopMode === "finish" && running.length === 0 && this.killing.size === 0) {
        await this.checkout(false);
        return { kind: "stopped" };
      }
      const upgrade = this.pendingUpgrade;
      if (upgrade !== null && this.stopMode === null && running.length === 0 && this.killing.size === 0) {
        this.pendingUpgrade = null;
        if (await this.upgrade(upgrade)) return { kind: "upgraded", programFile: this.programFile as string };
      }
      const began = Date.now();
      let answer: CheckinResponse;
      try {
        answer = await this.api.checkin(await this.body(running), this.wake.signal);
      } catch (err) {
        if (this.wake.signal.aborted) continue;
        await this.failed(err);
        continue;
      }
      this.recovered();
      this.log.debug({ running: running.length, messages: answer.messages.map((m) => m.type) }, "checked in");
      await this.act(answer.messages);
      const rest = MIN_CYCLE_MS - (Date.now() - began);
      if (answer.messages.length === 0 && rest > 0) await this.sleep(rest);
    }
  }

  private async body(running: CheckinRequest["running"]): Promise<CheckinRequest> {
    const { vcpus, ram, freeDisk, gpu } = await detectResources(this.opts.workDir, this.report.gpu);
    return {
      workerId: this.report.workerId,
      version: this.report.version,
      artifactSha256: this.report.artifactSha256,
      resources: { vcpus, ram, freeDisk, gpu },
      slots: this.report.slots,
      tags: [...this.report.tags],
      cache: this.cache,
      running,
      draining: this.draining || this.stopMode !== null,
    };
  }

  /** What runs here: crunch-run --list's bundles (with their attempts) and the ones being started. */
  private async running(): Promise<CheckinRequest["running"]> {
    const idle = this.attempts.size === 0 && this.starting.size === 0 && this.killing.size === 0;
    if (idle && this.listedAt > 0 && Date.now() - this.listedAt < IDLE_LIST_MS) return [];
    let listed: string[];
    try {
      this.listedAt = Date.now();
      const list = await this.runners.list();
      this.cache = list.cachedManifests;
      listed = [...list.runners.keys()];
      if (this.listProblem !== null) this.log.info("crunch-run --list works again");
      this.listProblem = null;
    } catch (err) {
      const why = err instanceof Error ? err.message : String(err);
      if (this.listProblem !== why)
        this.log.warn({ err }, "crunch-run --list failed; reporting what ran before");
      this.listProblem = why;
      listed = [...this.attempts.keys()];
    }
    const unknown = listed.filter((u) => !this.attempts.has(u) && !this.starting.has(u));
    if (unknown.length > 0) {
      const fromDirs = await this.runners.workDirAttempts();
      for (const u of unknown) {
        const attempt = fromDirs.get(u) ?? 0;
        this.attempts.set(u, attempt);
        this.log.info({ uuid: u, attempt }, "found a bundle running in the work directory");
      }
    }
    const now = new Set(listed);
    for (const [uuid, attempt] of this.attempts) {
      if (now.has(uuid) || this.starting.has(uuid)) continue;
      this.attempts.delete(uuid);
      this.log.info({ uuid, attempt }, "bundle finished");
    }
    const out = [...this.attempts].map(([uuid, attempt]) => ({ uuid, attempt }));
    for (const [uuid, s] of this.starting) {
      if (!this.attempts.has(uuid)) out.push({ uuid, attempt: s.attempt });
    }
    return out;
  }

  private async act(messages: WorkerMessage[]): Promise<void> {
    const starts: Promise<void>[] = [];
    for (const m of messages) {
      switch (m.type) {
        case "run":
          if (this.stopMode === "hand-back") break;
          starts.push(this.start(m));
          break;
        case "kill":
          this.kill(m);
          break;
        case "drain":
          if (!this.draining) this.log.info({ reason: m.reason }, "draining: taking no new bundles");
          this.draining = true;
          break;
        case "upgrade": {
          const refused = this.refusedUpgrade;
          if (refused !== null && refused.sha256 === m.sha256 && Date.now() < refused.until) break;
          this.draining = true;
          this.pendingUpgrade = m;
          break;
        }
      }
    }
    await Promise.all(starts);
  }

  private start(m: Extract<WorkerMessage, { type: "run" }>): Promise<void> {
    if (this.starting.has(m.uuid) || this.attempts.get(m.uuid) === m.attempt) return Promise.resolve();
    const doc: StartDocumentSent = {
      ...m.startDocument,
      // Its own address of the server (the document names the one the check-in came to), no warm spares (they
      // would run the program as it is now, past an upgrade), the runtime it was told to use.
      apiUrl: this.opts.apiUrl,
      warmSupervisors: 0,
      ...(this.opts.runtime === undefined ? {} : { runtimeEngine: this.opts.runtime }),
      // Its supervisor stops the bundle when this process is gone (killed): it then goes back to the queue.
      workerPid: process.pid,
      workerPidStart: procStartTime(process.pid) ?? "",
    };
    // Operators' registry credentials never reach a user's machine (the server sends none; make sure).
    delete doc.registryAuth;
    const started = (async () => {
      const r = await this.runners.detach(doc);
      this.starting.delete(m.uuid);
      if (r.ok) {
        this.attempts.set(m.uuid, m.attempt);
        this.log.info({ uuid: m.uuid, attempt: m.attempt, pid: r.pid }, "bundle started");
      } else {
        this.log.error({ uuid: m.uuid, attempt: m.attempt, why: r.why }, "bundle could not start");
      }
    })();
    this.starting.set(m.uuid, { attempt: m.attempt, started });
    return started;
  }

  private kill(m: Extract<WorkerMessage, { type: "kill" }>): void {
    if (this.killing.has(m.uuid)) return;
    const p = (async () => {
      await this.starting.get(m.uuid)?.started;
      this.log.info({ uuid: m.uuid, attempt: m.attempt, reason: m.reason }, "stopping a bundle's runner");
      await this.stopRunner(m.uuid);
    })().finally(() => this.killing.delete(m.uuid));
    this.killing.set(m.uuid, p);
  }

  /** `--kill TERM`, then `--kill KILL` after a grace when the runner is still there. */
  private async stopRunner(uuid: string): Promise<void> {
    if (await this.runners.kill(uuid, "TERM")) return;
    await abortableSleep(KILL_GRACE_MS).catch(() => {});
    if (!(await this.runners.kill(uuid, "KILL")))
      this.log.warn({ uuid }, "the bundle's runner is still there after KILL");
  }

  private async upgrade(m: Extract<WorkerMessage, { type: "upgrade" }>): Promise<boolean> {
    const refuse = (err: unknown, msg: string) => {
      this.refusedUpgrade = { sha256: m.sha256, until: Date.now() + UPGRADE_RETRY_MS };
      const code = (err as { code?: string }).code;
      this.log.error({ err, code, sha256: m.sha256 }, msg);
    };
    if (this.programFile === null) {
      refuse(new Error("no program file"), "cannot upgrade: this worker runs from sources");
      return false;
    }
    this.log.info(
      { from: this.report.artifactSha256, to: m.sha256, version: m.version, bytes: m.bytes },
      "upgrading: downloading the server's runner artifact",
    );
    try {
      const { content, headerSha256 } = await this.api.artifact(this.wake.signal);
      verifyArtifact(content, m, headerSha256);
      await replaceProgram(this.programFile, content);
    } catch (err) {
      refuse(err, "upgrade failed; keeping this program");
      return false;
    }
    this.log.info({ file: this.programFile, sha256: m.sha256 }, "upgraded: starting the new program");
    return true;
  }

  private async handBack(): Promise<void> {
    const answer = await this.checkout(true);
    if (answer !== null) this.log.info({ requeued: answer.requeued }, "handed the bundles back to the queue");
    let listed: string[] = [...this.attempts.keys(), ...this.starting.keys()];
    await Promise.all([...this.starting.values()].map((s) => s.started));
    try {
      listed = [...(await this.runners.list()).runners.keys()];
    } catch {
      // Stop the ones it knows of.
    }
    await Promise.all(
      listed.map(async (uuid) => {
        this.log.info({ uuid }, "stopping a bundle's runner");
        await this.stopRunner(uuid);
      }),
    );
  }

  /** Checks out (tries for CHECKOUT_BUDGET_MS); null when it could not. */
  private async checkout(handBack: boolean): Promise<{ requeued: string[] } | null> {
    const until = Date.now() + CHECKOUT_BUDGET_MS;
    for (let delay = FIRST_RETRY_MS; ; delay = Math.min(MAX_RETRY_MS, delay * 2)) {
      try {
        const answer = await this.api.checkout({
          workerId: this.opts.workerId,
          ...(handBack ? { handBack: true } : {}),
        });
        this.log.info("checked out");
        return answer;
      } catch (err) {
        const transient = err instanceof WorkerApiError && err.transient;
        if (!transient || Date.now() + delay > until) {
          this.log.error({ err }, "could not check out; the server will find this worker lost");
          return null;
        }
        await abortableSleep(delay);
      }
    }
  }

  /** Logs a failed check-in once per kind of failure, and waits before the next (longer each time). */
  private async failed(err: unknown): Promise<void> {
    const code = (err as { code?: string }).code ?? "error";
    const message = err instanceof Error ? err.message : String(err);
    const key = `${code} ${message}`;
    if (this.failure?.key !== key) {
      const transient = err instanceof WorkerApiError && err.transient;
      this.log[transient ? "warn" : "error"](
        { code, err: message, path: (err as { path?: string }).path },
        transient ? "check-in failed; retrying with back-off" : "check-in refused; retrying with back-off",
      );
      this.failure = { key, count: (this.failure?.count ?? 0) + 1 };
    } else {
      this.failure.count++;
    }
    const refused = err instanceof WorkerApiError && !err.transient;
    const delay = refused ? MAX_RETRY_MS : this.retryMs;
    this.retryMs = Math.min(MAX_RETRY_MS, this.retryMs * 2);
    await this.sleep(delay);
  }

  private recovered(): void {
    if (this.failure !== null) {
      this.log.info({ failures: this.failure.count }, "check-in works again");
      this.failure = null;
    } else if (!this.checkedIn) {
      this.log.info("checked in");
    }
    this.checkedIn = true;
    this.retryMs = FIRST_RETRY_MS;
  }

  private sleep(ms: number): Promise<void> {
    return abortableSleep(ms, this.wake.signal).catch(() => {});
  }
}
