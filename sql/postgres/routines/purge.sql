create or replace function asyncproc.purge(older_than interval) returns integer
language plpgsql as $$
declare
  cutoff timestamptz := clock_timestamp() - older_than;
  purged integer;
begin
  delete from asyncproc.executions e
   where e.finished_at < cutoff and e.status in ('SUCCEEDED', 'FAILED', 'CANCELLED')
     and (e.batch_id is null
          or exists (select 1 from asyncproc.batches b where b.id = e.batch_id and b.finished_at < cutoff));
  get diagnostics purged = row_count;
  delete from asyncproc.batches b
   where b.finished_at < cutoff
     and not exists (select 1 from asyncproc.executions e where e.batch_id = b.id);
  return purged;
end
$$;
