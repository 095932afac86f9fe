-- Locality (docs/storage.md "Locality"): the manifests of a bundle's inputs and the bytes of their trees, so the
-- dispatcher can prefer an instance whose cache already holds them. A JSON array of
-- {"digest": "<sha256 hex>/<size>", "bytes": <the tree's file bytes>}; filled when the bundle becomes staged, empty
-- for bundles without inputs (and for every bundle staged before this migration).
ALTER TABLE bundles ADD COLUMN input_manifests jsonb NOT NULL DEFAULT '[]';
