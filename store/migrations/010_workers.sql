-- Users' own machines as workers (docs/workers.md). A worker row is made with its token (`dispatch-cloud workers
-- token create`): the token identifies that one worker of that one user. The rest is what its last check-in said.

CREATE TABLE workers (
  -- <cluster id>-wrkr-<15 characters>
  id text PRIMARY KEY,
  owner_uuid text NOT NULL REFERENCES users (uuid),
  name text NOT NULL,
  token_hash text NOT NULL UNIQUE,
  -- new: never checked in; active; draining (told to take no more bundles, or stopping); stopped (checked out);
  -- lost (no check-in for workers.checkinTimeout: its bundles went back to the queue).
  state text NOT NULL DEFAULT 'new' CHECK (state IN ('new', 'active', 'draining', 'stopped', 'lost')),
  -- Set by the owner or an admin: the token is refused and nothing is sent to it.
  disabled_at timestamptz,
  tags text[] NOT NULL DEFAULT '{}',
  -- {vcpus, ram, freeDisk, gpu} as the last check-in reported them (lib/worker-protocol.ts WorkerResources).
  resources jsonb,
  slots integer NOT NULL DEFAULT 0,
  version text,
  artifact_sha256 text,
  -- Manifest keys of the trees its cache holds (as crunch-run --list's cache line names them).
  cache jsonb NOT NULL DEFAULT '[]',
  -- [{uuid, attempt}] it said it runs.
  running jsonb NOT NULL DEFAULT '[]',
  created_at timestamptz NOT NULL DEFAULT date_trunc('milliseconds', now()),
  checked_in_at timestamptz,
  UNIQUE (owner_uuid, name)
);

CREATE INDEX workers_live ON workers (state) WHERE state IN ('active', 'draining');

-- The worker a bundle's current attempt was given to (instance_id is null then), and when its start document
-- (with a fresh runner token) was handed to that worker's check-in.
ALTER TABLE bundles ADD COLUMN worker_id text REFERENCES workers (id);
ALTER TABLE bundles ADD COLUMN worker_delivered_at timestamptz;
CREATE INDEX bundles_worker ON bundles (worker_id) WHERE worker_id IS NOT NULL;
