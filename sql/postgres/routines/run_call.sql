-- Run one call under a savepoint of its own (the inner block's) and record its outcome (finish()):
-- a failing call's writes are undone by that savepoint and its error is recorded instead. The
-- outcome is written outside the block, by the caller's transaction, not a subtransaction.
-- QUERY_CANCELED (a cancel, the call's timeout) is not caught by WHEN OTHERS: it leaves the
-- statement, and the worker ends the call (abandon()). member_started, member_worker: see finish().
-- Used by run() for its call and by run_group() for each call after the group's first.
-- In a group (a member, or the group's first call: run_group sets asyncproc.grouped), a deadlock
-- or a serialization failure is the group's doing, not the call's: the group holds every lock of
-- its calls to its commit, so two groups taking rows in turn wait on each other where single
-- calls would not. It is not recorded as the call's failure but leaves the statement: the whole
-- group rolls back, and its worker gives its calls back and runs them one at a time.
create or replace function asyncproc.run_call(
  execution_id bigint, routine regprocedure, arguments jsonb, row_cap integer,
  member_started timestamptz default null, member_worker text default null,
  out done_seq bigint, out done_status text
)
language plpgsql as $$
declare
  outcome   jsonb;
  succeeded boolean := false;
  v_state   text;
  v_message text;
  v_detail  text;
  v_context text;
  ended     record;
begin
  begin
    outcome := asyncproc.call_routine(routine, arguments, row_cap);
    succeeded := true;
  exception when others then
    get stacked diagnostics v_state = returned_sqlstate, v_message = message_text,
                            v_detail = pg_exception_detail, v_context = pg_exception_context;
    if v_state in ('40P01', '40001') and (member_started is not null or current_setting('asyncproc.grouped', true) = 'on') then
      raise;
    end if;
  end;
  -- an assignment, not a query: evaluated as a simple expression (no executor)
  ended := asyncproc.finish(execution_id, succeeded, case when succeeded then outcome end,
                            v_state, v_message, nullif(v_detail, ''), nullif(v_context, ''), member_started, member_worker);
  run_call.done_seq := ended.done_seq;
  run_call.done_status := ended.done_status;
end
$$;
