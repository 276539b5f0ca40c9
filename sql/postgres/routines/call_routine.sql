-- Call a registered routine with its arguments (a JSON object keyed by parameter name,
-- bound as $1, never spliced) and return its outcome:
-- {returnValue, outputParameters, rows, rowCount, truncated}.
-- Errors propagate: run() records them.
create or replace function asyncproc.call_routine(routine regprocedure, arguments jsonb, row_cap integer)
returns jsonb
language plpgsql as $$
declare
  reg_name     text;
  reg_sig      text;
  resolved     regprocedure;
  target       record;
  args_sql     text;
  out_names    text[];
  statement    text;
  output       record;
  returned     jsonb;
  row_count    bigint;
begin
  -- `routine` is the oid stored at registration; a routine dropped and created again has a new one
  select r.name, r.signature, asyncproc.current_routine(r.proc, r.signature)
    into reg_name, reg_sig, resolved
    from asyncproc.procedures r where r.proc = routine;
  if not found then
    resolved := (select p.oid::regprocedure from pg_proc p where p.oid = routine);
  end if;
  if resolved is null then
    raise exception 'procedure "%" no longer exists in the database (registered as %)',
                    coalesce(reg_name, routine::text), coalesce(reg_sig, routine::text)
      using errcode = 'undefined_function', hint = 'Create it again, or register the routine that replaced it.';
  end if;

  select p.oid as proc, p.prokind, p.proretset, p.prorettype, format('%I.%I', n.nspname, p.proname) as name
    into target
    from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where p.oid = resolved;

  -- every OUT and INOUT parameter is an output, also an INOUT one left to its default
  select string_agg(format('%I => %s', pa.name,
                      case when pa.mode = 'OUT' then format('null::%s', pa.type_name)
                           else asyncproc.argument_expression(pa.name, pa.type_oid) end), ', ' order by pa.position)
           filter (where (pa.mode in ('IN', 'INOUT', 'VARIADIC') and arguments ? pa.name)
                      or (pa.mode = 'OUT' and target.prokind = 'p')),
         array_agg(pa.name order by pa.position) filter (where pa.mode in ('OUT', 'INOUT'))
    into args_sql, out_names
    from asyncproc.parameters pa
   where pa.proc = target.proc;
  args_sql := coalesce(args_sql, '');

  if target.prokind = 'p' then
    statement := format('call %s(%s)', target.name, args_sql);
    if out_names is null then
      execute statement using arguments;
    else
      execute statement into output using arguments;
    end if;
    return jsonb_build_object('returnValue', null, 'outputParameters', case when out_names is not null then to_jsonb(output) end,
                              'rows', null, 'rowCount', null, 'truncated', false);
  end if;

  if target.proretset then
    -- every row is counted, only the first row_cap are kept (to_jsonb runs only for those)
    statement := format('select coalesce(jsonb_agg(to_jsonb(r.t) order by r.n) filter (where r.n <= %s), ''[]''), count(*)
                           from (select row_number() over () as n, t from (select * from %s(%s)) t) r',
                        row_cap, target.name, args_sql);
    execute statement into returned, row_count using arguments;
    return jsonb_build_object('returnValue', null, 'outputParameters', null,
                              'rows', returned, 'rowCount', row_count, 'truncated', row_count > row_cap);
  end if;

  -- one row: its columns are the OUT parameters (or a composite's fields), else the one return value
  statement := format('select to_jsonb(t) from (select * from %s(%s)) t', target.name, args_sql);
  execute statement into returned using arguments;
  if out_names is not null or (select typtype = 'c' from pg_type where oid = target.prorettype) then
    return jsonb_build_object('returnValue', null, 'outputParameters', returned,
                              'rows', null, 'rowCount', null, 'truncated', false);
  end if;
  return jsonb_build_object('returnValue', (select v from jsonb_each(returned) x (k, v) limit 1), 'outputParameters', null,
                            'rows', null, 'rowCount', null, 'truncated', false);
end
$$;
