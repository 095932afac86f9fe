/**
 * Runtime SQL: one exported function per statement, `(db, args)`, positional parameters only, rows mapped to
 * the camelCase types of store/types.ts. State changes live in transitions.ts.
 * Over 500 lines because every runtime statement is here, next to the others on the same tables, so that a
 * change of a table is reviewed against all of its queries at once; each function is a few lines.
 */
import { DispatchCloudError } from "../lib/errors.ts";
import { imageKey } from "../lib/image-names.ts";
import { type Db, prepared, sqlState } from "./db.ts";
import { readInputManifests } from "./input-manifests.ts";
import {
  type ApiToken,
  BUNDLE_CHANNEL,
  type Bundle,
  type BundleEvent,
  type BundleState,
  FINAL_STATES,
  type ImageStoreRef,
  type InputManifest,
  LOG_CHANNEL,
  type LogStream,
  type NewBundle,
  type User,
} from "./types.ts";

// ---------------------------------------------------------------------------------------------------------
// Row mapping

export interface BundleRow {
  uuid: string;
  owner_uuid: string;
  name: string;
  command: string[];
  image: string;
  env: Record<string, string>;
  resources: Bundle["resources"];
  preemptible: boolean;
  priority: number;
  limits: Bundle["limits"];
  dependencies: Bundle["dependencies"];
  allow_failed_dependencies: boolean;
  max_attempts: number;
  attempt: number;
  state: BundleState;
  state_reason: string | null;
  scheduling_status: string | null;
  instance_id: string | null;
  instance_type: string | null;
  gpu_devices: number[];
  exit_code: number | null;
  resource_usage: Record<string, number> | null;
  cost_dollars: number | null;
  price_per_hour?: number | null;
  runner_token_hash: string | null;
  change_seq: number;
  created_at: Date;
  updated_at: Date;
  staged_at: Date | null;
  starting_at: Date | null;
  running_at: Date | null;
  finished_at: Date | null;
  /** Optional only for rows built by hand (the bench); the table always has it. */
  last_heartbeat_at?: Date | null;
  /** JSON from the table (store/migrations/006_locality.sql); checked by readInputManifests. Optional as above. */
  input_manifests?: unknown;
  /** The outputs' manifest digest and bytes (store/migrations/005_cas.sql). Optional as above. */
  output_manifest?: string | null;
  output_bytes?: string | number | null;
  /** The pinned image reference and the store image (store/migrations/007_images.sql). Optional as above. */
  image_pinned?: string | null;
  image_store?: ImageStoreRef | null;
  /** The user's worker running the current attempt (store/migrations/010_workers.sql). Optional as above. */
  worker_id?: string | null;
}

export function bundleFromRow(r: BundleRow): Bundle {
  const b = bundleFields(r);
  // Only bundles with inputs (or bad contents) carry the fields: most have none.
  if (
    r.input_manifests !== undefined &&
    !(Array.isArray(r.input_manifests) && r.input_manifests.length === 0)
  ) {
    const { manifests, problem } = readInputManifests(r.input_manifests);
    if (manifests.length > 0) b.inputManifests = manifests;
    if (problem !== null) b.inputManifestsProblem = problem;
  }
  if (r.output_manifest !== undefined && r.output_manifest !== null) {
    b.outputManifest = r.output_manifest;
    b.outputBytes = Number(r.output_bytes ?? 0);
  }
  if (r.image_pinned !== undefined && r.image_pinned !== null) b.imagePinned = r.image_pinned;
  if (r.image_store !== undefined && r.image_store !== null) b.imageStore = r.image_store;
  if (r.worker_id !== undefined && r.worker_id !== null) b.workerId = r.worker_id;
  return b;
}

function bundleFields(r: BundleRow): Bundle {
  return {
    uuid: r.uuid,
    ownerUuid: r.owner_uuid,
    name: r.name,
    command: r.command,
    image: r.image,
    env: r.env,
    resources: r.resources,
    preemptible: r.preemptible,
    priority: r.priority,
    limits: r.limits,
    dependencies: r.dependencies,
    allowFailedDependencies: r.allow_failed_dependencies,
    maxAttempts: r.max_attempts,
    attempt: r.attempt,
    state: r.state,
    stateReason: r.state_reason,
    schedulingStatus: r.scheduling_status,
    instanceId: r.instance_id,
    instanceType: r.instance_type,
    gpuDevices: r.gpu_devices,
    exitCode: r.exit_code,
    resourceUsage: r.resource_usage,
    costDollars: r.cost_dollars,
    pricePerHour: r.price_per_hour ?? null,
    changeSeq: Number(r.change_seq),
    createdAt: r.created_at,
    updatedAt: r.updated_at,
    stagedAt: r.staged_at,
    startingAt: r.starting_at,
    runningAt: r.running_at,
    finishedAt: r.finished_at,
    lastHeartbeatAt: r.last_heartbeat_at ?? null,
  };
}

/**
 * The request a stored bundle was made from, with its pinned image (a retry runs the same image): the one place
 * that knows which of a Bundle's fields make a NewBundle. `Required` makes a field added to NewBundle, optional
 * or not, a compile error here until it is copied.
 */
export function newBundleOf(b: Bundle): NewBundle {
  const request: Required<NewBundle> = {
    ownerUuid: b.ownerUuid,
    name: b.name,
    command: b.command,
    image: b.image,
    env: b.env,
    resources: b.resources,
    preemptible: b.preemptible,
    priority: b.priority,
    limits: b.limits,
    dependencies: b.dependencies,
    allowFailedDependencies: b.allowFailedDependencies,
    maxAttempts: b.maxAttempts,
    imagePinned: b.imagePinned ?? null,
    imageStore: b.imageStore ?? null,
  };
  return request;
}

interface UserRow {
  uuid: string;
  name: string;
  is_admin: boolean;
  created_at: Date;
}

const userFromRow = (r: UserRow): User => ({
  uuid: r.uuid,
  name: r.name,
  isAdmin: r.is_admin,
  createdAt: r.created_at,
});

export interface EventRow {
  id: number;
  bundle_uuid: string;
  from_state: BundleState | null;
  to_state: BundleState;
  attempt: number;
  reason: string | null;
  actor: string;
  created_at: Date;
}

export const eventFromRow = (r: EventRow): BundleEvent => ({
  id: Number(r.id),
  bundleUuid: r.bundle_uuid,
  fromState: r.from_state,
  toState: r.to_state,
  attempt: r.attempt,
  reason: r.reason,
  actor: r.actor,
  createdAt: r.created_at,
});

// ---------------------------------------------------------------------------------------------------------
// Users

