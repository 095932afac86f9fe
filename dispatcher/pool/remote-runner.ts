/**
 * One crunch-run on one instance, as the pool drives it (Arvados: worker/runner.go): starting it (the bundle
 * claimed, then the start document handed to the instance's warm spare supervisor or to `--detach`), killing it
 * with a TERM repeated every timeoutSignal until it is gone or timeoutTerm passes (then the instance is drained),
 * and what `--list` said of it. The Worker owns its runners; this module only speaks to the one instance.
 */

import type { Instance, InstanceType } from "../../cloud-drivers/types.ts";
import type { Config } from "../../config/schema.ts";
import { resolveSecret } from "../../config/secrets.ts";
import type { Executor } from "../../lib/executor.ts";
import { registryOf } from "../../lib/image-ref.ts";
import type { Logger } from "../../lib/logger.ts";
import {
  CONTAINER_LOG_MAX_RANGE_BYTES,
  clampInto,
  clampSpotCheckIntervalMs,
  DEFAULT_CONTAINER_LOG_MAX_BYTES,
  DEFAULT_IMAGE_PULL_RETRY_MS,
  detachAnswerSpare,
  formatHandOffs,
  IMAGE_PULL_RETRY_RANGE_MS,
  MAX_HAND_OFFS,
  parseManyAnswers,
  parsePidAnswer,
  type RegistryAuth,
  type StartDocumentSent,
} from "../../lib/runner-protocol.ts";
import { newRunnerToken } from "../../lib/tokens.ts";
import type { Bundle } from "../../store/types.ts";
import type { RunnerView } from "../types.ts";
import type { WorkerContext } from "./context.ts";
import { PROBE_COMMAND_TIMEOUT_MS, tail } from "./probe.ts";

/** What a runner needs of the Worker it runs on (worker.ts implements it). */
export interface RunnerHost {
  readonly id: string;
  readonly ctx: WorkerContext;
  readonly log: Logger;
  readonly instance: Instance | null;
  readonly instanceType: InstanceType;
  readonly state: string;
  readonly gone: boolean;
  readonly preempted: boolean;
  readonly spareSocket: string | null;
  /** What the instance costs an hour at `now` (its spot price then, or its type's price). */
  pricePerHour(now: number): number;
  /** A warm pool's socket named by `--detach`'s answer (null: none); the next `--list` says whether it is there. */
  learnSpareSocket(socket: string | null): void;
  /** When the last successful probe's `--list` was sent. */
  readonly probedAt: number | null;
  readonly runners: Map<string, RemoteRunner>;
  /** Bundles being requeued because their runner left a preempted instance without reporting it. */
  readonly losing: Set<string>;
  executor(): Executor;
  settleBusy(): void;
}

/** containers.pullRetryTimeout for the start document, within crunch-run's bounds. */
export function pullRetryMs(config: Pick<Config, "containers">): number {
  return clampInto(IMAGE_PULL_RETRY_RANGE_MS, config.containers.pullRetryTimeout);
}

/** dispatcher.containerLogMaxSize for the start document, within crunch-run's bounds. */
export function containerLogMaxBytes(config: { dispatcher: { containerLogMaxSize: number } }): number {
  return clampInto(CONTAINER_LOG_MAX_RANGE_BYTES, config.dispatcher.containerLogMaxSize);
}

const registryAuthDoc = (auth: RegistryAuth[]) => (auth.length === 0 ? {} : { registryAuth: auth });

/** cloud.spotInterruptionCheckInterval for the start document: 0 (never), else within crunch-run's bounds. */
export const spotCheckIntervalMs = clampSpotCheckIntervalMs;

/**
 * How many warm spare supervisors the instance keeps (crunch-run/spare.ts): dispatcher.warmSupervisors, at most
 * the instance's bundle slots (cloud.maxRunningBundlesPerInstance, else its vCPUs, at least one).
 */
