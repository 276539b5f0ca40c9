-- The statement of a claimed non-transactional call, for its worker to send at top level (no
-- transaction open: a procedure may COMMIT), with the arguments to bind as $1 (null: the
-- statement takes no parameter). kind 'p': a procedure, whose output row (if any) the worker
-- hands to conclude(); else a function, whose statement yields its outcome. No row: the call
-- is not this session's to run (its lock was lost and recover took it).
create or replace function asyncproc.prepare_call(
  execution_id bigint, row_cap integer default 100,
  out statement text, out arguments jsonb, out kind "char"
)
returns setof record
language plpgsql as $$
declare
  call   record;
  passed boolean;
begin
  if not pg_try_advisory_xact_lock(asyncproc.lock_key1(execution_id), asyncproc.lock_key2(execution_id)) then
    return;
  end if;
  -- a cancel still open on the call is waited for, its flag read once committed (lock_key.sql).
  -- A cancel that begins after this read and signals while the worker is between this
  -- statement's answer and the call's own statement (one round trip) finds it idle: the
  -- service signals again while it waits (cancel_resignal.sql).
  passed := asyncproc.pass_cancel_gate(execution_id);
  select e.arguments, r.proc, e.cancel_requested into call
    from asyncproc.executions e
    join asyncproc.procedures r on r.name = e.procedure
   where e.id = execution_id and (e.status = 'RUNNING') is true and e.backend_pid = pg_backend_pid();
  if not found then
    return;
  end if;
  -- cancelled between its claim and now (the signal found this session idle): fail as a
  -- cancelled statement, before the call starts; conclude() then records it CANCELLED
  if call.cancel_requested then
    raise exception 'canceling statement due to user request' using errcode = 'query_canceled';
  end if;
  select s.statement, case when s.binds then call.arguments end, s.kind
    into prepare_call.statement, prepare_call.arguments, prepare_call.kind
    from asyncproc.call_statement(call.proc, call.arguments, row_cap) s;
  return next;
end
$$;
