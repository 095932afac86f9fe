/**
 * The bundle state machine (DESIGN.md §3). Every transition is one guarded statement that updates the row,
 * writes its bundle_events row and NOTIFYs BUNDLE_CHANNEL (`<uuid> <state> <changeSeq>`), all or nothing.
 * Zero rows means the guard did not hold (someone else won a race, or the caller is stale): the result says
 * why and carries the row as it is now. A lost race is never an exception.
 *
 * Leaving starting/running clears runner_token_hash, which is what makes a runner token stop working. Leaving
 * running adds the attempt's cost to cost_dollars (ADD_ATTEMPT_COST).
 * Every transition clears scheduling_status (the scheduler sets it again for queued bundles).
 */
import { type Db, prepared } from "./db.ts";
import { type BundleRow, bundleFromRow, getBundle, imageStoreInputSql, NOW } from "./queries.ts";
import { BUNDLE_CHANNEL, type Bundle, type BundleState, type TransitionResult } from "./types.ts";

const NON_FINAL: readonly BundleState[] = ["created", "staged", "starting", "running"];

/**
 * The assignment that charges an attempt when it leaves `running` (in transition()'s statement, where `cur` holds
 * the state it left): its price_per_hour, fixed at the claim, x the time since running_at, added to what the
 * bundle's earlier attempts cost. Unchanged when it leaves another state (a kill while staged or starting) or no
 * price is known. `extra` replaces the computed cost of the attempt when given (a SQL expression, may be NULL).
 */
function addAttemptCost(extra?: string): string {
  const ran = `b.price_per_hour * greatest(extract(epoch FROM ${NOW} - b.running_at)::float8, 0) / 3600`;
  const attempt = extra === undefined ? ran : `coalesce(${extra}, ${ran})`;
  return `cost_dollars = CASE WHEN cur.from_state = 'running' AND b.running_at IS NOT NULL
      THEN coalesce(b.cost_dollars + ${attempt}, ${attempt}, b.cost_dollars) ELSE b.cost_dollars END`;
}
const ADD_ATTEMPT_COST = addAttemptCost();

export interface TransitionSpec {
  from: readonly BundleState[];
  /** SQL expression for the new state: a quoted literal like `'staged'`, or a CASE over the old row `b`. */
  to: string;
  /** Require this attempt number (the runner's and the pool's view of which attempt they act on). */
  attempt?: number;
  /** Extra guard over the old row `b`, e.g. `b.attempt < b.max_attempts`. */
  guard?: string;
  /** Why the extra guard rejects `current` (checked after the state and attempt guards). */
  guardFailed?: (current: Bundle) => boolean;
  /** Extra assignments (SQL over the old row `b`); parameters from $7 on. */
  set?: string[];
  params?: readonly unknown[];
  /** SQL expression for state_reason (also the event's reason); default the reason parameter $4. */
  stateReason?: string;
  reason: string | null;
  actor: string;
}

/*
 * KEYED_LOCKS. Every transition statement (transition() and those that move a list of bundles: stageBundles,
 * startBundles, markRunningByTokens) finds and locks its rows by a unique key alone and checks the state in the
 * UPDATE, on the row it holds locked (so on its latest version: nothing else can change it by then). A state test
 * where the rows are found would let the planner find them through an index of the queued states, and its
 * estimate of how many bundles are in a state is only as recent as the table's last ANALYZE: when a queue grows
 * faster than autovacuum analyzes (20,000 submitted after a history of 100,000), the claim of 20 read every staged
 * row, 1.5 ms becoming 69 ms, and on PGlite one bundle's transition took 11.7 ms instead of 1.1 (docs/performance.md,
 * "bench:queue-statements"). By key, the plan is an index lookup per bundle whatever the statistics say. The
 * other writes to one bundle found by key do the same (keyedUpdate in queries.ts: a runner's heartbeat, its
 * output manifest, the scheduler's status, the input manifests; a log chunk by token, migration 018).
 */

/**
 * The tail of a guarded transition statement, after a CTE `upd` that returns the moved rows with
 * `transition_from_state`: one bundle_events row and one NOTIFY (`<uuid> <state> <changeSeq>`) per moved row, in
 * the same statement; the statement returns the moved rows. `actor` and `channel` are parameter references.
 */
