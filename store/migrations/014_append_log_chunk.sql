-- A runner's log chunk stored in one statement instead of seven (BEGIN, the bundle's row, the stream's lock, its
-- stored length, the INSERT, the NOTIFY and COMMIT): a chatty bundle sends a chunk a stream every 250 ms, and
-- those round trips made log chunks the runner call a server answered least often (docs/performance.md,
-- bench:runner-calls). The rules are appendLogChunk's (store/queries.ts), which calls this.
--
-- The bundle (p_uuid) must be starting or running in attempt p_attempt, and its row is held (KEY SHARE) until the
-- end, so a transition out of those states waits for the chunk. The stream's advisory lock then orders the
-- writers of one stream; each statement below sees what committed before it, so the stored length is read after
-- the lock is held. Bytes already stored are skipped (a retried or overlapping chunk); a chunk beyond them is a
-- gap; past p_max (NULL: no limit) the stream ends with one notice.
--
-- outcome: 'ok' (stored: the end the runner may continue from; truncated), 'gap' (stored: where the stream
-- ends), or 'not_current' (the bundle's state and attempt, when it exists).
CREATE FUNCTION append_log_chunk(
  p_uuid text,
  p_attempt integer,
  p_stream text,
  p_offset bigint,
  p_data bytea,
  p_max bigint,
  p_channel text
) RETURNS TABLE (outcome text, state text, attempt integer, stored bigint, truncated boolean)
LANGUAGE plpgsql AS $$
DECLARE
  b record;
  have bigint;
  fin bigint := p_offset + octet_length(p_data);
  tail bytea;
  cut boolean;
BEGIN
  SELECT x.uuid, x.state, x.attempt INTO b FROM bundles x WHERE x.uuid = p_uuid FOR KEY SHARE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'not_current', NULL::text, NULL::integer, NULL::bigint, false;
    RETURN;
  END IF;
  IF b.state NOT IN ('starting', 'running') OR b.attempt <> p_attempt THEN
    RETURN QUERY SELECT 'not_current', b.state::text, b.attempt::integer, NULL::bigint, false;
    RETURN;
  END IF;
  PERFORM pg_advisory_xact_lock(hashtext('log ' || b.uuid || ' ' || b.attempt || ' ' || p_stream)::bigint);
  SELECT coalesce(max(l.byte_offset + octet_length(l.data)), 0)::bigint INTO have
  FROM bundle_logs l WHERE l.bundle_uuid = b.uuid AND l.attempt = b.attempt AND l.stream = p_stream;
  IF p_max IS NOT NULL AND have > p_max THEN
    RETURN QUERY SELECT 'ok', b.state::text, b.attempt::integer, greatest(fin, have), true;
    RETURN;
  END IF;
  IF p_offset > have THEN
    RETURN QUERY SELECT 'gap', b.state::text, b.attempt::integer, have, false;
    RETURN;
  END IF;
  IF fin <= have THEN
    RETURN QUERY SELECT 'ok', b.state::text, b.attempt::integer, have, false;
    RETURN;
  END IF;
  tail := substring(p_data FROM (have - p_offset + 1)::integer);
  cut := p_max IS NOT NULL AND have + octet_length(tail) > p_max;
  IF cut THEN
    tail := substring(tail FROM 1 FOR (p_max - have)::integer)
      || convert_to(E'\n[dispatch-cloud] the ' || p_stream || ' log reached its limit of ' || p_max
        || E' bytes (restServer.maxLogBytesPerStream); later bytes were dropped\n', 'UTF8');
  END IF;
  INSERT INTO bundle_logs (bundle_uuid, attempt, stream, byte_offset, data) VALUES (b.uuid, b.attempt, p_stream, have, tail);
  PERFORM pg_notify(p_channel, b.uuid || ' ' || b.attempt || ' ' || p_stream || ' ' || (have + octet_length(tail)));
  IF cut THEN
    RETURN QUERY SELECT 'ok', b.state::text, b.attempt::integer, greatest(fin, have + octet_length(tail)), true;
  ELSE
    RETURN QUERY SELECT 'ok', b.state::text, b.attempt::integer, fin, false;
  END IF;
END
$$;
