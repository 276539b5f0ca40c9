-- The SQL interface for backend services: submit a batch inside your own transaction; returns its id.
create or replace function asyncproc.invoke_batch(stages jsonb, on_failure text default 'CANCEL', submitted_by text default null)
returns uuid
security definer set search_path = pg_catalog, asyncproc, pg_temp  -- callers need only EXECUTE (0005_permissions.sql)
language sql as $$
  select e.batch_id from asyncproc.submit_batch(stages, on_failure, submitted_by) e limit 1
$$;