export function warmSupervisorsFor(
  type: InstanceType,
  config: { dispatcher: { warmSupervisors: number }; cloud: { maxRunningBundlesPerInstance: number } },
): number {
  const perInstance = config.cloud.maxRunningBundlesPerInstance;
  const slots = perInstance > 0 ? perInstance : Math.max(1, Math.floor(type.vcpus));
  return Math.min(config.dispatcher.warmSupervisors, slots);
}

/**
 * The start document's registryAuth for a bundle's image: the containers.registries entry of the image's own
 * registry, its password read now (file: or env:), or nothing. A password that cannot be read is left out (the
 * pull then goes anonymously and the registry refuses it, which fails the bundle naming the image) and said once
 * to `warn`, by key path only.
 */
export function registryAuthFor(
  image: string,
  config: Pick<Config, "containers">,
  warn: (msg: string) => void,
  env: Readonly<Record<string, string | undefined>> = process.env,
): RegistryAuth[] {
  const server = registryOf(image);
  if (server === null) return [];
  const entry = config.containers.registries[server];
  if (entry === undefined) return [];
  const key = `containers.registries.${server}.password`;
  try {
    return [{ server, username: entry.username, password: resolveSecret(entry.password, key, env) }];
  } catch (err) {
    warn(`${(err as Error).message}: the pull of ${image} goes without credentials`);
    return [];
  }
}

export interface KillState {
  since: number;
  lastSent: number;
  reason: string;
  gaveUp: boolean;
}

export class RemoteRunner implements RunnerView {
  state: RunnerView["state"];
  gpuDevices: readonly number[];
  readonly since: number;
  /** When `--list` first showed it stale (null while it is not). */
  staleSince: number | null = null;
  /** Set by kill(): when the first TERM went out, when the last one did, and whether we gave up. */
  killing: KillState | null = null;
  /** When `--detach` returned success (runners found by `--list` count as detached when found). */
  detachedAt: number | null;
  /** Why the scheduler chose this instance (placed for its cache), for the start's log line. */
  readonly placement: string | undefined;

  constructor(
    readonly worker: RunnerHost,
    readonly uuid: string,
    init: {
      state: RunnerView["state"];
      gpuDevices: readonly number[];
      now: number;
      detached: boolean;
      placement?: string;
    },
  ) {
    this.placement = init.placement;
    this.state = init.state;
    this.gpuDevices = init.gpuDevices;
    this.since = init.now;
    this.detachedAt = init.detached ? init.now : null;
  }

