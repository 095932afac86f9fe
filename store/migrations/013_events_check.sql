-- Every event names a bundle that exists, checked once per statement instead of once per row. The foreign key
-- ran one lookup and one row lock (FOR KEY SHARE) for each event: a submission writes two events a bundle, and
-- those checks were about a fifth of PostgreSQL's time for a batch of 1,000 (docs/performance.md). The trigger
-- below checks a statement's new events together, after the statement, as the constraint did.
--
-- The foreign key also kept a bundle with events from being deleted or renamed. Nothing deletes a bundle or
-- changes its uuid, so the row lock bought nothing; the two guards below still refuse both.
ALTER TABLE bundle_events DROP CONSTRAINT bundle_events_bundle_uuid_fkey;

CREATE FUNCTION bundle_events_check_bundles() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  missing text;
BEGIN
  SELECT e.bundle_uuid INTO missing FROM new_events e
  WHERE NOT EXISTS (SELECT 1 FROM bundles b WHERE b.uuid = e.bundle_uuid)
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'bundle_events: bundle % does not exist', missing USING ERRCODE = 'foreign_key_violation';
  END IF;
  RETURN NULL;
END
$$;

CREATE TRIGGER bundle_events_bundle_exists AFTER INSERT ON bundle_events
  REFERENCING NEW TABLE AS new_events
  FOR EACH STATEMENT EXECUTE FUNCTION bundle_events_check_bundles();

CREATE FUNCTION bundles_keep_events() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  kept text;
BEGIN
  SELECT o.uuid INTO kept FROM old_bundles o
  WHERE EXISTS (SELECT 1 FROM bundle_events e WHERE e.bundle_uuid = o.uuid)
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'bundles: bundle % still has events', kept USING ERRCODE = 'foreign_key_violation';
  END IF;
  RETURN NULL;
END
$$;

CREATE TRIGGER bundles_keep_events AFTER DELETE ON bundles
  REFERENCING OLD TABLE AS old_bundles
  FOR EACH STATEMENT EXECUTE FUNCTION bundles_keep_events();

CREATE FUNCTION bundles_fixed_uuid() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'bundles: a bundle''s uuid does not change (%)', OLD.uuid USING ERRCODE = 'foreign_key_violation';
END
$$;

CREATE TRIGGER bundles_fixed_uuid BEFORE UPDATE OF uuid ON bundles
  FOR EACH ROW WHEN (OLD.uuid IS DISTINCT FROM NEW.uuid) EXECUTE FUNCTION bundles_fixed_uuid();
