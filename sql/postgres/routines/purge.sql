-- Retention: delete finished history older than `older_than`, at most `max_rows` executions
-- per call, so that one call is one short transaction (the activator calls it again while it
-- fills its budget). Never an unfinished execution, never any part of a batch that has not
-- ended before the cutoff: an ended batch's executions go, max_rows at most a call, and the
-- batch row with the last of them. Their attempts go with them (on delete cascade). Returns executions deleted.
-- The newest writer of what went raises the purge horizon in the same transaction (a resume
-- from a cursor that may not see it is refused: 0015_purge_horizon.sql).
drop function if exists asyncproc.purge(interval);
create or replace function asyncproc.purge(older_than interval, max_rows integer default 1000) returns integer
language plpgsql as $$
declare
  cutoff timestamptz := clock_timestamp() - older_than;
  purged integer;
  batch  uuid;
  more   integer;
  newest xid8;
begin
  -- executions on their own: the oldest first, skipping rows another purge holds
  with gone as (
    delete from asyncproc.executions e
     where e.id in (select x.id from asyncproc.executions x
                     where x.finished_at < cutoff and x.batch_id is null
                       and x.status in ('SUCCEEDED', 'FAILED', 'CANCELLED')
                     order by x.finished_at
                     limit greatest(max_rows, 1)
                     for update skip locked)
    returning e.xid
  )
  select count(*), max(gone.xid) into purged, newest from gone;
  -- then whole batches that ended before the cutoff, one at a time, while the budget lasts
  while purged < max_rows loop
    select b.id into batch from asyncproc.batches b
     where b.finished_at < cutoff
     order by b.finished_at
     limit 1
     for update skip locked;
    exit when batch is null;
    -- its executions within what is left of the budget (a batch of 100,000 calls is purged over
    -- many calls, each a short transaction); the batch row once none is left
    with gone as (
      delete from asyncproc.executions e
       where e.id in (select x.id from asyncproc.executions x where x.batch_id = batch limit greatest(max_rows - purged, 1))
      returning e.xid
    )
    select count(*), greatest(newest, max(gone.xid)) into more, newest from gone;
    purged := purged + more;
    if not exists (select from asyncproc.executions e where e.batch_id = batch) then
      delete from asyncproc.batches b where b.id = batch;
    end if;
    batch := null;
  end loop;
  if newest is not null then
    insert into asyncproc.purge_horizon as h (writer) values (newest)
    on conflict (only_row) do update set writer = greatest(h.writer, excluded.writer);
  end if;
  return purged;
end
$$;