  /**
   * Starts the bundle here (beside the worker's probes and other starts): claims it (staged -> starting with a
   * fresh runner token) and hands the start document to the warm pool, or once claimed runs `--detach`. With
   * handOffWithClaim (`serve`) the document goes to a warm pool as the claim leaves (`claimInFlight`; the claim then
   * asks for the attempt the document names): the REST server in this process waits for the claim before it
   * answers the pool's `start` call (another REST server answers 401 and the pool asks again). A lost claim drops
   * the runner (a pool that got its document is refused its `start`, so nothing runs); a failed start requeues the
   * bundle (event runner:start_failed).
   */
  async start(bundle: Bundle): Promise<void> {
    const w = this.worker;
    const ctx = w.ctx;
    const uuid = bundle.uuid;
    const log = w.log.child({ uuid });
    if (w.gone) {
      this.dropStarting("the instance is shutting down");
      return;
    }
    // The channel to the warm spare opens while the claim runs, which takes its round trip off the start's path.
    let sendHandOff: (payload: string | null) => void = () => {};
    const handed = this.handToSpare(
      new Promise<string | null>((resolve) => {
        sendHandOff = resolve;
      }),
    );
    // To a warm pool, the start document goes before the claim answers (its token and attempt are known now) when
    // the REST server in this process waits for the claims in flight (lib/claims-in-flight.ts).
    const early =
      ctx.handOffWithClaim && handOffPossible(w)
        ? { token: newRunnerToken(), fromAttempt: bundle.attempt }
        : null;
    const earlyDoc =
      early === null
        ? null
        : JSON.stringify({
            ...this.startDocument(bundle, early.fromAttempt + 1, early.token),
            claimInFlight: true,
          } satisfies StartDocumentSent);
    if (earlyDoc !== null) sendHandOff(earlyDoc);
    let claim: Awaited<ReturnType<typeof ctx.transitions.claim>>;
    try {
      claim = await withinClaimTimeout(
        ctx.clock,
        ctx.transitions.claim(uuid, {
          instanceId: w.id,
          instanceType: w.instanceType.name,
          gpuDevices: [...this.gpuDevices],
          pricePerHour: ctx.chargePerHour(bundle, w.instanceType, w.pricePerHour(ctx.clock.now())),
          ...(early ?? {}),
        }),
      );
    } catch (err) {
      sendHandOff(null);
      log.error({ err }, "start transition failed");
      this.dropStarting("the start transition failed");
      return;
    }
    if (!claim.ok) {
      sendHandOff(null);
      log.info({ reason: claim.reason }, "start lost: the bundle changed meanwhile");
      this.dropStarting(`the bundle could not be started (${claim.reason})`);
      return;
    }
    const started = claim.bundle;
    const doc = earlyDoc ?? JSON.stringify(this.startDocument(started, started.attempt, claim.token));
    let failure: string | null = null;
    let via: "spare" | "detach" = "spare";
    try {
      if (w.gone) {
        sendHandOff(null);
        throw new Error("the instance is shutting down");
      }
      sendHandOff(doc);
      if (!(await handed)) {
        via = "detach";
        const res = await w.executor().execute(ctx.cmds.detach(uuid), {
          stdin: `${doc}\n`,
          timeoutMs: PROBE_COMMAND_TIMEOUT_MS,
        });
        if (res.exitCode !== 0)
          failure = `crunch-run --detach exited ${res.exitCode}: ${tail(res.stderr, 200)}`;
        // The pool --detach found or started: the next starts go to it, not only after the next --list.
        else if (w.spareSocket === null) w.learnSpareSocket(detachAnswerSpare(res.stdout.toString("utf8")));
      }
    } catch (err) {
      failure = `crunch-run --detach failed: ${err instanceof Error ? err.message : String(err)}`;
    }
    if (failure === null) {
      this.detachedAt = ctx.clock.now();
      log.info(
        {
          attempt: started.attempt,
          via,
          // Whether a spare's document left as the claim did (handOffWithClaim) or once it was back.
          ...(via === "spare" ? { withClaim: earlyDoc !== null } : {}),
          ...(this.placement === undefined ? {} : { placement: this.placement }),
        },
        "runner started",
      );
      ctx.emit({ type: "runner:started", workerId: w.id, uuid });
      return;
    }
    log.warn({ reason: failure }, "runner start failed: requeueing");
    try {
      await ctx.transitions.requeue(uuid, started.attempt, failure);
    } catch (err) {
      log.error({ err }, "requeue after a failed start failed (sync will retry)");
    }
    this.dropStarting(failure);
  }

  /** The start document of `bundle`'s attempt `attempt` here, with its runner token (never logged: it holds it). */
  private startDocument(bundle: Bundle, attempt: number, token: string): StartDocumentSent {
    const w = this.worker;
    const ctx = w.ctx;
    const cloud = ctx.config.cloud;
    return {
      uuid: bundle.uuid,
      attempt,
      apiUrl: ctx.runnerApiUrl,
      token,
      instanceType: w.instanceType.name,
      gpuDevices: [...this.gpuDevices],
      runtimeEngine: ctx.config.dispatcher.runtimeEngine,
      // Only the process runtime uses them (crunch-run's defaults equal the config's).
      ...(ctx.config.dispatcher.runtimeEngine === "docker"
        ? {}
        : {
            processUidFirst: ctx.config.dispatcher.processRuntimeFirstUid,
            processUidCount: ctx.config.dispatcher.processRuntimeUidCount,
          }),
      warmSupervisors: warmSupervisorsFor(w.instanceType, ctx.config),
      // Only preemptible types' runners watch for spot interruption notices (crunch-run's defaults: off, 5 s).
      ...(w.instanceType.preemptible
        ? { preemptible: true, spotCheckIntervalMs: spotCheckIntervalMs(cloud.spotInterruptionCheckInterval) }
        : {}),
      // Only the bundle's own image's registry.
      ...registryAuthDoc(
        registryAuthFor(bundle.image, ctx.config, (msg) => w.log.warn({ uuid: bundle.uuid }, msg)),
      ),
      ...(pullRetryMs(ctx.config) === DEFAULT_IMAGE_PULL_RETRY_MS
        ? {}
        : { imagePullRetryMs: pullRetryMs(ctx.config) }),
      ...(containerLogMaxBytes(ctx.config) === DEFAULT_CONTAINER_LOG_MAX_BYTES
        ? {}
        : { containerLogMaxBytes: containerLogMaxBytes(ctx.config) }),
    };
  }

