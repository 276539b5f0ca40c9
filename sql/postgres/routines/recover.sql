-- Start again the calls whose worker session is gone (its advisory lock is free).
-- A call lost five times is failed rather than run forever.
create or replace function asyncproc.recover(max_recoveries integer default 5) returns integer
language plpgsql as $$
declare
  lost      record;
  recovered integer := 0;
  new_seq   bigint;
  new_stat  text;
begin
  for lost in
    select e.id, e.queue from asyncproc.executions e
     where e.status = 'RUNNING'
       and not exists (select 1 from pg_locks l
                        where l.locktype = 'advisory' and l.granted and l.objsubid = 2
                          and l.database = (select oid from pg_database where datname = current_database())
                          and l.classid = x'41535943'::integer::oid
                          and l.objid = asyncproc.lock_key(e.id)::oid)
  loop
    -- holding the lock ourselves proves no live session runs it
    continue when not pg_try_advisory_lock(x'41535943'::integer, asyncproc.lock_key(lost.id));
    insert into asyncproc.attempts (execution_id, number, status, started_at, finished_at, worker, backend_pid)
    select e.id, e.attempts + e.recoveries, 'LOST', e.started_at, clock_timestamp(), e.worker, e.backend_pid
      from asyncproc.executions e
     where e.id = lost.id and e.status = 'RUNNING' and e.recoveries + 1 < max_recoveries;
    update asyncproc.executions e
       set status = case when e.recoveries + 1 >= max_recoveries then 'FAILED' else 'PENDING' end,
           attempts = e.attempts - 1, recoveries = e.recoveries + 1,
           finished_at = case when e.recoveries + 1 >= max_recoveries then clock_timestamp() end,
           error_number = case when e.recoveries + 1 >= max_recoveries then 'AP010' end,
           error_message = case when e.recoveries + 1 >= max_recoveries
                                then format('the worker running this call was lost %s times', e.recoveries + 1) end,
           seq = nextval('asyncproc.change_seq')
     where e.id = lost.id and e.status = 'RUNNING'
    returning e.seq, e.status into new_seq, new_stat;
    if new_stat = 'PENDING' then
      insert into asyncproc.ready (queue, id) values (lost.queue, lost.id);
    end if;
    perform pg_advisory_unlock(x'41535943'::integer, asyncproc.lock_key(lost.id));
    if new_seq is not null then
      recovered := recovered + 1;
      perform asyncproc.emit(lost.id, new_seq, new_stat);
      perform pg_notify('asyncproc_wake', lost.queue);
    end if;
  end loop;
  return recovered;
end
$$;
