-- submit() for a call made on the caller's own transaction (the library's invoke(tx, call)):
-- a call the checks refuse (AP001 unknown procedure, AP002 invalid arguments, AP003 unknown
-- queue, AP004, AP005 forbidden, AP012 an idempotency key sent before with another call, AP013 one
-- another transaction holds; or an
-- argument PostgreSQL cannot read as its parameter's type, class 22, or that a domain's check
-- refuses as a hard error, 23514 or a RAISE, P0001, of a function it calls) is reported by its SQLSTATE, message and hint instead of raised. The exception block
-- is a subtransaction: what the refused submit wrote is rolled back to it alone, and the caller's
-- transaction goes on as it was. Raised, the refusal aborted the caller's transaction, and a
-- caller that caught it and committed got a ROLLBACK for everything it had done.
-- Anything else (permissions, a lost connection, a serialization failure) is raised as ever.
drop function if exists asyncproc.submit_or_refuse(text, jsonb, text, timestamptz, integer, text, boolean, text[]);
create or replace function asyncproc.submit_or_refuse(
  procedure text, arguments jsonb, queue text, run_at timestamptz, max_attempts integer, submitted_by text,
  quiet boolean, caller_roles text[], idempotency_key text default null,  -- default: a process of revision 5 sends 8
  out refused_code text, out refused_message text, out refused_hint text, out execution asyncproc.executions
)
language plpgsql as $$
begin
  begin
    execution := asyncproc.submit(procedure, arguments, queue, run_at, max_attempts, submitted_by, quiet,
                                  caller_roles => caller_roles, idempotency_key => idempotency_key);
  exception
    when sqlstate 'AP001' or sqlstate 'AP002' or sqlstate 'AP003' or sqlstate 'AP004' or sqlstate 'AP005' or sqlstate 'AP012' or sqlstate 'AP013'
         or data_exception or check_violation or raise_exception then
      get stacked diagnostics refused_code = returned_sqlstate, refused_message = message_text, refused_hint = pg_exception_hint;
      refused_hint := nullif(refused_hint, '');
  end;
end
$$;
