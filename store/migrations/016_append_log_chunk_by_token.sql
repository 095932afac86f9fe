-- A runner's log chunk found by its token instead of by a lookup before it: the REST server looked the token up
-- (one statement) before reading a chunk's body, then stored it (append_log_chunk, a second). For a chunk small
-- enough to arrive within restServer.requestTimeout the lookup is not needed to time the upload, so the chunk is
-- stored here in one statement (rest-server/routes-runner.ts, docs/performance.md bench:runner-calls).
--
-- The token's bundle must be starting or running (a token is one attempt's, and leaving those states clears
-- runner_token_hash); its row is held (KEY SHARE) from here on, as append_log_chunk holds it, so a transition out
-- of those states waits and the chunk is stored for the attempt found here. Otherwise the outcome is 'no_token'
-- and nothing is written: the caller looks the token up to say why.
CREATE FUNCTION append_log_chunk_by_token(
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
  SELECT x.uuid, x.attempt INTO b FROM bundles x
  WHERE x.runner_token_hash = p_token_hash AND x.state IN ('starting', 'running') FOR KEY SHARE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'no_token', NULL::text, NULL::text, NULL::integer, NULL::bigint, false;
    RETURN;
  END IF;
  RETURN QUERY SELECT a.outcome, b.uuid::text, a.state, a.attempt, a.stored, a.truncated
  FROM append_log_chunk(b.uuid, b.attempt, p_stream, p_offset, p_data, p_max, p_channel) a;
END
$$;