function eventsAndNotifies(actor: string, channel: string): string {
  return `ev AS (
      INSERT INTO bundle_events (bundle_uuid, from_state, to_state, attempt, reason, actor)
      SELECT uuid, transition_from_state, state, attempt, state_reason, ${actor}::text FROM upd
      RETURNING id
    ), n AS (
      SELECT pg_notify(${channel}::text, uuid || ' ' || state || ' ' || change_seq) FROM upd
    )
    SELECT upd.* FROM upd WHERE (SELECT count(*) FROM ev) + (SELECT count(*) FROM n) >= 0`;
}

/**
 * Runs one guarded transition. Parameters: $1 uuid, $2 allowed from-states, $3 actor, $4 reason, $5 channel,
 * $6 required attempt (or null), $7... spec.params.
 */
export async function transition(db: Db, uuid: string, spec: TransitionSpec): Promise<TransitionResult> {
  // Checked in upd, on the row cur holds locked (found by its uuid alone: KEYED_LOCKS above).
  const guard =
    "cur.from_state = ANY($2::text[]) AND ($6::int IS NULL OR b.attempt = $6::int)" +
    (spec.guard ? ` AND (${spec.guard})` : "");
  const set = [
    `state = ${spec.to}`,
    `state_reason = ${spec.stateReason ?? "$4::text"}`,
    "scheduling_status = NULL",
    ...(spec.set ?? []),
  ];
  // Prepared: by uuid, the plan is the same whatever the values (store/db.ts, prepared).
  const sql = prepared(`WITH cur AS (
      SELECT b.uuid, b.state AS from_state FROM bundles b WHERE b.uuid = $1 FOR UPDATE
    ), upd AS (
      UPDATE bundles b SET ${set.join(", ")}
      FROM cur WHERE b.uuid = cur.uuid AND ${guard}
      RETURNING b.*, cur.from_state AS transition_from_state
    ), ${eventsAndNotifies("$3", "$5")}`);
  const params = [
    uuid,
    spec.from,
    spec.actor,
    spec.reason,
    BUNDLE_CHANNEL,
    spec.attempt ?? null,
    ...(spec.params ?? []),
  ];
  // A retry happens only if the row changed between the statement and the re-read so that it now qualifies.
  for (let i = 0; i < 3; i++) {
    const { rows } = await db.query<BundleRow>(sql, params);
    if (rows[0]) return { ok: true, bundle: bundleFromRow(rows[0]) };
    const current = await getBundle(db, uuid);
    if (!current) return { ok: false, reason: "not_found", current: null };
    if (!spec.from.includes(current.state)) return { ok: false, reason: "wrong_state", current };
    if (spec.attempt !== undefined && current.attempt !== spec.attempt) {
      return { ok: false, reason: "wrong_attempt", current };
    }
    if (spec.guardFailed?.(current)) return { ok: false, reason: "wrong_attempt", current };
  }
  return { ok: false, reason: "wrong_state", current: await getBundle(db, uuid) };
}

/** created -> staged: every dependency is ready (or failed, with allowFailedDependencies). */
export function stageBundle(
  db: Db,
  uuid: string,
  args: { actor: string; reason?: string | null },
): Promise<TransitionResult> {
  return transition(db, uuid, {
    from: ["created"],
    to: "'staged'",
    set: [`staged_at = ${NOW}`],
    reason: args.reason ?? null,
    actor: args.actor,
  });
}

/**
 * created -> staged for many bundles in one guarded statement (the bundle manager's page): each row still
 * `created` is staged with its own reason and event; one NOTIFY (`* staged <n>`) for all. Returns the bundles
 * that moved; a bundle that left `created` meanwhile is left alone (a lost race, as in transition()).
 */
