-- asyncproc.invoke with an idempotency key (0018_idempotency_keys.sql), for a backend service that
-- may send a call again when it cannot tell whether its transaction committed: the same key with
-- the same call returns the token the first one got, and submits nothing; with another call it
-- is refused (AP012). A function of its own, not a parameter of invoke: a DBA's grant names
-- invoke's signature (0005_permissions.sql), which stays as it was. Grant it as invoke:
--   grant execute on function asyncproc.invoke_once(text, text, jsonb, text, timestamptz, integer, text) to app_role;
create or replace function asyncproc.invoke_once(
  idempotency_key text,
  procedure    text,
  arguments    jsonb default '{}',
  queue        text default null,
  run_at       timestamptz default null,
  max_attempts integer default null,
  submitted_by text default null
) returns uuid
security definer set search_path = pg_catalog, asyncproc, pg_temp  -- callers need only EXECUTE (0005_permissions.sql)
language sql as $$
  select s.token from asyncproc.submit(procedure, arguments, queue, run_at, max_attempts, submitted_by,
                                       idempotency_key => coalesce(idempotency_key, ''))  s
$$;