export async function createUser(
  db: Db,
  args: { uuid: string; name: string; isAdmin: boolean; tokenHash: string },
): Promise<User> {
  // The user and its first API token (see createToken), in one statement.
  try {
    const { rows } = await db.query<UserRow>(
      `WITH u AS (
         INSERT INTO users (uuid, name, is_admin) VALUES ($1, $2, $3) RETURNING uuid, name, is_admin, created_at
       ), t AS (
         INSERT INTO api_tokens (id, user_uuid, token_hash, created_at)
         SELECT ${NEW_TOKEN_ID("u.uuid")}, u.uuid, $4, u.created_at FROM u
       )
       SELECT * FROM u`,
      [args.uuid, args.name, args.isAdmin, args.tokenHash],
    );
    return userFromRow(rows[0]!);
  } catch (err) {
    if (sqlState(err) === "23505" && (err as { constraint?: string }).constraint === "users_name_key") {
      throw new DispatchCloudError(
        "user.exists",
        `a user named ${JSON.stringify(args.name)} already exists`,
        {
          path: "name",
          cause: err,
        },
      );
    }
    throw err;
  }
}

export async function getUser(db: Db, uuid: string): Promise<User | null> {
  const { rows } = await db.query<UserRow>(
    "SELECT uuid, name, is_admin, created_at FROM users WHERE uuid = $1",
    [uuid],
  );
  return rows[0] ? userFromRow(rows[0]) : null;
}

/**
 * Locks a user's row until the transaction ends (FOR NO KEY UPDATE: bundle inserts referencing the user are not
 * blocked), so checks of that user's counts and the writes after them are not interleaved with another request's.
 * Returns the user, or null when there is none. Only inside a transaction.
 */
export async function lockUser(tx: Db, uuid: string): Promise<User | null> {
  const { rows } = await tx.query<UserRow>(
    "SELECT uuid, name, is_admin, created_at FROM users WHERE uuid = $1 FOR NO KEY UPDATE",
    [uuid],
  );
  return rows[0] ? userFromRow(rows[0]) : null;
}

export async function countUsers(db: Db): Promise<number> {
  const { rows } = await db.query<{ n: number }>("SELECT count(*)::int AS n FROM users");
  return rows[0]!.n;
}

// ---------------------------------------------------------------------------------------------------------
// API tokens

/** SQL for a new token id of the user whose uuid is the expression `userUuid`: `<cluster>-tokn-<15 hex>`. */
const NEW_TOKEN_ID = (userUuid: string) =>
  `split_part(${userUuid}, '-', 1) || '-tokn-' || substr(md5(gen_random_uuid()::text), 1, 15)`;

interface TokenRow {
  id: string;
  user_uuid: string;
  label: string;
  created_at: Date;
  expires_at: Date | null;
  last_used_at: Date | null;
  revoked_at: Date | null;
}

const TOKEN_COLUMNS = "id, user_uuid, label, created_at, expires_at, last_used_at, revoked_at";

const tokenFromRow = (r: TokenRow): ApiToken => ({
  id: r.id,
  userUuid: r.user_uuid,
  label: r.label,
  createdAt: r.created_at,
  expiresAt: r.expires_at,
  lastUsedAt: r.last_used_at,
  revokedAt: r.revoked_at,
});

/** A further API token of a user (its id made here); expiresAt null: never expires. */
export async function createToken(
  db: Db,
  args: { userUuid: string; tokenHash: string; label: string; expiresAt: Date | null; now: Date },
): Promise<ApiToken> {
  const { rows } = await db.query<TokenRow>(
    `INSERT INTO api_tokens (id, user_uuid, token_hash, label, expires_at, created_at)
     VALUES (${NEW_TOKEN_ID("$1::text")}, $1, $2, $3, $4, date_trunc('milliseconds', $5::timestamptz))
     RETURNING ${TOKEN_COLUMNS}`,
    [args.userUuid, args.tokenHash, args.label, args.expiresAt, args.now],
  );
  return tokenFromRow(rows[0]!);
}

/** The user and token a token hash belongs to, while the token is neither revoked nor expired at `now`. */
export async function findLiveToken(
  db: Db,
  hash: string,
  now: Date,
): Promise<{ user: User; token: ApiToken } | null> {
  const { rows } = await db.query<TokenRow & { name: string; is_admin: boolean; user_created_at: Date }>(
    `SELECT t.id, t.user_uuid, t.label, t.created_at, t.expires_at, t.last_used_at, t.revoked_at,
       u.name, u.is_admin, u.created_at AS user_created_at
     FROM api_tokens t JOIN users u ON u.uuid = t.user_uuid
     WHERE t.token_hash = $1 AND t.revoked_at IS NULL AND (t.expires_at IS NULL OR t.expires_at > $2)`,
    [hash, now],
  );
  const r = rows[0];
  if (r === undefined) return null;
  return {
    user: userFromRow({
      uuid: r.user_uuid,
      name: r.name,
      is_admin: r.is_admin,
      created_at: r.user_created_at,
    }),
    token: tokenFromRow(r),
  };
}

/** Records that a token was used at `now`, unless it was already recorded less than minIntervalMs before. */
export async function touchToken(db: Db, id: string, now: Date, minIntervalMs: number): Promise<boolean> {
  const { rowCount } = await db.query(
    `UPDATE api_tokens SET last_used_at = date_trunc('milliseconds', $2::timestamptz)
     WHERE id = $1 AND (last_used_at IS NULL
       OR last_used_at < $2::timestamptz - $3::double precision * interval '1 millisecond')`,
    [id, now, minIntervalMs],
  );
  return rowCount > 0;
}

/** A user's tokens that are not revoked (expired ones included), oldest first. */
export async function listTokens(db: Db, userUuid: string): Promise<ApiToken[]> {
  const { rows } = await db.query<TokenRow>(
    `SELECT ${TOKEN_COLUMNS} FROM api_tokens WHERE user_uuid = $1 AND revoked_at IS NULL ORDER BY created_at, id`,
    [userUuid],
  );
  return rows.map(tokenFromRow);
}

/** How many tokens of a user are not revoked (expired ones included). */
export async function countTokens(db: Db, userUuid: string): Promise<number> {
  const { rows } = await db.query<{ n: number }>(
    "SELECT count(*)::int AS n FROM api_tokens WHERE user_uuid = $1 AND revoked_at IS NULL",
    [userUuid],
  );
  return rows[0]!.n;
}

/**
 * Revokes token `id` at `now` if it is not revoked yet and, when ownerUuid is given, belongs to that user. Returns
 * the revoked token, or null (no such token, another user's, or already revoked).
 */
