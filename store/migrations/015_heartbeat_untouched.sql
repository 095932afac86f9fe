-- A heartbeat no longer runs bundles_touch. Its UPDATE sets resource_usage and last_heartbeat_at (and
-- scheduling_status, as it was unless the runner says otherwise), and bundles_touch then compared the whole old and
-- new rows as jsonb to find nothing else had changed: about 30 % of a heartbeat's cost on PostgreSQL
-- (docs/performance.md, bench:runner-calls). Only a heartbeat moves last_heartbeat_at, so an update that moves it
-- and leaves the state and scheduling_status as they were is a heartbeat that changed nothing the queue reads:
-- the trigger is skipped, and change_seq and updated_at stay as they were, which is what the comparison decided
-- for it. Every other update (and every insert) runs bundles_touch as before. The update trigger keeps its name.
DROP TRIGGER bundles_touch ON bundles;

CREATE TRIGGER bundles_touch_insert BEFORE INSERT ON bundles
  FOR EACH ROW EXECUTE FUNCTION bundles_touch();

CREATE TRIGGER bundles_touch BEFORE UPDATE ON bundles
  FOR EACH ROW
  WHEN (NEW.last_heartbeat_at IS NOT DISTINCT FROM OLD.last_heartbeat_at
    OR NEW.state IS DISTINCT FROM OLD.state
    OR NEW.scheduling_status IS DISTINCT FROM OLD.scheduling_status)
  EXECUTE FUNCTION bundles_touch();
