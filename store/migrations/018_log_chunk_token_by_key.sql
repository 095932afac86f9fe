-- append_log_chunk_by_token (016) finds the token's bundle by the token alone and tests its state on the row it
-- holds, as every transition does since 2026-11-29 (KEYED_LOCKS, store/transitions.ts). With the state test where
-- the row was found, PostgreSQL could find it through the index of the queued states whenever the table's
-- statistics said few bundles were starting or running, and then read every one of them for each chunk
-- (docs/decisions.md). Same arguments, same outcomes: 'no_token', nothing written, unless the bundle is starting
-- or running; its row is held (KEY SHARE) from here on, so a transition out of those states waits.
CREATE OR REPLACE FUNCTION append_log_chunk_by_token(
  p_token_hash text,
  p_stream text,
  p_offset bigint,
  p_data bytea,
  p_max bigint,
  p_channel text
) RETURNS TABLE (outcome text, bundle_uuid text, state text, attempt integer, stored bigint, truncated boolean)
LANGUAGE plpgsql AS $$
DECLARE
  b record;
BEGIN
  SELECT x.uuid, x.attempt, x.state INTO b FROM bundles x WHERE x.runner_token_hash = p_token_hash FOR KEY SHARE;
  IF NOT FOUND OR b.state NOT IN ('starting', 'running') THEN
    RETURN QUERY SELECT 'no_token', NULL::text, NULL::text, NULL::integer, NULL::bigint, false;
    RETURN;
  END IF;
  RETURN QUERY SELECT a.outcome, b.uuid::text, a.state, a.attempt, a.stored, a.truncated
  FROM append_log_chunk(b.uuid, b.attempt, p_stream, p_offset, p_data, p_max, p_channel) a;
END
$$;
