/**
 * The content-addressed store's tables (store/migrations/005_cas.sql; docs/storage.md): stored blobs, who may
 * read them, the blobs each manifest names, and bundles' output manifests. Digests travel as `{hash, size}`;
 * the hash is the key (a blob of that hash with another size is simply not stored).
 *
 * A reader is a user and, for a runner, the manifests its bundle may read besides (its dependencies' outputs).
 * A user may read a blob they (or a runner of theirs) uploaded, and every blob a manifest they may read names.
 */
import type { Digest } from "../lib/cas/digest.ts";
import type { Db } from "./db.ts";
import { keyedUpdate } from "./queries.ts";

export interface CasReader {
  userUuid: string;
  /** Hashes of manifests readable besides the user's own (a runner's dependencies' output manifests). */
  manifests: readonly string[];
}

/** find-missing rewrites a blob's touched_at only when it is older than this (repeated asks cost no writes). */
export const TOUCH_RESOLUTION_MS = 3_600_000;

/**
 * SQL true when blob row `b` is readable by user $U and the extra manifests $M (text[]): the user uploaded it, or
 * it is (or a manifest naming it is) one of $M, one the user uploaded, or the tree of one of the user's images
 * (store/migrations/007_images.sql: whoever uploaded the image's blobs, its owner's bundles read them).
 */
const readable = (b: string, u: string, m: string) => `(
  EXISTS (SELECT 1 FROM cas_access a WHERE a.hash = ${b}.hash AND a.user_uuid = ${u})
  OR ${b}.hash = ANY(${m}::text[])
  OR EXISTS (SELECT 1 FROM images i WHERE i.manifest_hash = ${b}.hash AND i.owner_uuid = ${u})
  OR EXISTS (SELECT 1 FROM cas_manifest_refs r WHERE r.blob_hash = ${b}.hash
    AND (r.manifest_hash = ANY(${m}::text[])
      OR EXISTS (SELECT 1 FROM cas_access a2 WHERE a2.hash = r.manifest_hash AND a2.user_uuid = ${u})
      OR EXISTS (SELECT 1 FROM images i2 WHERE i2.manifest_hash = r.manifest_hash AND i2.owner_uuid = ${u}))))`;

/**
 * Of `digests`, those not stored or not readable by the reader, in one statement; the readable ones whose
 * touched_at is older than TOUCH_RESOLUTION_MS are touched (asking extends a blob's life).
 */
export async function findMissing(
  db: Db,
  reader: CasReader,
  digests: readonly Digest[],
  now: Date,
  opts: { touch?: boolean } = {},
): Promise<Digest[]> {
  if (digests.length === 0) return [];
  const touch = opts.touch ?? true;
  // The digests travel as one comma-separated string (`<hash>/<size>,...`): for 10,000 of them that is several
  // times cheaper to send and parse than two array parameters. The answer is their positions.
  const { rows } = await db.query<{ i: number }>(
    `WITH d AS (
       SELECT split_part(x, '/', 1) AS hash, split_part(x, '/', 2)::bigint AS size, i::int AS i
       FROM unnest(string_to_array($1, ',')) WITH ORDINALITY AS t(x, i)
     ),
     ok AS (
       SELECT b.hash, b.touched_at FROM cas_blobs b JOIN d ON b.hash = d.hash AND b.size = d.size
       WHERE b.state = 'present' AND ${readable("b", "$2", "$3")}
     ),
     t AS (
       UPDATE cas_blobs c SET touched_at = $4 FROM ok
       WHERE $5 AND c.hash = ok.hash AND ok.touched_at < $4::timestamptz - make_interval(secs => $6)
         AND c.state = 'present'
       RETURNING 1
     )
     SELECT d.i FROM d WHERE NOT EXISTS (SELECT 1 FROM ok WHERE ok.hash = d.hash) ORDER BY d.i`,
    [
      digests.map((d) => `${d.hash}/${d.size}`).join(","),
      reader.userUuid,
      reader.manifests,
      now,
      touch,
      TOUCH_RESOLUTION_MS / 1000,
    ],
  );
  return rows.map((r) => digests[r.i - 1]!);
}

