-- One row per call taken (its token, procedure, the status it was left in, and its error number
-- when it ended), so the service can log each by token.
-- Start again the calls whose worker session is gone (nobody holds their lock). A call whose
-- cancel was requested ends CANCELLED instead; a call lost five times is failed rather than
-- run forever. A non-transactional call is never started again: whatever it committed before
-- its worker was lost stays, so it ends FAILED (AP008) and says so.
create or replace function asyncproc.recover_lost(max_recoveries integer default 5)
returns table (token uuid, procedure text, status text, error_number text)
language plpgsql as $$
#variable_conflict use_column
declare
  candidate record;
  lost      record;
  new_seq   bigint;
  new_stat  text;
begin
  for candidate in select e.id from asyncproc.executions e where e.status = 'RUNNING' order by e.id loop
    -- A worker holds the call's lock from before its claim commits until after its outcome
    -- commits, so getting it proves no live session runs the call. Transaction-level: an
    -- error here cannot leave it held on a pooled connection.
    continue when not pg_try_advisory_xact_lock(asyncproc.lock_key1(candidate.id), asyncproc.lock_key2(candidate.id));
    -- re-read under the row lock: the outcome may have committed since the loop's snapshot
    select e.id, e.token, e.procedure, e.queue, e.recoveries, e.cancel_requested, e.transactional, e.batch_id into lost
      from asyncproc.executions e
     where e.id = candidate.id and (e.status = 'RUNNING') is true
       for update skip locked;
    continue when not found;
    if lost.cancel_requested then
      update asyncproc.executions e
         set status = 'CANCELLED', finished_at = clock_timestamp(), error_number = '57014',
             error_message = 'cancelled while running; its worker was lost', seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
       where e.id = lost.id
      returning e.seq, e.status into new_seq, new_stat;
    elsif not lost.transactional then
      update asyncproc.executions e
         set status = 'FAILED', finished_at = clock_timestamp(), error_number = 'AP008',
             error_message = 'worker lost during a non-transactional call; its effects may be partly done',
             error_detail = null, error_context = null, seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
       where e.id = lost.id
      returning e.seq, e.status into new_seq, new_stat;
    elsif lost.recoveries + 1 >= max_recoveries then
      update asyncproc.executions e
         set status = 'FAILED', attempts = e.attempts - 1, recoveries = e.recoveries + 1,
             finished_at = clock_timestamp(), error_number = 'AP010',
             error_message = format('the worker running this call was lost %s times', e.recoveries + 1),
             seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
       where e.id = lost.id
      returning e.seq, e.status into new_seq, new_stat;
    else
      insert into asyncproc.attempts (execution_id, number, status, started_at, finished_at, worker, backend_pid)
      select e.id, e.attempts + e.recoveries, 'LOST', e.started_at, clock_timestamp(), e.worker, e.backend_pid
        from asyncproc.executions e where e.id = lost.id;
      update asyncproc.executions e
         set status = 'PENDING', attempts = e.attempts - 1, recoveries = e.recoveries + 1,
             seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
       where e.id = lost.id
      returning e.seq, e.status into new_seq, new_stat;
      insert into asyncproc.ready (queue, id) values (lost.queue, lost.id);
      perform pg_notify('asyncproc_wake', lost.queue);
    end if;
    if lost.batch_id is not null and new_stat <> 'PENDING' then
      perform asyncproc.settle_batch(lost.batch_id);
    end if;
    perform asyncproc.emit(lost.id, new_seq, new_stat);
    token := lost.token;
    procedure := lost.procedure;
    status := new_stat;
    error_number := (select e.error_number from asyncproc.executions e where e.id = lost.id);
    return next;
  end loop;
end
$$;
