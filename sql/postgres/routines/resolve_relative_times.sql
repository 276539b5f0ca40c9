-- Date/time arguments naming a moment relative to now ('now', 'today', 'tomorrow',
-- 'yesterday', alone or with a time, also inside arrays) are resolved when the call is
-- submitted, and the resolved value is what the call records and runs with. Run time would
-- give a call that waits for its runAt, is held by its batch stage or is retried hours later
-- another day than its caller meant, and its arguments would not show what it ran with.
create or replace function asyncproc.resolve_relative_times(arguments jsonb, routine regprocedure) returns jsonb
language plpgsql as $$
declare
  param    record;
  resolved jsonb;
begin
  for param in
    select p.name, p.type_oid
      from asyncproc.parameters p
      join pg_type t on t.oid = p.type_oid
      left join pg_type elem on elem.oid = t.typelem and t.typcategory = 'A'
     where p.proc = routine and p.mode in ('IN', 'INOUT', 'VARIADIC') and arguments ? p.name
       and coalesce(elem.typcategory, t.typcategory) = 'D'   -- date, time, timestamp (with or without time zone)
       and (arguments ->> p.name) ~* '\m(now|today|tomorrow|yesterday)\M'
  loop
    execute format('select to_jsonb(%s)', asyncproc.argument_expression(param.name, param.type_oid))
       into resolved using arguments;
    arguments := jsonb_set(arguments, array[param.name], resolved);
  end loop;
  return arguments;
end
$$;
