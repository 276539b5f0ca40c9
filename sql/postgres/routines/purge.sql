-- Retention: delete finished history older than `older_than`, at most about `max_rows`
-- executions per call, so that one call is one short transaction (the activator calls it
-- again while it fills its budget). Never an unfinished execution, never any part of a
-- batch that has not ended before the cutoff: a batch goes whole, with all its executions,
-- in one call. Their attempts go with them (on delete cascade). Returns executions deleted.
drop function if exists asyncproc.purge(interval);
create or replace function asyncproc.purge(older_than interval, max_rows integer default 1000) returns integer
language plpgsql as $$
declare
  cutoff timestamptz := clock_timestamp() - older_than;
  purged integer;
  batch  uuid;
  more   integer;
begin
  -- executions on their own: the oldest first, skipping rows another purge holds
  delete from asyncproc.executions e
   where e.id in (select x.id from asyncproc.executions x
                   where x.finished_at < cutoff and x.batch_id is null
                     and x.status in ('SUCCEEDED', 'FAILED', 'CANCELLED')
                   order by x.finished_at
                   limit greatest(max_rows, 1)
                   for update skip locked);
  get diagnostics purged = row_count;
  -- then whole batches that ended before the cutoff, one at a time, while the budget lasts
  while purged < max_rows loop
    select b.id into batch from asyncproc.batches b
     where b.finished_at < cutoff
     order by b.finished_at
     limit 1
     for update skip locked;
    exit when batch is null;
    delete from asyncproc.executions e where e.batch_id = batch;
    get diagnostics more = row_count;
    delete from asyncproc.batches b where b.id = batch;
    purged := purged + more;
    batch := null;
  end loop;
  return purged;
end
$$;