  /**
   * Hands a start document straight to the instance's warm spare supervisor (crunch-run/spare.ts) over the
   * SSH connection, which skips starting a `crunch-run --detach` process. The hand-offs of one instance made in
   * the same turn (one pass's starts) share one exchange with its pool (handOffTogether); its channel opens at
   * once, and the documents (`payload`, which never rejects; null for a claim that was lost) are sent once all are
   * known: at once with handOffWithClaim, else once every claim is back. True when a spare took this one; false (no hand-off, no spare known, the executor cannot, the
   * spare is gone or busy or refused) means use --detach.
   */
  private async handToSpare(payload: Promise<string | null>): Promise<boolean> {
    const w = this.worker;
    const socket = w.spareSocket;
    const executor = w.executor();
    if (socket === null || !handOffPossible(w)) return false;
    const log = w.log.child({ uuid: this.uuid });
    // From the moment the document is known (at once, or once the claim is back), not from the channel's opening.
    let t0 = w.ctx.clock.now();
    void payload.then(() => {
      t0 = w.ctx.clock.now();
    });
    const got = await handOffTogether(w, socket, executor, this.uuid, payload);
    if ((await payload) === null) return false;
    if (got.answer !== null && parsePidAnswer(got.answer) !== null) {
      log.debug({ ms: w.ctx.clock.now() - t0 }, "handed to the spare supervisor");
      return true;
    }
    if (got.answer !== null) {
      log.debug(
        { answer: got.answer.slice(0, 200) },
        "the spare supervisor refused the bundle; using --detach",
      );
    } else {
      log.debug({ err: got.error }, "no spare supervisor; using --detach");
    }
    return false;
  }

  /** Forgets a runner whose start did not happen, and says so (runner:start_failed). */
  private dropStarting(reason: string): void {
    const w = this.worker;
    if (w.runners.get(this.uuid) === this && this.state === "starting") {
      w.runners.delete(this.uuid);
      w.settleBusy();
    }
    w.ctx.emit({ type: "runner:start_failed", workerId: w.id, uuid: this.uuid, reason });
  }

  /** `--kill 15` now, and again every timeoutSignal (repeatKill) until it is gone or timeoutTerm passes. */
  kill(reason: string): void {
    if (this.killing !== null) return;
    const now = this.worker.ctx.clock.now();
    this.killing = { since: now, lastSent: now, reason, gaveUp: false };
    this.worker.log.info({ uuid: this.uuid, reason }, "killing a runner (TERM)");
    sendKill(this.worker, this.uuid);
  }

  /** The kill's next step at `now`; true when it has just given up (the worker drains the instance). */
  repeatKill(now: number): boolean {
    const k = this.killing;
    if (k === null || k.gaveUp) return false;
    const cloud = this.worker.ctx.config.cloud;
    if (now - k.since >= cloud.timeoutTerm) {
      k.gaveUp = true;
      this.worker.log.warn({ uuid: this.uuid, afterMs: now - k.since }, "runner outlived SIGTERM: draining");
      return true;
    }
    if (now - k.lastSent >= cloud.timeoutSignal) {
      k.lastSent = now;
      sendKill(this.worker, this.uuid);
    }
    return false;
  }
}

