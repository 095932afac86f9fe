-- The content-addressed store (docs/storage.md): which blobs are stored, who may read them, which blobs each
-- manifest names, and the output manifest a bundle finished with.

-- One row per stored blob (the backend holds the bytes under the hash). touched_at is extended by uploads and
-- by find-missing; garbage collection marks a row 'deleting' before it removes the bytes, so an upload that
-- meets such a row is refused (cas.busy) rather than recorded as present.
CREATE TABLE cas_blobs (
  hash text PRIMARY KEY,
  size bigint NOT NULL,
  manifest boolean NOT NULL DEFAULT false,
  created_at timestamptz NOT NULL,
  touched_at timestamptz NOT NULL,
  state text NOT NULL DEFAULT 'present' CHECK (state IN ('present', 'deleting'))
);
CREATE INDEX cas_blobs_touched ON cas_blobs (touched_at) WHERE state = 'present';

-- Who has proven they hold a blob's bytes (they, or a runner of one of their bundles, uploaded it).
CREATE TABLE cas_access (
  user_uuid text NOT NULL REFERENCES users (uuid),
  hash text NOT NULL,
  PRIMARY KEY (hash, user_uuid)
);

-- The blobs each stored manifest names (one row per distinct blob).
CREATE TABLE cas_manifest_refs (
  manifest_hash text NOT NULL,
  blob_hash text NOT NULL,
  PRIMARY KEY (manifest_hash, blob_hash)
);
CREATE INDEX cas_manifest_refs_blob ON cas_manifest_refs (blob_hash);

-- The manifest of a bundle's outputs (`<hash>/<size>`), recorded by the runner at finish, and its files' bytes.
ALTER TABLE bundles ADD COLUMN output_manifest text NULL;
ALTER TABLE bundles ADD COLUMN output_bytes bigint NULL;
CREATE INDEX bundles_output_manifest ON bundles ((split_part(output_manifest, '/', 1)))
  WHERE output_manifest IS NOT NULL;
