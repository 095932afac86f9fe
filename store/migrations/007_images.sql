-- Container images (docs/images.md): images users pushed into the content-addressed store, and each bundle's
-- image reference as resolved at submit time.

-- An image in the store: the unpacked `docker save` tree of one image, uploaded through the CAS, under a name
-- its owner chose (unique per owner). image_id is the image's config digest (`sha256:<hex>`), the id
-- `docker load` gives it; manifest is the tree's manifest digest (`<sha256 hex>/<size>`), manifest_hash its
-- hash (what cas_manifest_refs and garbage collection key on); bytes the tree's file bytes.
CREATE TABLE images (
  owner_uuid text NOT NULL REFERENCES users (uuid),
  name text NOT NULL,
  image_id text NOT NULL,
  manifest text NOT NULL,
  manifest_hash text NOT NULL,
  bytes bigint NOT NULL,
  created_at timestamptz NOT NULL,
  PRIMARY KEY (owner_uuid, name)
);
CREATE INDEX images_owner_image_id ON images (owner_uuid, image_id);
CREATE INDEX images_manifest_hash ON images (manifest_hash);

-- The reference a bundle runs, pinned at submit time (`sha256:<image id hex>` for an image in the store,
-- `repo@sha256:<hex>` for a registry image; NULL: run `image` as given), and for an image in the store
-- {"manifest", "imageId", "bytes"}: every attempt of the bundle gets the same two.
ALTER TABLE bundles ADD COLUMN image_pinned text NULL;
ALTER TABLE bundles ADD COLUMN image_store jsonb NULL;
CREATE INDEX bundles_image_store ON bundles ((split_part(image_store->>'manifest', '/', 1)))
  WHERE image_store IS NOT NULL AND state NOT IN ('ready', 'failed', 'killed');