export async function revokeToken(
  db: Db,
  args: { id: string; ownerUuid: string | null; now: Date },
): Promise<ApiToken | null> {
  const { rows } = await db.query<TokenRow>(
    `UPDATE api_tokens SET revoked_at = date_trunc('milliseconds', $3::timestamptz)
     WHERE id = $1 AND revoked_at IS NULL AND ($2::text IS NULL OR user_uuid = $2::text)
     RETURNING ${TOKEN_COLUMNS}`,
    [args.id, args.ownerUuid, args.now],
  );
  return rows[0] ? tokenFromRow(rows[0]) : null;
}

// ---------------------------------------------------------------------------------------------------------
// Per-user submission limits

export interface SubmitBucket {
  tokens: number;
  refilledAt: Date;
}

/**
 * Locks the user's quota row until the transaction ends (creating it, with a full bucket of `burst` tokens, on
 * the user's first submission) and returns its token bucket as stored. Parallel submissions of one user wait
 * here for each other, so what they count afterwards includes what the earlier ones inserted.
 */
export async function lockSubmitBucket(
  tx: Db,
  args: { userUuid: string; burst: number; now: Date },
): Promise<SubmitBucket> {
  const { rows } = await tx.query<{ submit_tokens: number; submit_refilled_at: Date }>(
    `INSERT INTO user_quotas AS q (user_uuid, submit_tokens, submit_refilled_at) VALUES ($1, $2, $3)
     ON CONFLICT (user_uuid) DO UPDATE SET user_uuid = q.user_uuid
     RETURNING submit_tokens, submit_refilled_at`,
    [args.userUuid, args.burst, args.now],
  );
  const r = rows[0]!;
  return { tokens: Number(r.submit_tokens), refilledAt: r.submit_refilled_at };
}

export async function saveSubmitBucket(db: Db, userUuid: string, bucket: SubmitBucket): Promise<void> {
  await db.query("UPDATE user_quotas SET submit_tokens = $2, submit_refilled_at = $3 WHERE user_uuid = $1", [
    userUuid,
    bucket.tokens,
    bucket.refilledAt,
  ]);
}

/**
 * How many non-final bundles the user has, counting at most `upTo` (through the partial index
 * bundles_owner_active: the user's final bundles are never read).
 */
