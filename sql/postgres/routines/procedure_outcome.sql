-- A procedure's outcome from its output row as JSON (null: it has no OUT/INOUT parameters).
create or replace function asyncproc.procedure_outcome(outputs jsonb) returns jsonb
language sql immutable as $$
  select jsonb_build_object('returnValue', null, 'outputParameters', outputs,
                            'rows', null, 'rowCount', null, 'truncated', false)
$$;