/** Whether the reader may read the blob (stored and present); `manifest` also requires it be a manifest. */
export async function canRead(
  db: Db,
  reader: CasReader,
  d: Digest,
  opts: { manifest?: boolean } = {},
): Promise<boolean> {
  const { rowCount } = await db.query(
    `SELECT 1 FROM cas_blobs b WHERE b.hash = $1 AND b.size = $2 AND b.state = 'present'
       AND (NOT $5 OR b.manifest) AND ${readable("b", "$3", "$4")}`,
    [d.hash, d.size, reader.userUuid, reader.manifests, opts.manifest === true],
  );
  return rowCount > 0;
}

export type BeginUpload = "absent" | "present" | "deleting";

/**
 * An upload begins: touches the blob's row (so garbage collection leaves it alone while the bytes arrive) and
 * says whether it is absent, present (with this size) or being deleted.
 */
export async function beginUpload(db: Db, d: Digest, now: Date): Promise<BeginUpload> {
  const { rows } = await db.query<{ state: string; size: string }>(
    `WITH u AS (UPDATE cas_blobs SET touched_at = $2 WHERE hash = $1 AND state = 'present' RETURNING state, size)
     SELECT state, size::text AS size FROM u
     UNION ALL SELECT state, size::text AS size FROM cas_blobs WHERE hash = $1 AND state = 'deleting'`,
    [d.hash, now],
  );
  const r = rows[0];
  if (r === undefined) return "absent";
  if (r.state === "deleting") return "deleting";
  return Number(r.size) === d.size ? "present" : "absent";
}

/**
 * Records a verified upload: the blob present (inserted or touched), readable by userUuid, and for a manifest
 * the blobs it names. False when garbage collection is deleting the blob (the caller answers cas.busy).
 */
export async function recordUpload(
  db: Db,
  d: Digest,
  userUuid: string,
  now: Date,
  manifest?: { blobs: readonly string[] },
): Promise<boolean> {
  return db.transaction(async (tx) => {
    const { rowCount } = await tx.query(
      `INSERT INTO cas_blobs (hash, size, manifest, created_at, touched_at) VALUES ($1, $2, $3, $4, $4)
       ON CONFLICT (hash) DO UPDATE SET touched_at = $4, manifest = cas_blobs.manifest OR $3
       WHERE cas_blobs.state = 'present'
       RETURNING 1`,
      [d.hash, d.size, manifest !== undefined, now],
    );
    if (rowCount === 0) return false;
    await tx.query("INSERT INTO cas_access (hash, user_uuid) VALUES ($1, $2) ON CONFLICT DO NOTHING", [
      d.hash,
      userUuid,
    ]);
    if (manifest !== undefined && manifest.blobs.length > 0) {
      await tx.query(
        `INSERT INTO cas_manifest_refs (manifest_hash, blob_hash) SELECT $1, h FROM unnest($2::text[]) AS h
         ON CONFLICT DO NOTHING`,
        [d.hash, manifest.blobs],
      );
    }
    return true;
  });
}

/**
 * Records verified uploads of a batch (blobs held in memory) in one statement per table; returns the hashes
 * garbage collection is deleting (not recorded).
 */
export async function recordUploads(
  db: Db,
  digests: readonly Digest[],
  userUuid: string,
  now: Date,
): Promise<Set<string>> {
  if (digests.length === 0) return new Set();
  return db.transaction(async (tx) => {
    const { rows } = await tx.query<{ hash: string }>(
      `INSERT INTO cas_blobs (hash, size, created_at, touched_at)
       SELECT h, s, $3, $3 FROM unnest($1::text[], $2::bigint[]) AS d(h, s)
       ON CONFLICT (hash) DO UPDATE SET touched_at = $3 WHERE cas_blobs.state = 'present'
       RETURNING hash`,
      [digests.map((d) => d.hash), digests.map((d) => d.size), now],
    );
    const ok = rows.map((r) => r.hash);
    await tx.query(
      `INSERT INTO cas_access (hash, user_uuid) SELECT h, $2 FROM unnest($1::text[]) AS h ON CONFLICT DO NOTHING`,
      [ok, userUuid],
    );
    const done = new Set(ok);
    return new Set(digests.map((d) => d.hash).filter((h) => !done.has(h)));
  });
}

