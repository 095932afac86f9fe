-- dispatch-cloud initial schema. Timestamps are truncated to milliseconds so that a JS Date round-trips
-- exactly (keyset pagination compares them).

CREATE TABLE users (
  uuid text PRIMARY KEY,
  name text NOT NULL UNIQUE,
  is_admin boolean NOT NULL DEFAULT false,
  token_hash text NOT NULL UNIQUE,
  created_at timestamptz NOT NULL DEFAULT date_trunc('milliseconds', now())
);

CREATE SEQUENCE bundle_change_seq;

CREATE TABLE bundles (
  uuid text PRIMARY KEY,
  owner_uuid text NOT NULL REFERENCES users (uuid),
  name text NOT NULL,
  command jsonb NOT NULL,
  image text NOT NULL,
  env jsonb NOT NULL,
  resources jsonb NOT NULL,
  preemptible boolean NOT NULL,
  priority integer NOT NULL,
  limits jsonb NOT NULL,
  dependencies jsonb NOT NULL,
  allow_failed_dependencies boolean NOT NULL,
  max_attempts integer NOT NULL CHECK (max_attempts >= 1),
  attempt integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
  state text NOT NULL
    CHECK (state IN ('created', 'staged', 'starting', 'running', 'ready', 'failed', 'killed')),
  state_reason text,
  scheduling_status text,
  instance_id text,
  instance_type text,
  gpu_devices integer[] NOT NULL DEFAULT '{}',
  exit_code integer,
  resource_usage jsonb,
  cost_dollars double precision,
  runner_token_hash text,
  change_seq bigint NOT NULL,
  created_at timestamptz NOT NULL DEFAULT date_trunc('milliseconds', now()),
  updated_at timestamptz NOT NULL DEFAULT date_trunc('milliseconds', now()),
  staged_at timestamptz,
  starting_at timestamptz,
  running_at timestamptz,
  finished_at timestamptz
);

CREATE INDEX bundles_owner_created ON bundles (owner_uuid, created_at DESC, uuid DESC);
CREATE UNIQUE INDEX bundles_change_seq ON bundles (change_seq);
CREATE INDEX bundles_active_state ON bundles (state)
  WHERE state IN ('created', 'staged', 'starting', 'running');
CREATE UNIQUE INDEX bundles_runner_token_hash ON bundles (runner_token_hash)
  WHERE runner_token_hash IS NOT NULL;

-- Every insert or update of a bundle row takes the next change sequence value (the dispatcher's queue reads
-- changes incrementally by it) and sets updated_at.
CREATE FUNCTION bundles_touch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  NEW.change_seq := nextval('bundle_change_seq');
  NEW.updated_at := date_trunc('milliseconds', now());
  RETURN NEW;
END
$$;

CREATE TRIGGER bundles_touch BEFORE INSERT OR UPDATE ON bundles
  FOR EACH ROW EXECUTE FUNCTION bundles_touch();

CREATE TABLE bundle_dependencies (
  bundle_uuid text NOT NULL REFERENCES bundles (uuid),
  ordinal integer NOT NULL,
  dependency_uuid text NOT NULL REFERENCES bundles (uuid),
  subpath text NOT NULL,
  name text NOT NULL,
  PRIMARY KEY (bundle_uuid, ordinal)
);

CREATE INDEX bundle_dependencies_dependency ON bundle_dependencies (dependency_uuid);

CREATE TABLE bundle_events (
  id bigserial PRIMARY KEY,
  bundle_uuid text NOT NULL REFERENCES bundles (uuid),
  from_state text,
  to_state text NOT NULL,
  attempt integer NOT NULL,
  reason text,
  actor text NOT NULL,
  created_at timestamptz NOT NULL DEFAULT date_trunc('milliseconds', now())
);

CREATE INDEX bundle_events_bundle ON bundle_events (bundle_uuid, id);
