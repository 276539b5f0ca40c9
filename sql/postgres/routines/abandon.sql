-- End a call whose statement was interrupted outside run()'s own error capture
-- (query_canceled and the like), then release it. Cancelled on request: CANCELLED.
-- Timed out (the procedure's timeout_ms, armed by the worker as statement_timeout): a
-- failed attempt, retried like any failure. Interrupted without a request (a cancel meant
-- for the call before it on this session): its transaction rolled back, so it goes back
-- to PENDING, at most five times. handed_back: the worker is stopping and gives the call back
-- (its grace is over and it cancelled the call's statement, or it had claimed the call and
-- not started it): PENDING again, neither an attempt nor one of the five.
drop function if exists asyncproc.abandon(bigint, text, text);
drop function if exists asyncproc.abandon(bigint, text, text, boolean);
create or replace function asyncproc.abandon(
  execution_id bigint, err_number text, err_message text, timed_out boolean default false,
  handed_back boolean default false,
  out done_seq bigint, out done_status text
)
-- lock_timeout = 0: the service's own lock waits, as in finish()
language plpgsql set lock_timeout = 0 as $$
declare
  call record;
  held record;
begin
  -- Ours only while no other session holds its lock and it still records this session: an
  -- error after run() released it (a late cancel, a deadlock in the claim of the next call)
  -- lets recover and another worker start it, and that run's state is not ours to change.
  -- The transaction-level lock keeps recover off it until this outcome is committed.
  if pg_try_advisory_xact_lock(asyncproc.lock_key1(execution_id), asyncproc.lock_key2(execution_id)) then
    select e.cancel_requested, e.recoveries, e.queue, e.batch_id into call
      from asyncproc.executions e
     where e.id = execution_id and (e.status = 'RUNNING') is true and e.backend_pid = pg_backend_pid()
       for update;
    if not found then
      null;
    elsif call.cancel_requested then
      update asyncproc.executions e
         set status = 'CANCELLED', finished_at = clock_timestamp(), error_number = err_number,
             error_message = 'cancelled while running: ' || err_message, seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
       where e.id = execution_id
      returning e.seq, e.status into abandon.done_seq, abandon.done_status;
      if call.batch_id is not null then
        perform asyncproc.settle_batch(call.batch_id);
      end if;
    elsif handed_back or (err_number = '57014' and not timed_out and call.recoveries + 1 < 5) then
      update asyncproc.executions e
         set status = 'PENDING', attempts = e.attempts - 1,
             recoveries = e.recoveries + case when handed_back then 0 else 1 end,
             seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
       where e.id = execution_id
      returning e.seq, e.status into abandon.done_seq, abandon.done_status;
      insert into asyncproc.ready (queue, id) values (call.queue, execution_id);
      perform pg_notify('asyncproc_wake', call.queue);
    else
      select f.done_seq, f.done_status into abandon.done_seq, abandon.done_status
        from asyncproc.finish(execution_id, false, null, err_number, err_message) f;
    end if;
  end if;
  -- Every call lock this session holds at session level goes: this call's, and the one a
  -- claim took inside run() before the error rolled that claim back (left held, it would
  -- block every other worker's claim of that call for as long as this session lives).
  for held in
    select l.classid::bigint::integer as key1, l.objid::bigint as objid
      from pg_locks l
     where l.pid = pg_backend_pid() and l.locktype = 'advisory' and l.objsubid = 2
       and l.classid::bigint >> 16 = x'4153'::integer
  loop
    perform pg_advisory_unlock(held.key1, held.objid::bit(32)::integer);
  end loop;
end
$$;
