-- Identity and access: which roles may invoke a procedure, registrations that can be
-- withdrawn, API keys (hashes only), and the index a caller's own view of its work reads.

-- A list of role names (ROLE_NAME in src/engine.ts: 1–64 of A-Z a-z 0-9 _ . : -). Joined by
-- commas, the elements must read as comma-separated names and split back into as many
-- pieces as there are elements: so none is empty or holds a comma, and each is a name.
-- (array_to_string skips nulls: those are refused apart.)
create domain asyncproc.role_names as text[] not null default '{}'
  check (array_position(value, null) is null
         and coalesce(array_ndims(value), 1) = 1
         and array_to_string(value, ',') ~ '^([A-Za-z0-9_.:-]{1,64}(,[A-Za-z0-9_.:-]{1,64})*)?$'
         and cardinality(string_to_array(array_to_string(value, ','), ',')) = cardinality(value));

-- roles: who may invoke it (any one of them, or admin); empty: any caller.
-- unregistered_at: withdrawn. The row stays, so the executions submitted before still find
-- their routine, timeout and signature when they run (claim, run and call_routine join it),
-- and a later register brings it back with new options.
alter table asyncproc.procedures
  add column roles asyncproc.role_names,
  add column unregistered_at timestamptz;

-- A plain caller reads its own executions newest first (listExecutions, countExecutions).
create index executions_submitted_by on asyncproc.executions (submitted_by, id) where submitted_by is not null;

-- API keys for backend services. Only a SHA-256 of the secret is kept (lower-case hex):
-- the secret itself is shown once, by the service, when the key is made.
create table asyncproc.api_keys (
  id           uuid primary key default gen_random_uuid(),
  name         text not null check (char_length(name) between 1 and 128),
  roles        asyncproc.role_names,
  prefix       text not null check (char_length(prefix) between 1 and 32),
  secret_hash  text not null unique check (secret_hash ~ '^[0-9a-f]{64}$'),
  created_at   timestamptz not null default now(),
  created_by   text,
  last_used_at timestamptz,
  revoked_at   timestamptz
);
-- a name is unique among the keys still in use; a revoked key's name may be taken again
create unique index api_keys_live_name on asyncproc.api_keys (name) where revoked_at is null;

-- Nothing here is PUBLIC's (0005_permissions.sql); say so for the new table all the same,
-- since it holds credentials.
revoke all on asyncproc.api_keys from public;
