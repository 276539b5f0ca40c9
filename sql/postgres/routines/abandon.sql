-- End a call whose statement was interrupted outside run()'s own error capture
-- (query_canceled and the like), then release it. Cancelled on request: CANCELLED.
-- Interrupted without a request (a cancel meant for the call before it on this
-- session): its transaction rolled back, so it goes back to PENDING, at most five times.
create or replace function asyncproc.abandon(
  execution_id bigint, err_number text, err_message text, out done_seq bigint, out done_status text
)
language plpgsql as $$
declare
  call record;
begin
  select e.cancel_requested, e.recoveries, e.queue, e.status into call
    from asyncproc.executions e where e.id = execution_id for update;
  if call.status = 'RUNNING' and call.cancel_requested then
    update asyncproc.executions e
       set status = 'CANCELLED', finished_at = clock_timestamp(), error_number = err_number,
           error_message = 'cancelled while running: ' || err_message, seq = nextval('asyncproc.change_seq')
     where e.id = execution_id
    returning e.seq, e.status into abandon.done_seq, abandon.done_status;
  elsif call.status = 'RUNNING' and err_number = '57014' and call.recoveries + 1 < 5 then
    update asyncproc.executions e
       set status = 'PENDING', attempts = e.attempts - 1, recoveries = e.recoveries + 1,
           seq = nextval('asyncproc.change_seq')
     where e.id = execution_id
    returning e.seq, e.status into abandon.done_seq, abandon.done_status;
    insert into asyncproc.ready (queue, id) values (call.queue, execution_id);
    perform pg_notify('asyncproc_wake', call.queue);
  elsif call.status = 'RUNNING' then
    select f.done_seq, f.done_status into abandon.done_seq, abandon.done_status
      from asyncproc.finish(execution_id, false, null, err_number, err_message) f;
  end if;
  perform pg_advisory_unlock(x'41535943'::integer, asyncproc.lock_key(execution_id));
end
$$;
