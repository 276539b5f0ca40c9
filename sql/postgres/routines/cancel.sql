create or replace function asyncproc.cancel(cancel_token uuid, out outcome text, out backend_pid integer)
language plpgsql as $$
declare
  target   record;
  new_seq  bigint;
begin
  select e.id, e.queue, e.batch_id, e.status into target from asyncproc.executions e where e.token = cancel_token;
  if not found then
    outcome := 'NOT_FOUND';
    return;
  end if;
  if target.batch_id is not null and target.status in ('WAITING', 'PENDING') then
    perform 1 from asyncproc.batches b where b.id = target.batch_id for update;
  end if;
  -- the ready row first, as a claim takes it: a claim in progress makes us wait for its commit
  delete from asyncproc.ready r where r.queue = target.queue and r.id = target.id;
  update asyncproc.executions e
     set status = 'CANCELLED', held = false, finished_at = clock_timestamp(), seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
   where e.id = target.id and e.status in ('WAITING', 'PENDING')
  returning e.seq into new_seq;
  if new_seq is not null then
    perform asyncproc.emit(target.id, new_seq, 'CANCELLED');
    if target.batch_id is not null then
      perform asyncproc.settle_batch(target.batch_id);
    end if;
    outcome := 'CANCELLED';
    return;
  end if;
  if target.batch_id is not null and target.status in ('WAITING', 'PENDING') then
    outcome := 'RETRY';
    return;
  end if;
  -- closed before the flag is asked and the session signalled, until this commits: a run
  -- that reads the flag after this waits for it (lock_key.sql)
  perform asyncproc.close_cancel_gate(target.id);
  update asyncproc.executions e set cancel_requested = true
   where e.id = target.id and (e.status = 'RUNNING') is true
  returning e.backend_pid into cancel.backend_pid;
  outcome := case when found then 'RUNNING' else 'FINISHED' end;
  -- Signal only the recorded worker, and only while it holds the call's lock: a dead
  -- worker's pid may since belong to an unrelated backend. Nobody holding it: recover
  -- ends the call CANCELLED.
  if cancel.backend_pid is distinct from asyncproc.lock_holder(target.id) then
    cancel.backend_pid := null;
  end if;
  -- The signal goes from here, while the update above holds the call's row: the worker cannot
  -- commit the call's end until this transaction ends (its finish() waits for the row), so the
  -- signal reaches this call, in its run or in that wait, never the next call of the same
  -- session. Sent by the service after this commit, it once stopped the call that session ran
  -- next. backend_pid: the session signalled (null: none).
  if cancel.backend_pid is not null and not pg_cancel_backend(cancel.backend_pid) then
    cancel.backend_pid := null;
  end if;
end
$$;
