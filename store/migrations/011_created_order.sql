-- The bundle manager reads created bundles a page at a time in (created_at, uuid) order: this index gives each
-- page without sorting every created bundle (a batch of 10,000 made that sort the bulk of its staging time).
CREATE INDEX bundles_created_order ON bundles (created_at, uuid) WHERE state = 'created';
