-- Step two: ask every running member of the batch to stop (as cancel() does for one call),
-- and signal (pg_cancel_backend) the sessions of those not asked before that still hold their
-- call's lock (never a dead worker's pid, which may now be an unrelated backend's; recover ends
-- those calls CANCELLED), from this statement, while its update holds their rows (see
-- cancel()); returns the sessions signalled. The service repeats both steps until the batch
-- has ended: a member that went from RUNNING back to WAITING (a retry) while step one ran is
-- caught by the next round.
create or replace function asyncproc.cancel_batch_running(cancel_id uuid) returns setof integer
language sql as $$
  with asked as (
    update asyncproc.executions e set cancel_requested = true
     where e.batch_id = cancel_id and e.status = 'RUNNING' and not e.cancel_requested
    returning e.id, e.backend_pid
  )
  -- CASE: the lock holder is checked first, and the call's cancel gate closed before its
  -- signal (see cancel(), lock_key.sql; an AND may be evaluated in either order)
  select a.backend_pid from asked a
   where case when a.backend_pid = asyncproc.lock_holder(a.id)
              then case when asyncproc.close_cancel_gate(a.id) then pg_cancel_backend(a.backend_pid) else false end
              else false end
$$;
