-- A transition (the state changes) is always a change: it no longer pays for comparing the whole old and new
-- rows as jsonb (about 55 µs a row, most of a claim's or a start's per-row cost in PostgreSQL). Only an update
-- that leaves the state as it is (a heartbeat, resource usage) is compared, to keep change_seq for a row whose
-- only news is one of those columns.
CREATE OR REPLACE FUNCTION bundles_touch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'UPDATE' AND NEW.state IS NOT DISTINCT FROM OLD.state THEN
    IF (to_jsonb(NEW) - 'resource_usage' - 'last_heartbeat_at' - 'change_seq' - 'updated_at')
       = (to_jsonb(OLD) - 'resource_usage' - 'last_heartbeat_at' - 'change_seq' - 'updated_at') THEN
      NEW.change_seq := OLD.change_seq;
      NEW.updated_at := OLD.updated_at;
      RETURN NEW;
    END IF;
  END IF;
  NEW.change_seq := nextval('bundle_change_seq');
  NEW.updated_at := date_trunc('milliseconds', now());
  RETURN NEW;
END
$$;