export async function stageBundles(
  db: Db,
  items: readonly { uuid: string; reason: string | null }[],
  actor: string,
): Promise<Bundle[]> {
  if (items.length === 0) return [];
  const { rows } = await db.query<BundleRow>(
    `WITH want AS (
       SELECT * FROM unnest($1::text[], $2::text[]) AS w(uuid, reason)
     ), cur AS (
       -- By key alone (KEYED_LOCKS above): the state is checked in upd.
       SELECT b.uuid, b.state AS from_state, w.reason FROM bundles b JOIN want w ON w.uuid = b.uuid
       ORDER BY b.uuid FOR UPDATE OF b
     ), upd AS (
       UPDATE bundles b SET state = 'staged', state_reason = cur.reason, scheduling_status = NULL,
         staged_at = ${NOW},
         -- Its inputs' trees, for the scheduler's locality (006_locality.sql): the output manifests of its
         -- dependencies, known from now on (each is final). Skipped for bundles without dependencies. An image
         -- from the store (007_images.sql) is an input tree too: its bytes cached on an instance count alike.
         input_manifests = CASE WHEN b.dependencies = '[]'::jsonb THEN b.input_manifests ELSE coalesce((
           SELECT jsonb_agg(DISTINCT jsonb_build_object('digest', d.output_manifest, 'bytes', d.output_bytes))
           FROM bundle_dependencies bd JOIN bundles d ON d.uuid = bd.dependency_uuid
           WHERE bd.bundle_uuid = b.uuid AND d.output_manifest IS NOT NULL), '[]'::jsonb) END
           || ${imageStoreInputSql("b.image_store")}
       FROM cur WHERE b.uuid = cur.uuid AND cur.from_state = 'created'
       RETURNING b.*
     ), ev AS (
       INSERT INTO bundle_events (bundle_uuid, from_state, to_state, attempt, reason, actor)
       SELECT uuid, 'created', state, attempt, state_reason, $3::text FROM upd
       RETURNING id
     ), n AS (
       SELECT pg_notify($4::text, '* staged ' || count(*)) FROM upd HAVING count(*) > 0
     )
     SELECT upd.* FROM upd WHERE (SELECT count(*) FROM ev) + (SELECT count(*) FROM n) >= 0`,
    [items.map((i) => i.uuid), items.map((i) => i.reason), actor, BUNDLE_CHANNEL],
  );
  return rows.map(bundleFromRow);
}

/** created -> failed: a dependency failed or was killed. */
export function failCreated(
  db: Db,
  uuid: string,
  args: { actor: string; reason: string },
): Promise<TransitionResult> {
  return transition(db, uuid, {
    from: ["created"],
    to: "'failed'",
    set: [`finished_at = ${NOW}`],
    reason: args.reason,
    actor: args.actor,
  });
}

/**
 * staged -> starting: the dispatcher assigned the bundle to an instance. Takes the next attempt number (refused
 * with "wrong_attempt" once attempts are exhausted) and records the instance and the runner token's hash.
 */
export function startBundle(
  db: Db,
  uuid: string,
  args: {
    instanceId: string;
    instanceType: string;
    runnerTokenHash: string;
    gpuDevices: readonly number[];
    /** What the attempt is charged per hour of running (StartItem.pricePerHour); none: nothing. */
    pricePerHour?: number | null;
    /** The attempt the bundle must be at now (StartItem.fromAttempt); none: any. */
    fromAttempt?: number | null;
    actor: string;
  },
): Promise<TransitionResult> {
  return transition(db, uuid, {
    from: ["staged"],
    to: "'starting'",
    ...(args.fromAttempt === undefined || args.fromAttempt === null ? {} : { attempt: args.fromAttempt }),
    guard: "b.attempt < b.max_attempts",
    guardFailed: (b) => b.attempt >= b.maxAttempts,
    set: [
      "attempt = b.attempt + 1",
      "instance_id = $7::text",
      "instance_type = $8::text",
      "runner_token_hash = $9::text",
      "gpu_devices = $10::int[]",
      "price_per_hour = $11::float8",
      `starting_at = ${NOW}`,
      "running_at = NULL",
      "exit_code = NULL",
    ],
    params: [
      args.instanceId,
      args.instanceType,
      args.runnerTokenHash,
      args.gpuDevices,
      args.pricePerHour ?? null,
    ],
    reason: null,
    actor: args.actor,
  });
}

