-- Pipelines (docs/pipelines.md): a user's named definitions, the jobs that ran or wait to run, keyed by
-- (owner, pipeline, app, job id), and each job's parents, written when the job is created (bubble up) so that
-- finding the children a finished job unblocks (bubble down) is a query.

CREATE TABLE pipelines (
  owner_uuid text NOT NULL REFERENCES users (uuid),
  name text NOT NULL,
  -- The validated definition as JSON (lib/pipeline/definition.ts PipelineDefinition), and its sha256.
  definition jsonb NOT NULL,
  digest text NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now(),
  updated_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (owner_uuid, name)
);

-- One row per job. waiting: a parent is not yet satisfied (no bundle); queued: bundle_uuid is its current
-- attempt's bundle; completed; failed (its bundles failed `attempts` times, or failed_parent_* names the ancestor
-- whose failure it inherited, and it never ran); skipped (valid_if_or: never runs, satisfies its children).
CREATE TABLE pipeline_jobs (
  owner_uuid text NOT NULL,
  pipeline text NOT NULL,
  app text NOT NULL,
  job_id text NOT NULL,
  state text NOT NULL CHECK (state IN ('waiting', 'queued', 'completed', 'failed', 'skipped')),
  bundle_uuid text,
  attempts integer NOT NULL DEFAULT 0,
  reason text,
  failed_parent_app text,
  failed_parent_job_id text,
  created_at timestamptz NOT NULL DEFAULT now(),
  updated_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (owner_uuid, pipeline, app, job_id),
  FOREIGN KEY (owner_uuid, pipeline) REFERENCES pipelines (owner_uuid, name) ON DELETE CASCADE
);
CREATE INDEX pipeline_jobs_bundle ON pipeline_jobs (bundle_uuid);
-- The manager's passes read only the jobs that can move.
CREATE INDEX pipeline_jobs_waiting ON pipeline_jobs (owner_uuid, pipeline, app, job_id) WHERE state = 'waiting';
CREATE INDEX pipeline_jobs_queued ON pipeline_jobs (bundle_uuid) WHERE state = 'queued';

CREATE TABLE pipeline_job_parents (
  owner_uuid text NOT NULL,
  pipeline text NOT NULL,
  app text NOT NULL,
  job_id text NOT NULL,
  parent_app text NOT NULL,
  parent_job_id text NOT NULL,
  PRIMARY KEY (owner_uuid, pipeline, app, job_id, parent_app, parent_job_id),
  FOREIGN KEY (owner_uuid, pipeline, app, job_id)
    REFERENCES pipeline_jobs (owner_uuid, pipeline, app, job_id) ON DELETE CASCADE,
  FOREIGN KEY (owner_uuid, pipeline, parent_app, parent_job_id)
    REFERENCES pipeline_jobs (owner_uuid, pipeline, app, job_id) ON DELETE CASCADE
);
CREATE INDEX pipeline_job_parents_parent ON pipeline_job_parents (owner_uuid, pipeline, parent_app, parent_job_id);