/** The instance's warm pool is known and can be spoken to over its connection (else starts go by `--detach`). */
function handOffPossible(w: RunnerHost): boolean {
  return w.spareSocket !== null && w.executor().exchange !== undefined;
}

/** One `--kill 15 <uuid>` to the worker's instance (also for a runner the pool does not know yet). */
export function sendKill(w: RunnerHost, uuid: string): void {
  if (w.instance === null || w.state === "shutdown") return;
  const exec = w.executor();
  w.ctx.track(
    exec.execute(w.ctx.cmds.kill(uuid, 15), { timeoutMs: PROBE_COMMAND_TIMEOUT_MS }).then((res) => {
      if (res.exitCode !== 0) {
        w.log.info(
          { uuid, exitCode: res.exitCode, stderr: tail(res.stderr, 200) },
          "runner still running after TERM",
        );
      }
    }),
    "kill",
    w.log,
  );
}

/**
 * The worker's runners after a `--list` that showed `listed` (uuid -> listed state): runners found are added (a
 * restart, or a start the pool did not see finish), stale ones noted, and runners no longer listed forgotten,
 * except a `starting` one that sync has not decided about yet (keepStarting). On a preempted instance, a runner
 * that left without reporting the notice has its bundle requeued here (loseUnreported).
 */
export function reconcileRunners(
  w: RunnerHost,
  listed: ReadonlyMap<string, "running" | "stale">,
  now: number,
): void {
  const { queue, emit } = w.ctx;
  for (const [uuid, state] of listed) {
    let r = w.runners.get(uuid);
    if (r === undefined) {
      r = new RemoteRunner(w, uuid, {
        state,
        gpuDevices: queue?.get(uuid)?.gpuDevices ?? [],
        now,
        detached: true,
      });
      w.runners.set(uuid, r);
      w.log.info({ uuid }, "found a runner");
      emit({ type: "runner:started", workerId: w.id, uuid, reason: "listed" });
    }
    r.state = state;
    if (state === "stale") r.staleSince ??= now;
    else r.staleSince = null;
  }
  for (const r of [...w.runners.values()]) {
    if (listed.has(r.uuid)) continue;
    if (r.state === "starting" && keepStarting(w, r, now)) continue;
    w.runners.delete(r.uuid);
    w.log.info({ uuid: r.uuid }, "runner gone");
    if (w.preempted) loseUnreported(w, r.uuid);
    emit({ type: "runner:gone", workerId: w.id, uuid: r.uuid, reason: "no longer listed" });
  }
}

/**
 * How long a start waits for its claim (one guarded UPDATE) before it gives the start up. Every other step of a
 * start has a deadline of its own, so a start always returns: sync leaves a starting bundle alone while its start
 * is under way, and a claim that commits after this is a starting bundle with no runner, which sync requeues.
 */
export const CLAIM_TIMEOUT_MS = 30_000;

/**
 * The reason the claim's timer is stopped with. An abort without one makes a DOMException with its stack for
 * every start; a pass that starts hundreds of bundles paid tens of ms for them (bench:scheduler).
 */
const CLAIM_RETURNED = new Error("the claim returned");

function withinClaimTimeout<T>(clock: WorkerContext["clock"], claim: Promise<T>): Promise<T> {
  const timer = new AbortController();
  claim.catch(() => {}); // a claim given up on may still fail later
  const late = clock.sleep(CLAIM_TIMEOUT_MS, timer.signal).then(() => {
    throw new Error(`the claim did not return in ${CLAIM_TIMEOUT_MS} ms`);
  });
  late.catch(() => {});
  return Promise.race([claim, late]).finally(() => timer.abort(CLAIM_RETURNED));
}

/**
 * A `starting` runner that `--list` does not show stays until sync decides about its bundle: while its start has
 * not returned, while the list was sent before the start returned (starts run beside probes, so such a list may
 * have missed it), and while the queue still has the bundle starting on this instance (sync requeues it, or the
 * runner got further and ended). Without a queue, for dispatcher.staleLockTimeout. A runner being killed is gone
 * as soon as a list sent after its start returned misses it.
 */
