-- Users' API tokens in a table of their own: a user may hold several, each revocable and optionally expiring.

CREATE TABLE api_tokens (
  -- <cluster id>-tokn-<15 characters>: shown to users, never a secret.
  id text PRIMARY KEY,
  user_uuid text NOT NULL REFERENCES users (uuid),
  token_hash text NOT NULL UNIQUE,
  label text NOT NULL DEFAULT '',
  created_at timestamptz NOT NULL DEFAULT date_trunc('milliseconds', now()),
  expires_at timestamptz,
  last_used_at timestamptz,
  revoked_at timestamptz
);

CREATE INDEX api_tokens_user ON api_tokens (user_uuid, created_at, id);

-- Every user's token so far becomes that user's first token, made when the user was.
INSERT INTO api_tokens (id, user_uuid, token_hash, created_at)
SELECT split_part(uuid, '-', 1) || '-tokn-' || substr(md5(gen_random_uuid()::text), 1, 15), uuid, token_hash,
  created_at
FROM users;

ALTER TABLE users DROP COLUMN token_hash;
