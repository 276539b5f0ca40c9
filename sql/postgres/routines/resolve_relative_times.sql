-- Date/time arguments (also inside arrays) are resolved when the call is submitted, in the
-- caller's session, and the resolved value (ISO 8601, an offset with every timestamptz) is what
-- the call records and runs with:
-- * a moment relative to now ('now', 'today', 'tomorrow', 'yesterday', alone or with a time):
--   run time would give a call that waits for its runAt, is held by its batch stage or is
--   retried hours later another day than its caller meant;
-- * text read by the caller's TimeZone and DateStyle ('2024-06-01 12:00' with no offset,
--   '01/02/2024'): the worker's session, which runs the call, may have others (a SQL or library
--   caller's session set to Asia/Tokyo and DMY, the service's to UTC and MDY), and the call ran
--   9 hours off, or on 2 January instead of 1 February.
-- Its arguments then also show what it ran with.
-- Dates and times inside a range, a multirange or a composite (at any depth: holds_time) too: such
-- a value is read by its type's input in the caller's session, and kept as its text in ISO 8601
-- (iso_text), which any session reads back the same ('[now,infinity)' ran with the moment it ran,
-- and a composite's field with the worker's TimeZone).
create or replace function asyncproc.resolve_relative_times(arguments jsonb, routine regprocedure) returns jsonb
language plpgsql as $$
declare
  param    record;
  resolved jsonb;
begin
  for param in
    select p.name, p.type_oid,
           coalesce(elem.typcategory, t.typcategory) = 'D' as plain   -- date, time, timestamp (with or without time zone), arrays of them
      from asyncproc.parameters p
      join pg_type t on t.oid = p.type_oid
      left join pg_type elem on elem.oid = t.typelem and t.typcategory = 'A'
     where p.proc = routine and p.mode in ('IN', 'INOUT', 'VARIADIC') and arguments ? p.name
       and jsonb_typeof(arguments -> p.name) <> 'null'      -- jsonb_set would make the whole object null
       and asyncproc.holds_time(p.type_oid)
  loop
    execute format(case when param.plain then 'select to_jsonb(%s)' else 'select to_jsonb(asyncproc.iso_text(%s))' end,
                   asyncproc.argument_expression(param.name, param.type_oid))
       into resolved using arguments;
    arguments := jsonb_set(arguments, array[param.name], resolved);
  end loop;
  return arguments;
end
$$;