function keepStarting(w: RunnerHost, r: RemoteRunner, now: number): boolean {
  if (r.detachedAt === null) return true;
  // A list sent before the start returned may have missed the runner: only a later one tells.
  if (w.probedAt === null || w.probedAt <= r.detachedAt) return true;
  if (r.killing !== null) return false;
  const queue = w.ctx.queue;
  if (queue === undefined) return now - r.detachedAt < w.ctx.config.dispatcher.staleLockTimeout;
  const row = queue.get(r.uuid);
  return row?.state === "starting" && row.instanceId === w.id;
}

/**
 * A runner left a preempted instance while the queue still has its bundle running there: it stopped without
 * reporting the notice (or the report has not reached the queue yet). Requeue it now, with the reason, rather
 * than wait for sync's two probes; the guarded transition loses harmlessly to a report or a finish.
 */
function loseUnreported(w: RunnerHost, uuid: string): void {
  const row = w.ctx.queue?.get(uuid);
  if (row === undefined || row.state !== "running" || row.instanceId !== w.id || w.losing.has(uuid)) return;
  w.losing.add(uuid);
  const reason = `preempted: spot interruption notice on instance ${w.id} (its runner did not report it)`;
  w.ctx.track(
    w.ctx.transitions
      .lose(uuid, row.attempt, reason)
      .then((res) => {
        if (res.ok)
          w.log.info({ uuid, state: res.bundle.state }, "requeued a bundle of the preempted instance");
      })
      .finally(() => w.losing.delete(uuid)),
    "requeueing a bundle of a preempted instance",
    w.log,
  );
}

interface HandOff {
  uuid: string;
  /** The start document's JSON; null when its claim was lost (nothing is sent for it). */
  doc: Promise<string | null>;
  done(got: { answer: string | null; error: string | null }): void;
}

/** The hand-offs of each instance waiting for the end of this turn, when they go as one exchange. */
const handOffsOf = new WeakMap<RunnerHost, HandOff[]>();

/**
 * One hand-off to the instance's warm pool, sent in one exchange (`many`, lib/runner-protocol.ts) with the
 * others of this instance made in the same turn of the event loop (at most MAX_HAND_OFFS an exchange). Resolves
 * to the pool's answer for this bundle (`pid <n>` or `refused <why>`), or null with why there is none.
 */
function handOffTogether(
  w: RunnerHost,
  socket: string,
  executor: Executor,
  uuid: string,
  doc: Promise<string | null>,
): Promise<{ answer: string | null; error: string | null }> {
  let batch = handOffsOf.get(w);
  if (batch === undefined) {
    const mine: HandOff[] = [];
    batch = mine;
    handOffsOf.set(w, mine);
    queueMicrotask(() => {
      handOffsOf.delete(w);
      for (let i = 0; i < mine.length; i += MAX_HAND_OFFS) {
        void exchangeHandOffs(socket, executor, mine.slice(i, i + MAX_HAND_OFFS));
      }
    });
  }
  const list = batch;
  return new Promise((done) => list.push({ uuid, doc, done }));
}

async function exchangeHandOffs(socket: string, executor: Executor, batch: HandOff[]): Promise<void> {
  const payload = Promise.all(batch.map((h) => h.doc)).then((docs) => {
    const sent = batch.flatMap((h, i) => {
      const doc = docs[i];
      return doc === null || doc === undefined ? [] : [{ mode: "start" as const, uuid: h.uuid, doc }];
    });
    return sent.length === 0 ? null : formatHandOffs(sent);
  });
  let answers = new Map<string, string>();
  let error: string | null = null;
  try {
    const text = await executor.exchange?.(socket, payload, { timeoutMs: 5000 });
    answers = parseManyAnswers(text?.toString("utf8") ?? "");
  } catch (err) {
    error = err instanceof Error ? err.message : String(err);
  }
  for (const h of batch) {
    const answer = answers.get(h.uuid) ?? null;
    h.done({ answer, error: answer === null ? (error ?? "the warm pool gave no answer for it") : null });
  }
}
