-- Call a registered routine with its arguments (a JSON object keyed by parameter name,
-- bound as $1, never spliced) and return its outcome: {returnValue, outputParameters, rows}.
-- Errors propagate: run() records them.
create or replace function asyncproc.call_routine(routine regprocedure, arguments jsonb, row_cap integer)
returns jsonb
language plpgsql as $$
declare
  target    record;
  args_sql  text;
  out_names text[];
  statement text;
  outcome   jsonb;
  output    record;
begin
  select p.oid as proc, p.prokind, p.proretset, p.prorettype, format('%I.%I', n.nspname, p.proname) as name
    into target
    from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where p.oid = routine;

  select string_agg(format('%I => %s', pa.name,
                      case when pa.mode = 'OUT' then format('null::%s', pa.type_name)
                           else asyncproc.argument_expression(pa.name, pa.type_oid) end), ', ' order by pa.position),
         array_agg(pa.name order by pa.position) filter (where pa.mode in ('OUT', 'INOUT'))
    into args_sql, out_names
    from asyncproc.parameters pa
   where pa.proc = target.proc
     and ((pa.mode in ('IN', 'INOUT', 'VARIADIC') and arguments ? pa.name)
          or (pa.mode = 'OUT' and target.prokind = 'p'));

  if target.prokind = 'p' then
    statement := format('call %s(%s)', target.name, coalesce(args_sql, ''));
    if out_names is null then
      execute statement using arguments;
      outcome := jsonb_build_object('returnValue', null, 'outputParameters', null, 'rows', null);
    else
      execute statement into output using arguments;
      outcome := jsonb_build_object('returnValue', null, 'outputParameters', to_jsonb(output), 'rows', null);
    end if;
  else
    statement := format('select coalesce(jsonb_agg(to_jsonb(t)), ''[]'') from (select * from %s(%s) limit %s) t',
                        target.name, coalesce(args_sql, ''), row_cap);
    execute statement into outcome using arguments;
    outcome := case
      when target.proretset then jsonb_build_object('returnValue', null, 'outputParameters', null, 'rows', outcome)
      when out_names is not null or (select typtype = 'c' from pg_type where oid = target.prorettype)
        then jsonb_build_object('returnValue', null, 'outputParameters', outcome -> 0, 'rows', null)
      else jsonb_build_object('returnValue', (select v from jsonb_each(outcome -> 0) x (k, v) limit 1),
                              'outputParameters', null, 'rows', null)
    end;
  end if;
  return outcome;
end
$$;