/** One bundle of startBundles(): where it starts, and its runner token's hash. */
export interface StartItem {
  uuid: string;
  instanceId: string;
  instanceType: string;
  runnerTokenHash: string;
  gpuDevices: readonly number[];
  /**
   * What the attempt is charged per hour of running: its share of its instance's price now (chargePerHour,
   * dispatcher/scheduler/eligible.ts). Absent or null: no price is known, and running costs it nothing.
   */
  pricePerHour?: number | null;
  /**
   * The attempt the bundle must be at now (the claim makes the next one), when the start document naming the next
   * attempt left before the claim was made (dispatcher/pool/remote-runner.ts); absent or null: any.
   */
  fromAttempt?: number | null;
}

/**
 * startBundle() for many bundles in one statement (the dispatcher's claims of one scheduling pass,
 * dispatcher/queue/transitions.ts): each bundle still `staged` with attempts left moves to `starting` with its
 * own instance, token hash and devices, and gets its own event and NOTIFY, all or nothing. Returns the bundles
 * that moved, each by the token hash it now holds; one that did not (it changed meanwhile, or a uuid given
 * twice) is left out, and the caller asks startBundle() for it, which says why.
 */
export async function startBundles(
  db: Db,
  items: readonly StartItem[],
  actor: string,
): Promise<Map<string, Bundle>> {
  if (items.length === 0) return new Map();
  // Prepared: the plan does not depend on the values (store/db.ts, prepared). Rows locked by key alone
  // (KEYED_LOCKS): the state is checked in upd, on the locked row.
  const { rows } = await db.query<BundleRow>(
    prepared(`WITH want AS (
       SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $8::float8[], $9::int[])
         AS w(uuid, instance_id, instance_type, token_hash, gpu_devices, price, from_attempt)
     ), cur AS (
       SELECT b.uuid, b.state AS from_state, w.instance_id, w.instance_type, w.token_hash, w.gpu_devices, w.price,
         w.from_attempt
       FROM bundles b JOIN want w ON w.uuid = b.uuid
       ORDER BY b.uuid FOR UPDATE OF b
     ), upd AS (
       UPDATE bundles b SET state = 'starting', state_reason = NULL, scheduling_status = NULL,
         attempt = b.attempt + 1, instance_id = cur.instance_id, instance_type = cur.instance_type,
         runner_token_hash = cur.token_hash, gpu_devices = cur.gpu_devices::int[], price_per_hour = cur.price,
         starting_at = ${NOW}, running_at = NULL, exit_code = NULL
       FROM cur WHERE b.uuid = cur.uuid AND cur.from_state = 'staged' AND b.attempt < b.max_attempts
         AND (cur.from_attempt IS NULL OR b.attempt = cur.from_attempt)
       RETURNING b.*, cur.from_state AS transition_from_state
     ), ${eventsAndNotifies("$6", "$7")}`),
    [
      items.map((i) => i.uuid),
      items.map((i) => i.instanceId),
      items.map((i) => i.instanceType),
      items.map((i) => i.runnerTokenHash),
      items.map((i) => `{${i.gpuDevices.join(",")}}`),
      actor,
      BUNDLE_CHANNEL,
      items.map((i) => i.pricePerHour ?? null),
      items.map((i) => i.fromAttempt ?? null),
    ],
  );
  return new Map(rows.map((r) => [r.runner_token_hash ?? "", bundleFromRow(r)]));
}

/**
 * staged -> starting on a user's own worker (docs/workers.md): the next attempt, the worker, its GPU devices. No
 * runner token yet: the REST server makes one when it hands the start document to the worker's check-in
 * (deliverToWorker), so no token is ever kept in the clear. instance_type says `worker`.
 */
