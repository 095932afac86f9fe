-- What the per-user submission limits need: a lockable row per user holding its token bucket, and an index that
-- counts a user's non-final bundles without reading the final ones.

-- One row per user that has submitted since the limits existed. Its row lock serialises that user's
-- submissions (so the queued-bundles cap is exact); submit_tokens and submit_refilled_at are the token bucket of
-- the submission rate limit.
CREATE TABLE user_quotas (
  user_uuid text PRIMARY KEY REFERENCES users (uuid),
  submit_tokens double precision NOT NULL,
  submit_refilled_at timestamptz NOT NULL
);

-- A user's non-final bundles, counted at each submission.
CREATE INDEX bundles_owner_active ON bundles (owner_uuid)
  WHERE state IN ('created', 'staged', 'starting', 'running');
