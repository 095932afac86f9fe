/**
 * Images in the content-addressed store (store/migrations/007_images.sql; docs/images.md): one row per owner and
 * name, naming the manifest of the image's unpacked `docker save` tree and its image id.
 */
import type { Db } from "./db.ts";

export interface StoredImage {
  ownerUuid: string;
  name: string;
  /** The config digest `sha256:<hex>`. */
  imageId: string;
  /** The tree's manifest digest `<sha256 hex>/<size>`. */
  manifest: string;
  bytes: number;
  createdAt: Date;
}

interface ImageRow {
  owner_uuid: string;
  name: string;
  image_id: string;
  manifest: string;
  bytes: string | number;
  created_at: Date;
}

const imageFromRow = (r: ImageRow): StoredImage => ({
  ownerUuid: r.owner_uuid,
  name: r.name,
  imageId: r.image_id,
  manifest: r.manifest,
  bytes: Number(r.bytes),
  createdAt: r.created_at,
});

/**
 * Records an image under its owner's name, replacing what the name named before (a push of a newer build under
 * the same tag). Returns the row and whether it replaced another image.
 */
export async function putImage(
  db: Db,
  img: Omit<StoredImage, "createdAt">,
  now: Date,
): Promise<{ image: StoredImage; replaced: boolean }> {
  const { rows } = await db.query<ImageRow & { replaced: boolean }>(
    `WITH old AS (SELECT image_id FROM images WHERE owner_uuid = $1 AND name = $2)
       INSERT INTO images (owner_uuid, name, image_id, manifest, manifest_hash, bytes, created_at)
       VALUES ($1, $2, $3, $4, split_part($4, '/', 1), $5, $6)
       ON CONFLICT (owner_uuid, name) DO UPDATE SET image_id = $3, manifest = $4,
         manifest_hash = split_part($4, '/', 1), bytes = $5, created_at = $6
       RETURNING owner_uuid, name, image_id, manifest, bytes, created_at,
         EXISTS (SELECT 1 FROM old WHERE old.image_id <> $3) AS replaced`,
    [img.ownerUuid, img.name, img.imageId, img.manifest, img.bytes, now],
  );
  const r = rows[0]!;
  return { image: imageFromRow(r), replaced: r.replaced };
}

/** The owner's images, by name. */
export async function listImages(db: Db, ownerUuid: string): Promise<StoredImage[]> {
  const { rows } = await db.query<ImageRow>(
    `SELECT owner_uuid, name, image_id, manifest, bytes, created_at FROM images WHERE owner_uuid = $1
     ORDER BY name`,
    [ownerUuid],
  );
  return rows.map(imageFromRow);
}

/**
 * The owner's image named `ref`: by name, or by image id (`sha256:<hex>`: the most recent row with that id; several
 * names may carry one image).
 */
export async function findImage(db: Db, ownerUuid: string, ref: string): Promise<StoredImage | null> {
  const { rows } = await db.query<ImageRow>(
    `SELECT owner_uuid, name, image_id, manifest, bytes, created_at FROM images
     WHERE owner_uuid = $1 AND (name = $2 OR image_id = $2)
     ORDER BY (name = $2) DESC, created_at DESC LIMIT 1`,
    [ownerUuid, ref],
  );
  return rows[0] === undefined ? null : imageFromRow(rows[0]);
}

/** Forgets the owner's image by name or id (every name carrying that id); returns what was removed. */
export async function deleteImage(db: Db, ownerUuid: string, ref: string): Promise<StoredImage[]> {
  const { rows } = await db.query<ImageRow>(
    `DELETE FROM images WHERE owner_uuid = $1 AND (name = $2 OR (image_id = $2 AND NOT EXISTS (
       SELECT 1 FROM images n WHERE n.owner_uuid = $1 AND n.name = $2)))
     RETURNING owner_uuid, name, image_id, manifest, bytes, created_at`,
    [ownerUuid, ref],
  );
  return rows.map(imageFromRow).sort((a, b) => a.name.localeCompare(b.name));
}
