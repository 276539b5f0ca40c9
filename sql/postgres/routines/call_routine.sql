-- Call a registered routine with its arguments (a JSON object keyed by parameter name,
-- bound as $1, never spliced) and return its outcome:
-- {returnValue, outputParameters, rows, rowCount, truncated}.
-- Errors propagate: run() records them. Being a function, it runs the call inside the
-- caller's transaction; a non-transactional call is sent by the worker itself (prepare_call).
create or replace function asyncproc.call_routine(routine regprocedure, arguments jsonb, row_cap integer)
returns jsonb
language plpgsql as $$
declare
  call    record;
  output  record;
  outcome jsonb;
begin
  select * into call from asyncproc.call_statement(routine, arguments, row_cap);
  if call.kind <> 'p' then
    execute call.statement into outcome using arguments;
    return outcome;
  end if;
  if call.outputs is null then
    execute call.statement using arguments;
    return asyncproc.procedure_outcome(null);
  end if;
  execute call.statement into output using arguments;
  return asyncproc.procedure_outcome(to_jsonb(output));
end
$$;
