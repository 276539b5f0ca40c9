create or replace function asyncproc.next_due() returns timestamptz
language sql stable as $$
  select min(run_at) from asyncproc.executions where status = 'WAITING' and not held
$$;
