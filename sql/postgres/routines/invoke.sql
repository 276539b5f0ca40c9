-- The SQL interface for backend services: call it inside your own transaction.
create or replace function asyncproc.invoke(
  procedure    text,
  arguments    jsonb default '{}',
  queue        text default null,
  run_at       timestamptz default null,
  max_attempts integer default null,
  submitted_by text default null
) returns uuid
security definer set search_path = pg_catalog, asyncproc, pg_temp  -- callers need only EXECUTE (0005_permissions.sql)
language sql as $$
  select s.token from asyncproc.submit(procedure, arguments, queue, run_at, max_attempts, submitted_by) s
$$;
