-- The statement that calls a routine with `arguments` (those present are passed, the others
-- left to their defaults), their values read from $1 (the arguments object,
-- bound, never spliced), for both ways a call runs: EXECUTEd inside asyncproc.run
-- (call_routine) and sent at top level by the worker (prepare_call), where a procedure may
-- COMMIT. A function's statement yields one value, the whole outcome
-- {returnValue, outputParameters, rows, rowCount, truncated}; a procedure's yields its output
-- row (none without OUT/INOUT parameters: outputs is null), which procedure_outcome shapes.
-- binds: whether the statement reads $1 at all (a statement without it takes no parameter).
create or replace function asyncproc.call_statement(
  routine regprocedure, arguments jsonb, row_cap integer,
  out statement text, out kind "char", out outputs text[], out binds boolean
)
language plpgsql stable as $$
declare
  reg_name     text;
  reg_sig      text;
  resolved     regprocedure;
  target       record;
  args_sql     text;
  composite    boolean;
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
  kind := target.prokind;

  -- every OUT and INOUT parameter is an output, also an INOUT one left to its default
  -- a VARIADIC parameter is given its whole array, so marked (`VARIADIC name => array`: without
  -- the mark, PostgreSQL looks for a routine whose last parameter is the element type, and finds none)
  select string_agg(format('%s%I => %s', case when pa.mode = 'VARIADIC' then 'VARIADIC ' else '' end, pa.name,
                      case when pa.mode = 'OUT' then format('null::%s', pa.type_name)
                           else asyncproc.argument_expression(pa.name, pa.type_oid) end), ', ' order by pa.position)
           filter (where (pa.mode in ('IN', 'INOUT', 'VARIADIC') and arguments ? pa.name)
                      or (pa.mode = 'OUT' and target.prokind = 'p')),
         array_agg(pa.name order by pa.position) filter (where pa.mode in ('OUT', 'INOUT')),
         coalesce(bool_or(pa.mode in ('IN', 'INOUT', 'VARIADIC') and arguments ? pa.name), false)
    into args_sql, outputs, binds
    from asyncproc.parameters pa
   where pa.proc = target.proc;
  args_sql := coalesce(args_sql, '');

  if target.prokind = 'p' then
    statement := format('call %s(%s)', target.name, args_sql);
  elsif target.proretset then
    -- every row is counted, only the first row_cap are kept (to_jsonb runs only for those)
    statement := format('select jsonb_build_object(''returnValue'', null, ''outputParameters'', null,
                                  ''rows'', coalesce(jsonb_agg(to_jsonb(r.t) order by r.n) filter (where r.n <= %1$s), ''[]''),
                                  ''rowCount'', count(*), ''truncated'', count(*) > %1$s) as outcome
                           from (select row_number() over () as n, t from (select * from %2$s(%3$s)) t) r',
                        row_cap, target.name, args_sql);
  else
    -- one row: its columns are the OUT parameters (or a composite's fields, a domain over a
    -- composite type's too: FROM expands it as well), else the one return value
    composite := outputs is not null or (select typtype = 'c' from pg_type where oid = asyncproc.base_type(target.prorettype));
    statement := format('select jsonb_build_object(''returnValue'', %s, ''outputParameters'', %s,
                                  ''rows'', null, ''rowCount'', null, ''truncated'', false) as outcome
                           from (select * from %s(%s)) t',
                        case when composite then 'null' else '(select v from jsonb_each(to_jsonb(t)) x (k, v) limit 1)' end,
                        case when composite then 'to_jsonb(t)' else 'null' end,
                        target.name, args_sql);
  end if;
end
$$;