/**
 * Touches every one of `blobs` the reader may read, locking their rows for the rest of the transaction (so
 * garbage collection cannot pick them), and returns those not present or not readable.
 */
export async function touchReadable(
  tx: Db,
  reader: CasReader,
  blobs: readonly Digest[],
  now: Date,
): Promise<Digest[]> {
  if (blobs.length === 0) return [];
  const { rows } = await tx.query<{ hash: string }>(
    `UPDATE cas_blobs b SET touched_at = $5
     FROM unnest($1::text[], $2::bigint[]) AS d(hash, size)
     WHERE b.hash = d.hash AND b.size = d.size AND b.state = 'present' AND ${readable("b", "$3", "$4")}
     RETURNING b.hash`,
    [blobs.map((d) => d.hash), blobs.map((d) => d.size), reader.userUuid, reader.manifests, now],
  );
  const ok = new Set(rows.map((r) => r.hash));
  return blobs.filter((d) => !ok.has(d.hash));
}

/** Hashes of the output manifests of the bundles named (those that finished with one). */
export async function outputManifestsOf(db: Db, bundleUuids: readonly string[]): Promise<string[]> {
  if (bundleUuids.length === 0) return [];
  const { rows } = await db.query<{ m: string }>(
    `SELECT split_part(output_manifest, '/', 1) AS m FROM bundles
     WHERE uuid = ANY($1::text[]) AND output_manifest IS NOT NULL`,
    [bundleUuids],
  );
  return rows.map((r) => r.m);
}

/** Each named bundle's output manifest (`<hash>/<size>`) or null, by uuid. */
export async function outputManifestsByBundle(
  db: Db,
  bundleUuids: readonly string[],
): Promise<Map<string, string | null>> {
  const out = new Map<string, string | null>();
  if (bundleUuids.length === 0) return out;
  const { rows } = await db.query<{ uuid: string; m: string | null }>(
    "SELECT uuid, output_manifest AS m FROM bundles WHERE uuid = ANY($1::text[])",
    [bundleUuids],
  );
  for (const r of rows) out.set(r.uuid, r.m);
  return out;
}

/** Records a bundle's output manifest and its files' bytes (the bundle's attempt must still be this one). */
export async function setOutputManifest(
  db: Db,
  uuid: string,
  attempt: number,
  manifest: string,
  bytes: number,
): Promise<boolean> {
  const { rowCount } = await db.query(
    keyedUpdate(
      "uuid = $1 AND attempt = $2",
      ["starting", "running"],
      "output_manifest = $3, output_bytes = $4",
    ),
    [uuid, attempt, manifest, bytes],
  );
  return rowCount > 0;
}

/**
 * Marks up to `limit` dead blobs 'deleting' and returns them: not touched since `cutoff`, not a live manifest,
 * named by no live manifest. A manifest is live when touched since `cutoff`, a bundle's output manifest, an
 * image's tree (images in the store), or the image tree an unfinished bundle was pinned to at submit time.
 * The empty blob is never collected (it is not stored).
 */