export async function countActiveBundles(db: Db, ownerUuid: string, upTo: number): Promise<number> {
  const { rows } = await db.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM (
       SELECT 1 FROM bundles WHERE owner_uuid = $1 AND state IN ('created', 'staged', 'starting', 'running')
       LIMIT $2) AS active`,
    [ownerUuid, upTo],
  );
  return rows[0]!.n;
}

// ---------------------------------------------------------------------------------------------------------
// Bundles

/**
 * The owner's image in the store that a bundle's `image` names (store/migrations/007_images.sql; docs/images.md
 * "Pinning"), as a subquery of the insert statements: by name (`key`, the normalised name) or by image id; its
 * id and `{manifest, imageId, bytes}`. Resolved in the insert itself, so pinning costs a submission no query.
 */
const OWN_IMAGE = (owner: string, image: string, key: string) => `
  SELECT i.image_id, jsonb_build_object('manifest', i.manifest, 'imageId', i.image_id, 'bytes', i.bytes) AS store
  FROM images i WHERE i.owner_uuid = ${owner} AND (i.name = ${key} OR i.image_id = ${image})
  ORDER BY (i.name = ${key}) IS TRUE DESC, i.created_at DESC LIMIT 1`;

/** SQL for "now" as every timestamp column holds it (milliseconds, as JSON gives them back). */
export const NOW = "date_trunc('milliseconds', now())";

/**
 * How a new bundle starts: `created` always; `submitted` is a user's submission, which a bundle without
 * dependencies passes at once: it is inserted `staged` (every one of its zero dependencies is ready), with both
 * events, so the queue learns of it from its insert and not after a bundle manager pass (docs/decisions.md).
 */
export type InitialState = "created" | "submitted";

/** SQL: the input tree of a bundle whose image is from the store (`store`: its image_store), as input_manifests. */
export const imageStoreInputSql = (store: string) =>
  `CASE WHEN jsonb_typeof(${store}) = 'object' THEN jsonb_build_array(jsonb_build_object(
     'digest', ${store}->'manifest', 'bytes', ${store}->'bytes')) ELSE '[]'::jsonb END`;

/**
 * SQL: the events of the new rows of CTE `b`: `created` by `actor`, then `created -> staged` by the REST server
 * for those inserted staged. Ordered so that each bundle's `created` event comes first.
 */
const NEW_BUNDLE_EVENTS = (actor: string) => `
  INSERT INTO bundle_events (bundle_uuid, from_state, to_state, attempt, reason, actor)
  SELECT b.uuid, v.from_state, v.to_state, b.attempt, NULL, coalesce(v.actor, ${actor})
  FROM b CROSS JOIN LATERAL (VALUES (1, NULL::text, 'created', NULL::text), (2, 'created', 'staged', 'rest-server'))
    AS v(step, from_state, to_state, actor)
  WHERE v.step = 1 OR b.state = 'staged'
  ORDER BY b.uuid, v.step`;

/**
 * Inserts a bundle, its dependency rows and its events, and notifies, in one transaction: `created`, or
 * `staged` for a submission without dependencies (InitialState). Every dependency must be a bundle of the same
 * owner.
 */
export async function insertBundle(
  db: Db,
  uuid: string,
  b: NewBundle,
  initialState: InitialState,
): Promise<Bundle> {
  // Without dependencies the insert is one statement, atomic on its own: no BEGIN/COMMIT round trips.
  if (b.dependencies.length === 0) return insertBundleRow(db, uuid, b, initialState);
  return db.transaction(async (tx) => {
    const depUuids = b.dependencies.map((d) => d.bundle);
    if (depUuids.length > 0) {
      const { rows } = await tx.query<{ uuid: string }>(
        "SELECT uuid FROM bundles WHERE uuid = ANY($1::text[]) AND owner_uuid = $2",
        [depUuids, b.ownerUuid],
      );
      const found = new Set(rows.map((r) => r.uuid));
      const i = depUuids.findIndex((u) => !found.has(u));
      if (i >= 0) {
        throw new DispatchCloudError(
          "bundle.invalid_dependency",
          `dependency ${JSON.stringify(depUuids[i])} is not one of your bundles`,
          { path: `dependencies[${i}].bundle` },
        );
      }
    }
    return insertBundleRow(tx, uuid, b, initialState);
  });
}

/** The one statement of insertBundle: the row, its dependency rows, its events and its NOTIFY. */
async function insertBundleRow(
  db: Db,
  uuid: string,
  b: NewBundle,
  initialState: InitialState,
): Promise<Bundle> {
  const state = initialState === "submitted" && b.dependencies.length === 0 ? "staged" : "created";
  const store = "coalesce((SELECT store FROM img), $18::jsonb)";
  const { rows } = await db.query<BundleRow>(
    prepared(`WITH img AS (${OWN_IMAGE("$2", "$5", "$19")}), b AS (
       INSERT INTO bundles (uuid, owner_uuid, name, command, image, env, resources, preemptible, priority,
         limits, dependencies, allow_failed_dependencies, max_attempts, state, image_pinned, image_store,
         staged_at, input_manifests)
       VALUES ($1, $2, $3, $4::jsonb, $5, $6::jsonb, $7::jsonb, $8, $9, $10::jsonb, $11::jsonb, $12, $13, $14,
         coalesce((SELECT image_id FROM img), $17), ${store},
         CASE WHEN $14 = 'staged' THEN ${NOW} END,
         CASE WHEN $14 = 'staged' THEN ${imageStoreInputSql(store)} ELSE '[]'::jsonb END)
       RETURNING *
     ), d AS (
       INSERT INTO bundle_dependencies (bundle_uuid, ordinal, dependency_uuid, subpath, name)
       SELECT b.uuid, x.ord, x.dep->>'bundle', x.dep->>'subpath', x.dep->>'name'
       FROM b, jsonb_array_elements($11::jsonb) WITH ORDINALITY AS x(dep, ord)
     ), e AS (${NEW_BUNDLE_EVENTS("$15")}
     ), n AS (
       SELECT pg_notify($16, b.uuid || ' ' || b.state || ' ' || b.change_seq) FROM b
     )
     SELECT b.* FROM b WHERE (SELECT count(*) FROM n) >= 0`),
    [
      uuid,
      b.ownerUuid,
      b.name,
      JSON.stringify(b.command),
      b.image,
      JSON.stringify(b.env),
      JSON.stringify(b.resources),
      b.preemptible,
      b.priority,
      JSON.stringify(b.limits),
      JSON.stringify(b.dependencies),
      b.allowFailedDependencies,
      b.maxAttempts,
      state,
      `user:${b.ownerUuid}`,
      BUNDLE_CHANNEL,
      b.imagePinned ?? null,
      b.imageStore == null ? null : JSON.stringify(b.imageStore),
      imageKey(b.image),
    ],
  );
  return bundleFromRow(rows[0]!);
}

/**
 * A tree a user uploaded to the content-addressed store, kept as a bundle that is `ready` from the start with the
 * tree as its outputs (as CodaLab keeps uploads): other bundles name it as a dependency like any bundle. It has no
 * command, image or attempts; its event says it was uploaded.
 */
export async function insertUploadedBundle(
  db: Db,
  uuid: string,
  u: { ownerUuid: string; name: string; manifest: string; bytes: number },
): Promise<Bundle> {
  const { rows } = await db.query<BundleRow>(
    `WITH b AS (
       INSERT INTO bundles (uuid, owner_uuid, name, command, image, env, resources, preemptible, priority,
         limits, dependencies, allow_failed_dependencies, max_attempts, state, state_reason, finished_at,
         output_manifest, output_bytes)
       VALUES ($1, $2, $3, '[]'::jsonb, '', '{}'::jsonb, $4::jsonb, false, 0, $5::jsonb, '[]'::jsonb, false, 1,
         'ready', 'uploaded', ${NOW}, $6, $7)
       RETURNING *
     ), e AS (
       INSERT INTO bundle_events (bundle_uuid, from_state, to_state, attempt, reason, actor)
       SELECT uuid, NULL, state, attempt, state_reason, $8 FROM b
     )
     SELECT b.* FROM b`,
    [
      uuid,
      u.ownerUuid,
      u.name,
      JSON.stringify({ vcpus: 0, ram: 0, scratch: 0, gpu: null }),
      JSON.stringify({ time: null, disk: null, network: false }),
      u.manifest,
      u.bytes,
      `user:${u.ownerUuid}`,
    ],
  );
  return bundleFromRow(rows[0]!);
}

/** Rows per INSERT statement of insertBundles: one jsonb parameter of about 0.5 MB. */
const INSERT_CHUNK = 1000;

/**
 * Inserts many bundles of one owner, all or nothing, in one transaction: multi-row statements of INSERT_CHUNK
 * rows (bundles, their dependency rows, their events), one dependency check for the whole batch, and one NOTIFY
 * (`* created <n>`, or `* staged <n>` when every one was staged) for all of them, so listeners wake once. Each
 * starts as `initialState` says (InitialState). Returns the bundles in the order given. A bad dependency names
 * its item: `items[3].dependencies[0].bundle`.
 */
export async function insertBundles(
  db: Db,
  ownerUuid: string,
  items: readonly { uuid: string; bundle: NewBundle }[],
  initialState: InitialState,
): Promise<Bundle[]>;
/** As above, answering each bundle's uuid and state only (no whole rows to send back and parse). */
export async function insertBundles(
  db: Db,
  ownerUuid: string,
  items: readonly { uuid: string; bundle: NewBundle }[],
  initialState: InitialState,
  answer: "brief",
): Promise<BriefBundle[]>;
export async function insertBundles(
  db: Db,
  ownerUuid: string,
  items: readonly { uuid: string; bundle: NewBundle }[],
  initialState: InitialState,
  answer: "whole" | "brief" = "whole",
): Promise<(Bundle | BriefBundle)[]> {
  if (items.length === 0) return [];
  // One chunk with no dependency to check is one statement, the NOTIFY in it: one round trip where the
  // transaction below takes four (BEGIN, the insert, the NOTIFY, COMMIT), which a burst's first start waits for.
  if (items.length <= INSERT_CHUNK && items.every((it) => it.bundle.dependencies.length === 0)) {
    const rows =
      answer === "brief"
        ? await insertBriefRows(db, items, initialState, true)
        : await insertBundleRows(db, items, true, initialState);
    return inOrder(items, rows);
  }
  return db.transaction(async (tx) => {
    const depUuids = [...new Set(items.flatMap((it) => it.bundle.dependencies.map((d) => d.bundle)))];
    if (depUuids.length > 0) {
      const { rows } = await tx.query<{ uuid: string }>(
        "SELECT uuid FROM bundles WHERE uuid = ANY($1::text[]) AND owner_uuid = $2",
        [depUuids, ownerUuid],
      );
      const found = new Set(rows.map((r) => r.uuid));
      items.forEach((it, i) => {
        const j = it.bundle.dependencies.findIndex((d) => !found.has(d.bundle));
        if (j < 0) return;
        throw new DispatchCloudError(
          "bundle.invalid_dependency",
          `dependency ${JSON.stringify(it.bundle.dependencies[j]!.bundle)} is not one of your bundles`,
          { path: `items[${i}].dependencies[${j}].bundle` },
        );
      });
    }
    const rows: (Bundle | BriefBundle)[] = [];
    for (let start = 0; start < items.length; start += INSERT_CHUNK) {
      const chunk = items.slice(start, start + INSERT_CHUNK);
      rows.push(
        ...(answer === "brief"
          ? await insertBriefRows(tx, chunk, initialState, false)
          : await insertBundleRows(tx, chunk, false, initialState)),
      );
    }
    const state = rows.some((b) => b.state === "created") ? "created" : "staged";
    await tx.query("SELECT pg_notify($1, $2)", [BUNDLE_CHANNEL, `* ${state} ${items.length}`]);
    return inOrder(items, rows);
  });
}

/** `rows` (an INSERT's RETURNING, in no promised order) in the order of `items`; each item must have its row. */
export function inOrder<T extends { uuid: string }>(
  items: readonly { uuid: string }[],
  rows: readonly T[],
): T[] {
  const byUuid = new Map(rows.map((b) => [b.uuid, b]));
  return items.map((it) => {
    const b = byUuid.get(it.uuid);
    if (b === undefined) throw new Error(`bundle ${it.uuid} was not returned by its insert`);
    return b;
  });
}

/**
 * One multi-row statement inserting bundles without dependency checks (each row's owner is its bundle's; the
 * caller checked dependencies, or there are none): the rows, their dependency rows and events, and with
 * `notify` one NOTIFY `* created <n>` (`* staged <n>` when none stayed created) for them all. Each starts as
 * `initialState` says (InitialState). Atomic on its own, so it needs no transaction. Returns the rows in no
 * particular order.
 */
export async function insertBundleRows(
  db: Db,
  items: readonly { uuid: string; bundle: NewBundle }[],
  notify: boolean,
  initialState: InitialState,
): Promise<Bundle[]> {
  if (items.length === 0) return [];
  const { rows } = await db.query<BundleRow>(
    INSERT_ROWS_WHOLE,
    insertRowsParams(items, notify, initialState),
  );
  return rows.map(bundleFromRow);
}

/** A new bundle as a brief answer names it (insertBundles with "brief"). */
export interface BriefBundle {
  uuid: string;
  state: BundleState;
}

/** insertBundleRows answering each row's uuid and state only. */
async function insertBriefRows(
  db: Db,
  items: readonly { uuid: string; bundle: NewBundle }[],
  initialState: InitialState,
  notify: boolean,
): Promise<BriefBundle[]> {
  const { rows } = await db.query<BriefBundle>(
    INSERT_ROWS_BRIEF,
    insertRowsParams(items, notify, initialState),
  );
  return rows;
}

function insertRowsParams(
  items: readonly { uuid: string; bundle: NewBundle }[],
  notify: boolean,
  initialState: InitialState,
): unknown[] {
  const rows = items.map(({ uuid, bundle: b }) => ({
    uuid,
    owner_uuid: b.ownerUuid,
    name: b.name,
    command: b.command,
    image: b.image,
    env: b.env,
    resources: b.resources,
    preemptible: b.preemptible,
    priority: b.priority,
    limits: b.limits,
    dependencies: b.dependencies,
    allow_failed_dependencies: b.allowFailedDependencies,
    max_attempts: b.maxAttempts,
    image_pinned: b.imagePinned ?? null,
    image_store: b.imageStore ?? null,
    image_key: imageKey(b.image),
  }));
  return [JSON.stringify(rows), BUNDLE_CHANNEL, notify, initialState === "submitted"];
}

/**
 * The statement of insertBundleRows, answering `answer` (columns of the new rows `b`). Prepared (store/db.ts):
 * parsing and planning it cost more than running it for a few rows.
 */
const insertRowsSql = (answer: string) =>
  prepared(`WITH src AS (
       SELECT r.*, coalesce(img.image_id, r.image_pinned) AS pinned,
         coalesce(img.store, CASE WHEN jsonb_typeof(r.image_store) = 'object' THEN r.image_store END) AS store,
         CASE WHEN $4::boolean AND r.dependencies = '[]'::jsonb THEN 'staged' ELSE 'created' END AS state
       FROM jsonb_to_recordset($1::jsonb) AS r(uuid text, owner_uuid text, name text, command jsonb,
         image text, env jsonb, resources jsonb, preemptible boolean, priority int, limits jsonb,
         dependencies jsonb, allow_failed_dependencies boolean, max_attempts int, image_pinned text,
         image_store jsonb, image_key text)
       LEFT JOIN LATERAL (${OWN_IMAGE("r.owner_uuid", "r.image", "r.image_key")}) img ON true
     ), b AS (
       INSERT INTO bundles (uuid, owner_uuid, name, command, image, env, resources, preemptible, priority,
         limits, dependencies, allow_failed_dependencies, max_attempts, state, image_pinned, image_store,
         staged_at, input_manifests)
       SELECT r.uuid, r.owner_uuid, r.name, r.command, r.image, r.env, r.resources, r.preemptible, r.priority,
         r.limits, r.dependencies, r.allow_failed_dependencies, r.max_attempts, r.state, r.pinned, r.store,
         CASE WHEN r.state = 'staged' THEN ${NOW} END,
         CASE WHEN r.state = 'staged' THEN ${imageStoreInputSql("r.store")} ELSE '[]'::jsonb END
       FROM src r
       RETURNING *
     ), d AS (
       INSERT INTO bundle_dependencies (bundle_uuid, ordinal, dependency_uuid, subpath, name)
       SELECT b.uuid, x.ord, x.dep->>'bundle', x.dep->>'subpath', x.dep->>'name'
       FROM b, jsonb_array_elements(b.dependencies) WITH ORDINALITY AS x(dep, ord)
     ), e AS (${NEW_BUNDLE_EVENTS("'user:' || b.owner_uuid")}
     ), n AS (
       SELECT pg_notify($2, '* ' || CASE WHEN bool_or(b.state = 'created') THEN 'created' ELSE 'staged' END
         || ' ' || count(*)) FROM b HAVING $3::boolean AND count(*) > 0
     )
     SELECT ${answer} FROM b WHERE (SELECT count(*) FROM n) >= 0`);
const INSERT_ROWS_WHOLE = insertRowsSql("b.*");
const INSERT_ROWS_BRIEF = insertRowsSql("b.uuid, b.state");

export async function getBundle(db: Db, uuid: string): Promise<Bundle | null> {
  const { rows } = await db.query<BundleRow>(prepared("SELECT * FROM bundles WHERE uuid = $1"), [uuid]);
  return rows[0] ? bundleFromRow(rows[0]) : null;
}

export async function getBundleForOwner(db: Db, uuid: string, ownerUuid: string): Promise<Bundle | null> {
  const { rows } = await db.query<BundleRow>("SELECT * FROM bundles WHERE uuid = $1 AND owner_uuid = $2", [
    uuid,
    ownerUuid,
  ]);
  return rows[0] ? bundleFromRow(rows[0]) : null;
}

/** One page of an owner's bundles, newest first; pass the last row's (createdAt, uuid) as `after` for the next. */
export async function listBundles(db: Db, args: ListBundlesArgs): Promise<Bundle[]> {
  const { sql, params } = listBundlesQuery(args);
  const { rows } = await db.query<BundleRow>(sql, params);
  return rows.map(bundleFromRow);
}

export interface ListBundlesArgs {
  ownerUuid: string;
  states?: BundleState[];
  after?: { createdAt: Date; uuid: string } | null;
  limit: number;
}

/**
 * listBundles' statement. Not prepared: with its states as values, the planner can take a partial index of
 * them (bundles_owner_active, bundles_owner_unsuccessful) instead of the owner's whole history.
 */
export function listBundlesQuery(args: ListBundlesArgs): { sql: string; params: unknown[] } {
  const params: unknown[] = [args.ownerUuid];
  let where = "owner_uuid = $1";
  if (args.states !== undefined) {
    params.push(args.states);
    where += ` AND state = ANY($${params.length}::text[])`;
  }
  if (args.after) {
    params.push(args.after.createdAt, args.after.uuid);
    where += ` AND (created_at, uuid) < ($${params.length - 1}::timestamptz, $${params.length}::text)`;
  }
  params.push(args.limit);
  return {
    sql: `SELECT * FROM bundles WHERE ${where} ORDER BY created_at DESC, uuid DESC LIMIT $${params.length}`,
    params,
  };
}

export async function listEvents(db: Db, uuid: string): Promise<BundleEvent[]> {
  const { rows } = await db.query<EventRow>(
    "SELECT * FROM bundle_events WHERE bundle_uuid = $1 ORDER BY id",
    [uuid],
  );
  return rows.map(eventFromRow);
}

export async function maxChangeSeq(db: Db): Promise<number> {
  const { rows } = await db.query<{ seq: number }>(
    "SELECT coalesce(max(change_seq), 0)::bigint AS seq FROM bundles",
  );
  return Number(rows[0]!.seq);
}

/** Whether any bundle is `created` (the partial index of migration 011): the bundle manager's pass is cheap then. */
export async function anyCreatedBundles(db: Db): Promise<boolean> {
  const { rows } = await db.query<{ any: boolean }>(
    "SELECT EXISTS (SELECT 1 FROM bundles WHERE state = 'created') AS any",
  );
  return rows[0]?.any === true;
}

/**
 * Created bundles the bundle manager can decide on now — every dependency final, or at least one failed or
 * killed — with their dependencies' states, oldest first.
 */
export async function createdBundlesReady(
  db: Db,
  limit: number,
  /** Keyset paging: only bundles after this one in (created_at, uuid) order. */
  after: { createdAt: Date; uuid: string } | null = null,
): Promise<{ bundle: Bundle; dependencyStates: { uuid: string; state: BundleState }[] }[]> {
  const { rows } = await db.query<BundleRow & { dependency_states: { uuid: string; state: BundleState }[] }>(
    // A bundle without dependencies (most of them) skips the per-row lookups: CASE evaluates lazily.
    `SELECT b.*, CASE WHEN b.dependencies = '[]'::jsonb THEN '[]'::jsonb ELSE coalesce((
         SELECT jsonb_agg(jsonb_build_object('uuid', d.uuid, 'state', d.state) ORDER BY bd.ordinal)
         FROM bundle_dependencies bd JOIN bundles d ON d.uuid = bd.dependency_uuid
         WHERE bd.bundle_uuid = b.uuid), '[]'::jsonb) END AS dependency_states
     FROM bundles b
     WHERE b.state = 'created'
       AND ($3::timestamptz IS NULL OR (b.created_at, b.uuid) > ($3::timestamptz, $4::text))
       AND (b.dependencies = '[]'::jsonb OR NOT EXISTS (
              SELECT 1 FROM bundle_dependencies bd JOIN bundles d ON d.uuid = bd.dependency_uuid
              WHERE bd.bundle_uuid = b.uuid AND NOT (d.state = ANY($2::text[])))
         OR EXISTS (
              SELECT 1 FROM bundle_dependencies bd JOIN bundles d ON d.uuid = bd.dependency_uuid
              WHERE bd.bundle_uuid = b.uuid AND d.state IN ('failed', 'killed')))
     ORDER BY b.created_at, b.uuid
     LIMIT $1`,
    [limit, FINAL_STATES, after?.createdAt ?? null, after?.uuid ?? null],
  );
  return rows.map((r) => ({ bundle: bundleFromRow(r), dependencyStates: r.dependency_states }));
}

/** uuids of created bundles that depend on `uuid`. */
export async function dependentsOf(db: Db, uuid: string): Promise<string[]> {
  const { rows } = await db.query<{ uuid: string }>(
    `SELECT DISTINCT bd.bundle_uuid AS uuid
     FROM bundle_dependencies bd JOIN bundles b ON b.uuid = bd.bundle_uuid
     WHERE bd.dependency_uuid = $1 AND b.state = 'created'
     ORDER BY 1`,
    [uuid],
  );
  return rows.map((r) => r.uuid);
}

export async function findBundleByRunnerTokenHash(db: Db, hash: string): Promise<Bundle | null> {
  const { rows } = await db.query<BundleRow>(prepared("SELECT * FROM bundles WHERE runner_token_hash = $1"), [
    hash,
  ]);
  return rows[0] ? bundleFromRow(rows[0]) : null;
}

/**
 * SQL: an UPDATE (`set`) of the one bundle `key` finds, a condition on a unique key (uuid, runner_token_hash),
 * made only while the bundle is in one of `states` (and `extra` holds). The row is found and locked by the key
 * alone and the state tested on the row held, as every transition does (KEYED_LOCKS, store/transitions.ts): a
 * state test where the row is found would let a stale estimate of how many bundles are in those states make
 * PostgreSQL read all of them. In `set`, `extra` and `returning` the bundle is `b`.
 */
export function keyedUpdate(
  key: string,
  states: readonly BundleState[],
  set: string,
  opts: { extra?: string; returning?: string } = {},
): string {
  return `WITH cur AS (SELECT uuid, state FROM bundles WHERE ${key} FOR NO KEY UPDATE)
     UPDATE bundles b SET ${set} FROM cur
     WHERE b.uuid = cur.uuid AND cur.state IN (${states.map((st) => `'${st}'`).join(", ")})${
       opts.extra === undefined ? "" : ` AND ${opts.extra}`
     }${opts.returning === undefined ? "" : ` RETURNING ${opts.returning}`}`;
}

/**
 * Sets the scheduler's human-readable status of a bundle (no event, no NOTIFY; bumps change_seq). Writes only
 * when the status changes; returns whether it did.
 */
export async function setSchedulingStatus(db: Db, uuid: string, status: string | null): Promise<boolean> {
  // Only a queued bundle has a scheduling status: a sentence computed just before the bundle started (whose
  // transition cleared it) must not land afterwards.
  const { rowCount } = await db.query(
    keyedUpdate("uuid = $1", ["created", "staged"], "scheduling_status = $2::text", {
      extra: "b.scheduling_status IS DISTINCT FROM $2::text",
    }),
    [uuid, status],
  );
  return rowCount > 0;
}

/**
 * setSchedulingStatus for many bundles in one statement (uuids[i] gets statuses[i]), with the same rules: only
 * queued bundles, only when the status changes. Returns how many rows changed.
 */
export async function setSchedulingStatuses(
  db: Db,
  uuids: readonly string[],
  statuses: readonly string[],
): Promise<number> {
  if (uuids.length !== statuses.length)
    throw new Error("setSchedulingStatuses: uuids and statuses differ in length");
  if (uuids.length === 0) return 0;
  // The rows are found and locked by key, the state checked on the locked row: a state test where they are
  // found would let a stale estimate of the queue's size read every queued row (KEYED_LOCKS, store/transitions.ts).
  const { rowCount } = await db.query(
    `WITH cur AS (
       SELECT b.uuid, b.state, w.status FROM bundles b JOIN unnest($1::text[], $2::text[]) AS w(uuid, status)
         ON w.uuid = b.uuid
       ORDER BY b.uuid FOR UPDATE OF b
     )
     UPDATE bundles b SET scheduling_status = cur.status FROM cur
     WHERE b.uuid = cur.uuid AND cur.state IN ('created', 'staged') AND b.scheduling_status IS DISTINCT FROM cur.status`,
    [uuids, statuses],
  );
  return rowCount;
}

/**
 * Records a bundle's input manifests (docs/storage.md "Locality"; the REST server calls it when the bundle
 * becomes staged). Only a queued bundle's (created or staged); bumps change_seq, so the dispatcher's queue reads
 * the row again. Returns whether the row changed.
 */
export async function setBundleInputManifests(
  db: Db,
  uuid: string,
  manifests: readonly InputManifest[],
): Promise<boolean> {
  const { rowCount } = await db.query(
    keyedUpdate("uuid = $1", ["created", "staged"], "input_manifests = $2::jsonb", {
      extra: "b.input_manifests IS DISTINCT FROM $2::jsonb",
    }),
    [uuid, JSON.stringify(manifests.map((m) => ({ digest: m.digest, bytes: m.bytes })))],
  );
  return rowCount > 0;
}

/** Active bundles (staged, starting, running) with uuid > afterUuid, by uuid (the dispatcher queue's full read). */
export async function activeBundlesPage(db: Db, afterUuid: string, limit: number): Promise<Bundle[]> {
  const { rows } = await db.query<BundleRow>(
    `SELECT * FROM bundles WHERE state IN ('staged', 'starting', 'running') AND uuid > $1
     ORDER BY uuid LIMIT $2`,
    [afterUuid, limit],
  );
  return rows.map(bundleFromRow);
}

/** bigint's largest value: `change_seq > $1` alone is, to a planner without statistics, a third of the table. */
const CHANGE_SEQ_MAX = "9223372036854775807";

/** The text of bundlesChangedAfterOrIn's statement ($1 after, $2 limit, $3 the sequences when withSeqs). */
export function changedAfterOrInSql(withSeqs: boolean): string {
  const above = `change_seq > $1 AND change_seq <= ${CHANGE_SEQ_MAX}`;
  return withSeqs
    ? `SELECT * FROM bundles WHERE (${above}) OR change_seq = ANY($3::bigint[]) ORDER BY change_seq LIMIT $2`
    : `SELECT * FROM bundles WHERE ${above} ORDER BY change_seq LIMIT $2`;
}

/**
 * Bundles whose change_seq is above `after` or one of `seqs` (sequences below it the caller has not read yet),
 * in change order. Both parts are ranges of the change_seq index, so a read costs what it returns, however many
 * rows the caller has already read. The range has an upper bound so that the planner takes the index before
 * the table has statistics (a table filled since the last ANALYZE): `change_seq > $1` alone it estimates at a
 * third of the table and reads by a full scan (4.7 ms at 20,000 rows, against 0.05 ms by the index).
 */
export async function bundlesChangedAfterOrIn(
  db: Db,
  after: number,
  seqs: readonly number[],
  limit: number,
): Promise<Bundle[]> {
  const { rows } = await db.query<BundleRow>(
    changedAfterOrInSql(seqs.length > 0),
    seqs.length === 0 ? [after, limit] : [after, limit, seqs],
  );
  return rows.map(bundleFromRow);
}

/**
 * The change sequence of the newest bundle row last written at least ageMs ago by the database's clock (0 if
 * none): a lower bound below which every writing transaction has long committed.
 */
export async function changeSeqOlderThan(db: Db, ageMs: number): Promise<number> {
  const { rows } = await db.query<{ seq: number }>(
    `SELECT coalesce((SELECT change_seq FROM bundles
       WHERE updated_at < now() - $1::double precision * interval '1 millisecond'
       ORDER BY change_seq DESC LIMIT 1), 0)::bigint AS seq`,
    [ageMs],
  );
  return Number(rows[0]!.seq);
}

// ---------------------------------------------------------------------------------------------------------
// What runners send: heartbeats and log chunks

/**
 * Records a heartbeat of `attempt`: its resource usage (replacing the last one) and the time. Only while that
 * attempt is current and the bundle is starting or running; returns the bundle's state, or null when the
 * guard did not hold. Does not bump change_seq (see migration 002).
 */
export function recordHeartbeat(
  db: Db,
  uuid: string,
  attempt: number,
  resourceUsage: Record<string, number>,
  /** What the runner waits for before the container runs (an image pull), shown as schedulingStatus; null
   * clears it; undefined leaves it. */
  status?: string | null,
): Promise<BundleState | null> {
  return heartbeat(db, "uuid = $1 AND attempt = $2", [uuid, attempt], resourceUsage, status);
}

/**
 * recordHeartbeat() by the runner token's hash, in one statement (no lookup of the token first): the state, or
 * null when no starting or running bundle holds that token (a bad or stale token: the caller looks closer).
 */
export function recordHeartbeatByToken(
  db: Db,
  tokenHash: string,
  resourceUsage: Record<string, number>,
  status?: string | null,
): Promise<BundleState | null> {
  return heartbeat(db, "runner_token_hash = $1", [tokenHash], resourceUsage, status);
}

/** The heartbeat's UPDATE of the bundle `where` (over the parameters `key`) picks: by uuid and attempt, or by token. */
async function heartbeat(
  db: Db,
  where: "uuid = $1 AND attempt = $2" | "runner_token_hash = $1",
  key: readonly unknown[],
  resourceUsage: Record<string, number>,
  status: string | null | undefined,
): Promise<BundleState | null> {
  const [usage, given, text] = [key.length + 1, key.length + 2, key.length + 3];
  const { rows } = await db.query<{ state: BundleState }>(
    prepared(
      keyedUpdate(
        where,
        ["starting", "running"],
        `resource_usage = $${usage}::jsonb, last_heartbeat_at = ${NOW},
         scheduling_status = CASE WHEN $${given}::boolean THEN $${text}::text ELSE b.scheduling_status END`,
        { returning: "b.state" },
      ),
    ),
    [...key, JSON.stringify(resourceUsage), status !== undefined, status ?? null],
  );
  return rows[0]?.state ?? null;
}

export type AppendLogResult =
  | { ok: true; stored: number; truncated?: boolean }
  | { ok: false; reason: "gap"; stored: number }
  | { ok: false; reason: "not_current"; current: { state: BundleState; attempt: number } | null };

/**
 * Stores the chunk `data` of `stream` that starts at byte `offset`, once: bytes the server already has are
 * ignored (a retried or overlapping chunk), only the new tail is written. A chunk starting beyond what is
 * stored is a gap and writes nothing. In one statement (the function append_log_chunk, migration 014) that holds
 * the bundle's row, which must be starting or running in `attempt` (KEY SHARE: a transition out of
 * starting/running waits for it, heartbeats do not), and the stream's advisory lock, so a log follower that sees
 * the bundle final afterwards also sees every chunk; NOTIFYs LOG_CHANNEL when it wrote something.
 *
 * With `maxBytes`, a stream keeps its first maxBytes bytes and then a one-line truncation notice; from then on
 * every chunk is acknowledged (`stored` is the runner's own offset after it, `truncated: true`) and dropped.
 */
export async function appendLogChunk(
  db: Db,
  args: {
    uuid: string;
    attempt: number;
    stream: LogStream;
    offset: number;
    data: Uint8Array;
    maxBytes?: number;
  },
): Promise<AppendLogResult> {
  const { rows } = await db.query<LogChunkRow>(
    prepared(
      "SELECT outcome, state, attempt, stored, truncated FROM append_log_chunk($1, $2, $3, $4, $5, $6, $7)",
    ),
    [args.uuid, args.attempt, ...logChunkParams(args)],
  );
  return logChunkResult(rows[0]);
}

/**
 * appendLogChunk() for the bundle whose runner token hashes to `tokenHash` (append_log_chunk_by_token, migration
 * 016): one statement where a lookup of the token and appendLogChunk() make two. Null when no starting or running
 * bundle holds that token (nothing is written; the caller looks the token up to say why); otherwise the bundle's
 * uuid and attempt, and appendLogChunk()'s result for them.
 */
export async function appendLogChunkByToken(
  db: Db,
  args: { tokenHash: string; stream: LogStream; offset: number; data: Uint8Array; maxBytes?: number },
): Promise<{ bundle: { uuid: string; attempt: number }; result: AppendLogResult } | null> {
  const { rows } = await db.query<LogChunkRow & { bundle_uuid: string | null }>(
    prepared(
      "SELECT outcome, bundle_uuid, state, attempt, stored, truncated FROM append_log_chunk_by_token($1, $2, $3, $4, $5, $6)",
    ),
    [args.tokenHash, ...logChunkParams(args)],
  );
  const r = rows[0];
  if (r === undefined) throw new Error("append_log_chunk_by_token returned no row");
  if (r.outcome === "no_token" || r.bundle_uuid === null || r.attempt === null) return null;
  return { bundle: { uuid: r.bundle_uuid, attempt: r.attempt }, result: logChunkResult(r) };
}

interface LogChunkRow {
  outcome: "ok" | "gap" | "not_current" | "no_token";
  state: BundleState | null;
  attempt: number | null;
  stored: string | number | null;
  truncated: boolean;
}

/** The parameters both log chunk functions end with: stream, offset, data, the limit (null: none), channel. */
function logChunkParams(args: { stream: LogStream; offset: number; data: Uint8Array; maxBytes?: number }) {
  const maxBytes = args.maxBytes ?? Number.POSITIVE_INFINITY;
  return [args.stream, args.offset, args.data, Number.isFinite(maxBytes) ? maxBytes : null, LOG_CHANNEL];
}

function logChunkResult(r: LogChunkRow | undefined): AppendLogResult {
  if (r === undefined) throw new Error("append_log_chunk returned no row");
  const stored = Number(r.stored);
  if (r.outcome === "ok") return r.truncated ? { ok: true, stored, truncated: true } : { ok: true, stored };
  if (r.outcome === "gap") return { ok: false, reason: "gap", stored };
  const current = r.state === null || r.attempt === null ? null : { state: r.state, attempt: r.attempt };
  return { ok: false, reason: "not_current", current };
}

/** How many bytes of a stream are stored (the offset the next chunk must start at). */
export async function storedLogBytes(
  db: Db,
  uuid: string,
  attempt: number,
  stream: LogStream,
): Promise<number> {
  const { rows } = await db.query<{ n: number }>(
    `SELECT coalesce(max(byte_offset + octet_length(data)), 0)::bigint AS n
     FROM bundle_logs WHERE bundle_uuid = $1 AND attempt = $2 AND stream = $3`,
    [uuid, attempt, stream],
  );
  return Number(rows[0]!.n);
}

export interface LogChunk {
  offset: number;
  data: Buffer;
}

/** Stored chunks of a stream holding bytes at or after `from`, in order, at most `limit` of them. */
export async function readLogChunks(
  db: Db,
  args: { uuid: string; attempt: number; stream: LogStream; from: number; limit: number },
): Promise<LogChunk[]> {
  const { rows } = await db.query<{ byte_offset: number; data: Uint8Array }>(
    `SELECT byte_offset, data FROM bundle_logs
     WHERE bundle_uuid = $1 AND attempt = $2 AND stream = $3 AND byte_offset + octet_length(data) > $4
     ORDER BY byte_offset LIMIT $5`,
    [args.uuid, args.attempt, args.stream, args.from, args.limit],
  );
  return rows.map((r) => ({
    offset: Number(r.byte_offset),
    data: Buffer.from(r.data.buffer, r.data.byteOffset, r.data.byteLength),
  }));
}
