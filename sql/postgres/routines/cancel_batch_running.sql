-- Step two: ask every running member of the batch to stop (as cancel() does for one call);
-- returns the sessions of those not asked before, for pg_cancel_backend. The service
-- repeats both steps until the batch has ended: a member that went from RUNNING back to
-- WAITING (a retry) while step one ran is caught by the next round.
create or replace function asyncproc.cancel_batch_running(cancel_id uuid) returns setof integer
language sql as $$
  update asyncproc.executions e set cancel_requested = true
   where e.batch_id = cancel_id and e.status = 'RUNNING' and not e.cancel_requested
  returning e.backend_pid
$$;
