-- Run one claimed transactional call; its writes and its outcome commit together (the service
-- notifies right after). Then release it and claim the next call of next_queue in
-- the same transaction and round trip.
-- with_row: also return the row as the call left it (done_row, the whole row as JSON), for a
-- subscriber of this worker's process that waits for the call's end: handed the row from here,
-- it hears the end without a read of the change feed.
drop function if exists asyncproc.run(bigint, text, text, integer);
-- Dropped only when it is not the definition below (CREATE OR REPLACE cannot change its OUT
-- parameters): applied again as it is (an upgrade, a process of another version), it is replaced
-- in place and keeps its OID, so a worker inside it at that moment goes on. Dropped each time,
-- it failed every call then running (XX000: cache lookup failed for function).
do $guard$
begin
  if pg_get_function_arguments(to_regprocedure('asyncproc.run(bigint, text, text, integer, boolean)'))
     is distinct from 'execution_id bigint, worker text, next_queue text, row_cap integer DEFAULT 100, with_row boolean DEFAULT false, OUT done_seq bigint, OUT done_status text, OUT next_id bigint, OUT next_seq bigint, OUT next_timeout_ms integer, OUT next_transactional boolean, OUT next_token uuid, OUT next_procedure text, OUT done_row jsonb' then
    drop function if exists asyncproc.run(bigint, text, text, integer, boolean);
  end if;
end
$guard$;
create or replace function asyncproc.run(
  execution_id bigint, worker text, next_queue text, row_cap integer default 100, with_row boolean default false,
  out done_seq bigint, out done_status text, out next_id bigint, out next_seq bigint, out next_timeout_ms integer,
  out next_transactional boolean, out next_token uuid, out next_procedure text, out done_row jsonb
)
language plpgsql as $$
declare
  call         record;
  ended        record;
  claimed      record;
  passed       boolean;
begin
  -- The call's lock at transaction level as well as the claim's session level: it then
  -- outlives the session-level unlock below until this transaction's outcome is committed
  -- (recover must never find the call RUNNING and unlocked while its outcome is on its way),
  -- and a procedure calling pg_advisory_unlock_all() cannot drop it. Not granted: another
  -- session runs the call (this one lost its lock), so this one must not touch it.
  if pg_try_advisory_xact_lock(asyncproc.lock_key1(execution_id), asyncproc.lock_key2(execution_id)) then
    -- by its key: `(status = 'RUNNING') is true` is not a condition the planner proves the partial
    -- index executions_active from, so it cannot prefer a walk of every RUNNING entry (each call's
    -- RUNNING version stays in that index until vacuumed: the walk grows with the drain)
    -- a cancel still open on the call is waited for: its flag is read below once committed
    -- (its signal may have found this session idle, before this statement; lock_key.sql)
    passed := asyncproc.pass_cancel_gate(execution_id);
    select e.arguments, r.proc, e.cancel_requested
      into call
      from asyncproc.executions e
      join asyncproc.procedures r on r.name = e.procedure
     where e.id = execution_id and (e.status = 'RUNNING') is true and e.backend_pid = pg_backend_pid();

    -- cancelled between its claim's commit and this statement: pg_cancel_backend found this
    -- session idle and cancelled nothing, so the request is honoured here, before the call
    -- starts, by the same way out as a cancelled statement (the worker then abandons it as
    -- cancelled; a plain RAISE of 57014 is not caught by run_call()'s handler either)
    if found and call.cancel_requested then
      raise exception 'canceling statement due to user request' using errcode = 'query_canceled';
    end if;

    if found then
      -- an assignment, not a query: the call is evaluated as a simple expression (no executor)
      ended := asyncproc.run_call(execution_id, call.proc, call.arguments, row_cap);
      run.done_seq := ended.done_seq;
      run.done_status := ended.done_status;
      if with_row then
        -- this transaction's own write: what its commit will make of the row
        select to_jsonb(e) into run.done_row from asyncproc.executions e where e.id = execution_id;
      end if;
    end if;
    perform pg_advisory_unlock(asyncproc.lock_key1(execution_id), asyncproc.lock_key2(execution_id));
  end if;

  if next_queue is not null then
    claimed := asyncproc.claim(next_queue, worker);
    run.next_id := claimed.id;
    run.next_seq := claimed.seq;
    run.next_timeout_ms := claimed.timeout_ms;
    run.next_transactional := claimed.transactional;
    run.next_token := claimed.token;
    run.next_procedure := claimed.procedure;
  end if;
end
$$;
