-- Record the outcome of a non-transactional call, which its worker ran at top level (the
-- call's effects are committed already), in a transaction of its own; then release the call
-- and claim the next one of next_queue, as run() does. succeeded: `outcome` is a function's
-- outcome, or null for a procedure, whose output row comes as text (output_parameters).
-- Failed: the error as the worker caught it; retried per max_attempts like any failure (a retry
-- runs again what the failed attempt committed), or CANCELLED when a cancel was asked for.
-- Only the session that claimed the call and still holds its lock records anything.
-- Dropped only when it is not the definition below (CREATE OR REPLACE cannot change its OUT
-- parameters): applied again as it is (an upgrade, a process of another version), it is replaced
-- in place and keeps its OID, so a worker inside it at that moment goes on. Dropped each time,
-- it failed every call then running (XX000: cache lookup failed for function).
do $guard$
begin
  if pg_get_function_arguments(to_regprocedure('asyncproc.conclude(bigint, text, text, boolean, jsonb, text[], oid[], text[], text, text, text, text)'))
     is distinct from 'execution_id bigint, worker text, next_queue text, succeeded boolean, outcome jsonb, output_names text[], output_types oid[], output_values text[], err_number text, err_message text, err_detail text, err_context text, OUT done_seq bigint, OUT done_status text, OUT next_id bigint, OUT next_seq bigint, OUT next_timeout_ms integer, OUT next_transactional boolean, OUT next_token uuid, OUT next_procedure text' then
    drop function if exists asyncproc.conclude(bigint, text, text, boolean, jsonb, text[], oid[], text[], text, text, text, text);
  end if;
end
$guard$;
create or replace function asyncproc.conclude(
  execution_id bigint, worker text, next_queue text, succeeded boolean, outcome jsonb,
  output_names text[], output_types oid[], output_values text[],
  err_number text, err_message text, err_detail text, err_context text,
  out done_seq bigint, out done_status text, out next_id bigint, out next_seq bigint, out next_timeout_ms integer,
  out next_transactional boolean, out next_token uuid, out next_procedure text
)
-- lock_timeout = 0: the service's own lock waits, as in finish()
language plpgsql set lock_timeout = 0 as $$
declare
  call record;
begin
  -- at transaction level too, so recover cannot take the call between the unlock below and
  -- the commit of its outcome (see run())
  if pg_try_advisory_xact_lock(asyncproc.lock_key1(execution_id), asyncproc.lock_key2(execution_id)) then
    select e.cancel_requested, e.batch_id into call
      from asyncproc.executions e
     where e.id = execution_id and (e.status = 'RUNNING') is true and e.backend_pid = pg_backend_pid()
       for update;
    if not found then
      null;
    elsif not succeeded and call.cancel_requested then
      update asyncproc.executions e
         set status = 'CANCELLED', finished_at = clock_timestamp(), error_number = err_number,
             error_message = 'cancelled while running: ' || err_message, error_detail = err_detail,
             error_context = err_context, seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
       where e.id = execution_id
      returning e.seq, e.status into conclude.done_seq, conclude.done_status;
      if call.batch_id is not null then
        perform asyncproc.settle_batch(call.batch_id);
      end if;
    else
      select f.done_seq, f.done_status into conclude.done_seq, conclude.done_status
        from asyncproc.finish(execution_id, succeeded,
                              case when succeeded then coalesce(outcome, asyncproc.procedure_outcome(
                                asyncproc.output_parameters(output_names, output_types, output_values))) end,
                              err_number, err_message, nullif(err_detail, ''), nullif(err_context, '')) f;
    end if;
    perform pg_advisory_unlock(asyncproc.lock_key1(execution_id), asyncproc.lock_key2(execution_id));
  end if;

  if next_queue is not null then
    select c.id, c.seq, c.timeout_ms, c.transactional, c.token, c.procedure
      into conclude.next_id, conclude.next_seq, conclude.next_timeout_ms, conclude.next_transactional,
           conclude.next_token, conclude.next_procedure
      from asyncproc.claim(next_queue, worker) c;
  end if;
end
$$;