export function startBundleOnWorker(
  db: Db,
  uuid: string,
  args: { workerId: string; gpuDevices: number[]; actor: string },
): Promise<TransitionResult> {
  return transition(db, uuid, {
    from: ["staged"],
    to: "'starting'",
    guard: "b.attempt < b.max_attempts",
    guardFailed: (b) => b.attempt >= b.maxAttempts,
    set: [
      "attempt = b.attempt + 1",
      "instance_id = NULL",
      "instance_type = 'worker'",
      "worker_id = $7::text",
      "worker_delivered_at = NULL",
      "runner_token_hash = NULL",
      "gpu_devices = $8::int[]",
      "price_per_hour = NULL",
      `starting_at = ${NOW}`,
      "running_at = NULL",
      "exit_code = NULL",
    ],
    params: [args.workerId, args.gpuDevices],
    reason: null,
    actor: args.actor,
  });
}

/** staged -> failed: no configured instance type can ever run it. */
export function failStaged(
  db: Db,
  uuid: string,
  args: { actor: string; reason: string },
): Promise<TransitionResult> {
  return transition(db, uuid, {
    from: ["staged"],
    to: "'failed'",
    set: [`finished_at = ${NOW}`],
    reason: args.reason,
    actor: args.actor,
  });
}

/** starting -> running: the runner of this attempt started. */
export function markRunning(
  db: Db,
  uuid: string,
  attempt: number,
  args: { actor: string },
): Promise<TransitionResult> {
  return transition(db, uuid, {
    from: ["starting"],
    to: "'running'",
    attempt,
    set: [`running_at = ${NOW}`],
    reason: null,
    actor: args.actor,
  });
}

/**
 * starting -> running for the bundles whose runner tokens hash to `tokenHashes`: runners' `start` calls in one
 * statement, without looking the tokens up first (the REST server groups the calls that arrive together,
 * rest-server/routes-runner.ts). Each moved bundle gets its own event and NOTIFY. Returns the moved bundles by
 * token hash; a hash that moved nothing (a bad or stale token, or a retried start) is left out, and its caller
 * looks closer.
 */
export async function markRunningByTokens(
  db: Db,
  tokenHashes: readonly string[],
  actor: string,
): Promise<Map<string, Bundle>> {
  if (tokenHashes.length === 0) return new Map();
  // Prepared: the plan does not depend on the values (store/db.ts, prepared).
  const { rows } = await db.query<BundleRow>(
    prepared(`WITH cur AS (
       SELECT b.uuid, b.state AS from_state FROM bundles b
       WHERE b.runner_token_hash = ANY($1::text[]) ORDER BY b.uuid FOR UPDATE
     ), upd AS (
       UPDATE bundles b SET state = 'running', state_reason = NULL, scheduling_status = NULL,
         running_at = ${NOW}
       FROM cur WHERE b.uuid = cur.uuid AND cur.from_state = 'starting'
       RETURNING b.*, cur.from_state AS transition_from_state
     ), ${eventsAndNotifies("$2", "$3")}`),
    [tokenHashes, actor, BUNDLE_CHANNEL],
  );
  return new Map(rows.map((r) => [r.runner_token_hash ?? "", bundleFromRow(r)]));
}

const CLEAR_INSTANCE = [
  "instance_id = NULL",
  "worker_id = NULL",
  "worker_delivered_at = NULL",
  "instance_type = NULL",
  "runner_token_hash = NULL",
  "gpu_devices = '{}'",
];

/** starting -> staged: the runner never appeared, or failed before starting. */
export function requeueStarting(
  db: Db,
  uuid: string,
  attempt: number,
  args: { actor: string; reason: string },
): Promise<TransitionResult> {
  return transition(db, uuid, {
    from: ["starting"],
    to: "'staged'",
    attempt,
    set: CLEAR_INSTANCE,
    reason: args.reason,
    actor: args.actor,
  });
}

/**
 * running -> ready when the exit code is 0 and the runner did not report a failure (`failed`), else failed.
 * The reason is kept either way; a failure without one gets a reason naming the exit code (or its absence: a
 * null exit code means the command never ran or its exit status is unknown).
 */
