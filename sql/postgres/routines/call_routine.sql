-- Call a registered routine with its arguments (a JSON object keyed by parameter name,
-- bound as $1, never spliced) and return its outcome:
-- {returnValue, outputParameters, rows, rowCount, truncated}.
-- Errors propagate: run() records them. Being a function, it runs the call inside the
-- caller's transaction; a non-transactional call is sent by the worker itself (prepare_call).
--
-- Building the statement reads the catalog (most of the database's work for a short call), yet
-- it depends only on the routine, the names of the arguments present and row_cap: the session
-- keeps the last one per registered routine and row cap in a setting of its own. An entry holds
-- the registration's signature and the routine it resolved to, and serves only while that
-- signature still resolves to that routine (a routine dropped and created again, renamed or
-- moved is looked up afresh); CREATE OR REPLACE cannot change what the statement relies on
-- (parameter names and types, OUT parameters, return type, kind). Set inside the caller's
-- transaction, an entry goes with its rollback: a lost entry is only built again.
create or replace function asyncproc.call_routine(routine regprocedure, arguments jsonb, row_cap integer)
returns jsonb
language plpgsql as $$
declare
  cache_name text := 'asyncproc.call_' || routine::oid || '_' || row_cap;
  names      text := jsonb_path_query_array(arguments, '$.keyvalue().key')::text;
  -- '' once a rollback undid the first setting of it
  cached     jsonb := nullif(current_setting(cache_name, true), '')::jsonb;
  statement  text;
  kind       "char";
  outputs    boolean;   -- a procedure with OUT or INOUT parameters (its call yields a row)
  signature  text;
  output     record;
  outcome    jsonb;
begin
  if cached is not null and cached ->> 'names' = names
     and to_regprocedure(cached ->> 'signature') = (cached ->> 'resolved')::oid then
    statement := cached ->> 'statement';
    kind := cached ->> 'kind';
    outputs := (cached ->> 'outputs')::boolean;
  else
    select s.statement, s.kind, s.outputs is not null into statement, kind, outputs
      from asyncproc.call_statement(routine, arguments, row_cap) s;
    -- only registrations with a signature (all but those older than the column) are kept
    select r.signature into signature from asyncproc.procedures r where r.proc = routine;
    if signature is not null then
      perform set_config(cache_name, jsonb_build_object(
        'names', names, 'signature', signature, 'resolved', to_regprocedure(signature)::oid,
        'statement', statement, 'kind', kind, 'outputs', outputs)::text, false);
    end if;
  end if;
  if kind <> 'p' then
    execute statement into outcome using arguments;
    return outcome;
  end if;
  if not outputs then
    execute statement using arguments;
    return asyncproc.procedure_outcome(null);
  end if;
  execute statement into output using arguments;
  return asyncproc.procedure_outcome(to_jsonb(output));
end
$$;