export async function markDeadBlobs(db: Db, cutoff: Date, limit: number): Promise<Digest[]> {
  const { rows } = await db.query<{ hash: string; size: string }>(
    `WITH live AS (
       SELECT hash FROM cas_blobs WHERE manifest AND touched_at >= $1
       UNION SELECT split_part(output_manifest, '/', 1) FROM bundles WHERE output_manifest IS NOT NULL
       UNION SELECT manifest_hash FROM images
       UNION SELECT split_part(image_store->>'manifest', '/', 1) FROM bundles
         WHERE image_store IS NOT NULL AND state NOT IN ('ready', 'failed', 'killed')
     ),
     dead AS (
       SELECT b.hash FROM cas_blobs b
       WHERE b.state = 'present' AND b.touched_at < $1
         AND NOT EXISTS (SELECT 1 FROM live WHERE live.hash = b.hash)
         AND NOT EXISTS (SELECT 1 FROM cas_manifest_refs r JOIN live ON live.hash = r.manifest_hash
                         WHERE r.blob_hash = b.hash)
       LIMIT $2
     )
     UPDATE cas_blobs c SET state = 'deleting' FROM dead
     WHERE c.hash = dead.hash AND c.state = 'present' AND c.touched_at < $1
     RETURNING c.hash, c.size::text AS size`,
    [cutoff, limit],
  );
  return rows.map((r) => ({ hash: r.hash, size: Number(r.size) }));
}

/**
 * Of blobs the backend holds, marks 'deleting' those the store has no row for (bytes written by an upload that
 * ended before it was recorded: a crash, or an upload refused with cas.busy) and returns them. The row is made
 * 'deleting' in the same statement, so an upload of the same blob meanwhile is refused with cas.busy rather than
 * recorded over bytes about to go, exactly as for dead blobs; a blob with a row, in any state, is left alone.
 */
export async function markOrphanBlobs(db: Db, held: readonly Digest[], now: Date): Promise<Digest[]> {
  if (held.length === 0) return [];
  const { rows } = await db.query<{ hash: string; size: string }>(
    `INSERT INTO cas_blobs (hash, size, created_at, touched_at, state)
     SELECT h, s, $3, $3, 'deleting' FROM unnest($1::text[], $2::bigint[]) AS o(h, s)
     ON CONFLICT (hash) DO NOTHING
     RETURNING hash, size::text AS size`,
    [held.map((d) => d.hash), held.map((d) => d.size), now],
  );
  return rows.map((r) => ({ hash: r.hash, size: Number(r.size) }));
}

/** Forgets a blob garbage collection deleted: its row, who could read it, and what it named as a manifest. */
export async function forgetBlobs(db: Db, hashes: readonly string[]): Promise<void> {
  if (hashes.length === 0) return;
  await db.transaction(async (tx) => {
    await tx.query("DELETE FROM cas_access WHERE hash = ANY($1::text[])", [hashes]);
    await tx.query("DELETE FROM cas_manifest_refs WHERE manifest_hash = ANY($1::text[])", [hashes]);
    await tx.query("DELETE FROM cas_blobs WHERE hash = ANY($1::text[]) AND state = 'deleting'", [hashes]);
  });
}

/** Rows left 'deleting' by a collection that stopped half-way (the next collection finishes them). */
export async function deletingBlobs(db: Db, limit: number): Promise<Digest[]> {
  const { rows } = await db.query<{ hash: string; size: string }>(
    "SELECT hash, size::text AS size FROM cas_blobs WHERE state = 'deleting' LIMIT $1",
    [limit],
  );
  return rows.map((r) => ({ hash: r.hash, size: Number(r.size) }));
}

export interface CasTotals {
  blobs: number;
  bytes: number;
  /** Bytes of the files manifests name (each manifest counted once): what the store would hold without dedup. */
  referencedBytes: number;
}

export async function casTotals(db: Db): Promise<CasTotals> {
  const { rows } = await db.query<{ blobs: string; bytes: string; refd: string }>(
    `SELECT (SELECT count(*) FROM cas_blobs WHERE state = 'present')::text AS blobs,
            (SELECT coalesce(sum(size), 0) FROM cas_blobs WHERE state = 'present')::text AS bytes,
            (SELECT coalesce(sum(b.size), 0) FROM cas_manifest_refs r JOIN cas_blobs b ON b.hash = r.blob_hash)::text
              AS refd`,
  );
  const r = rows[0]!;
  return { blobs: Number(r.blobs), bytes: Number(r.bytes), referencedBytes: Number(r.refd) };
}