export function finishBundle(
  db: Db,
  uuid: string,
  attempt: number,
  args: {
    exitCode: number | null;
    failed?: boolean;
    reason?: string | null;
    resourceUsage?: Record<string, number> | null;
    /** The attempt's cost, instead of its price_per_hour x the time it ran (ADD_ATTEMPT_COST). */
    costDollars?: number | null;
    actor: string;
  },
): Promise<TransitionResult> {
  const ok = args.exitCode === 0 && args.failed !== true;
  const fallback =
    args.exitCode === null ? "the runner reported no exit code" : `exited with code ${args.exitCode}`;
  return transition(db, uuid, {
    from: ["running"],
    to: ok ? "'ready'" : "'failed'",
    attempt,
    set: [
      "exit_code = $7::int",
      "resource_usage = coalesce($8::jsonb, b.resource_usage)",
      addAttemptCost("$9::float8"),
      "runner_token_hash = NULL",
      `finished_at = ${NOW}`,
    ],
    params: [
      args.exitCode,
      args.resourceUsage == null ? null : JSON.stringify(args.resourceUsage),
      args.costDollars ?? null,
    ],
    reason: args.reason || (ok ? null : fallback),
    actor: args.actor,
  });
}

/**
 * running -> staged when the instance was lost or preempted, or its runner gave the bundle back (the runtime
 * failed to start it), and attempts remain; running -> failed (reason ending "(attempts exhausted: n of m)")
 * when they do not.
 */
export function loseBundle(
  db: Db,
  uuid: string,
  attempt: number,
  args: { actor: string; reason: string },
): Promise<TransitionResult> {
  const exhausted = "b.attempt >= b.max_attempts";
  return transition(db, uuid, {
    from: ["running"],
    to: `CASE WHEN ${exhausted} THEN 'failed' ELSE 'staged' END`,
    attempt,
    stateReason: `CASE WHEN ${exhausted}
      THEN $4::text || ' (attempts exhausted: ' || b.attempt || ' of ' || b.max_attempts || ')'
      ELSE $4::text END`,
    set: [
      ...CLEAR_INSTANCE,
      ADD_ATTEMPT_COST,
      `finished_at = CASE WHEN ${exhausted} THEN ${NOW} ELSE NULL END`,
    ],
    reason: args.reason,
    actor: args.actor,
  });
}

/**
 * running -> staged for a runner whose image's registry was unavailable (crunchrun.image_unavailable): like
 * loseBundle, but while the bundle's image_requeues is below `uncounted` the attempt is not used up (max_attempts
 * grows by one, image_requeues too). Past that it counts like loseBundle (failed once attempts are exhausted).
 */
export function requeueForUnavailableImage(
  db: Db,
  uuid: string,
  attempt: number,
  args: { actor: string; reason: string; uncounted: number },
): Promise<TransitionResult> {
  const free = "b.image_requeues < $7::int";
  const exhausted = `(NOT ${free} AND b.attempt >= b.max_attempts)`;
  return transition(db, uuid, {
    from: ["running"],
    to: `CASE WHEN ${exhausted} THEN 'failed' ELSE 'staged' END`,
    attempt,
    stateReason: `CASE
      WHEN ${free} THEN $4::text || ' (not counted as an attempt: ' || (b.image_requeues + 1) || ' of ' || $7::int || ' such requeues)'
      WHEN ${exhausted} THEN $4::text || ' (attempts exhausted: ' || b.attempt || ' of ' || b.max_attempts || ')'
      ELSE $4::text END`,
    set: [
      ...CLEAR_INSTANCE,
      ADD_ATTEMPT_COST,
      `finished_at = CASE WHEN ${exhausted} THEN ${NOW} ELSE NULL END`,
      `max_attempts = CASE WHEN ${free} THEN b.max_attempts + 1 ELSE b.max_attempts END`,
      "image_requeues = b.image_requeues + 1",
    ],
    params: [args.uncounted],
    reason: args.reason,
    actor: args.actor,
  });
}

/** any non-final -> killed (user or operator). The instance fields stay, so the dispatcher can stop it. */
export function killBundle(
  db: Db,
  uuid: string,
  args: { actor: string; reason: string },
): Promise<TransitionResult> {
  return transition(db, uuid, {
    from: NON_FINAL,
    to: "'killed'",
    set: ["runner_token_hash = NULL", ADD_ATTEMPT_COST, `finished_at = ${NOW}`],
    reason: args.reason,
    actor: args.actor,
  });
}
