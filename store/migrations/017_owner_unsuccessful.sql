-- A user's failed and killed bundles, newest first (GET /api/v1/bundles?state=failed, `dispatch-cloud list`): the
-- owner's other indexes are of the active bundles (bundles_owner_active) and of all of them (bundles_owner_created),
-- so asking for the failed ones among a history of finished bundles read the whole history (127 ms at 1,000,000
-- bundles, docs/performance.md). Partial: a bundle enters it only when it fails or is killed, so submissions and
-- the other transitions do not write it. Built in the migration's transaction, which holds writes to bundles for
-- as long as one pass over the table takes.
CREATE INDEX bundles_owner_unsuccessful ON bundles (owner_uuid, created_at DESC, uuid DESC)
  WHERE state IN ('failed', 'killed');
