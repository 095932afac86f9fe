-- What runners send while a bundle runs: heartbeats (on the bundle row) and log chunks (a table of their own).

ALTER TABLE bundles ADD COLUMN last_heartbeat_at timestamptz;

-- A heartbeat changes only resource_usage and last_heartbeat_at. Such an update keeps change_seq and updated_at
-- (so the dispatcher's queue, which reads changes by change_seq, is not woken by every heartbeat of every
-- running bundle); any other change takes the next change sequence value as before.
CREATE OR REPLACE FUNCTION bundles_touch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'UPDATE'
     AND (to_jsonb(NEW) - 'resource_usage' - 'last_heartbeat_at' - 'change_seq' - 'updated_at')
       = (to_jsonb(OLD) - 'resource_usage' - 'last_heartbeat_at' - 'change_seq' - 'updated_at') THEN
    NEW.change_seq := OLD.change_seq;
    NEW.updated_at := OLD.updated_at;
    RETURN NEW;
  END IF;
  NEW.change_seq := nextval('bundle_change_seq');
  NEW.updated_at := date_trunc('milliseconds', now());
  RETURN NEW;
END
$$;

-- One row per stored chunk of a stream of one attempt. Chunks never overlap: byte_offset of a row is the sum of
-- the lengths of the rows before it, so a stream is its rows in byte_offset order.
CREATE TABLE bundle_logs (
  bundle_uuid text NOT NULL REFERENCES bundles (uuid),
  attempt integer NOT NULL CHECK (attempt >= 1),
  stream text NOT NULL CHECK (stream IN ('stdout', 'stderr')),
  byte_offset bigint NOT NULL CHECK (byte_offset >= 0),
  data bytea NOT NULL CHECK (octet_length(data) > 0),
  created_at timestamptz NOT NULL DEFAULT date_trunc('milliseconds', now()),
  PRIMARY KEY (bundle_uuid, attempt, stream, byte_offset)
);
