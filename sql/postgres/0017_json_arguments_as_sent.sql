-- Routines revision 5 passes a json or jsonb value as it was sent: to a domain over json/jsonb,
-- and as each element of an array of json/jsonb (or of domains over them). Revision 4 read
-- those values as text first: a string's content was parsed as JSON (the string "1" ran as the
-- number 1; a domain over jsonb took an object only as JSON text in a string, "{\"a\":1}").
-- The calls still to run and the schedules stored by revision 4 hold such strings: rewritten
-- here to the values revision 4 would have passed, so that they run as they were meant to (with
-- the strings left as they were, they would now run with strings, or fail a domain's check).
-- Finished calls keep what they were sent. Revision 4 refused, at submit, a string that did not
-- parse as the parameter's type, so every string rewritten here parses; one that does not is kept.
create function pg_temp.base_type(type_oid oid) returns oid
language sql stable as $$
  with recursive chain (oid, typtype, typbasetype) as (
    select t.oid, t.typtype, t.typbasetype from pg_type t where t.oid = type_oid
    union all
    select t.oid, t.typtype, t.typbasetype from pg_type t join chain c on t.oid = c.typbasetype where c.typtype = 'd'
  )
  select c.oid from chain c where c.typtype <> 'd'
$$;

-- a JSON string's content read as JSON, as revision 4 read it (kept when it does not parse)
create function pg_temp.read_as_json(value jsonb) returns jsonb
language sql immutable as $$
  select case when jsonb_typeof(value) = 'string' and pg_input_is_valid(value #>> '{}', 'jsonb')
              then (value #>> '{}')::jsonb else value end
$$;

-- one argument's value, as revision 4 passed it to a parameter of type `type_oid`
create function pg_temp.as_revision_4(value jsonb, type_oid oid) returns jsonb
language sql stable as $$
  select case
    when t.typtype = 'd' and pg_temp.base_type(t.oid) in ('json'::regtype, 'jsonb'::regtype) then pg_temp.read_as_json(value)
    when t.typcategory = 'A' and t.typelem <> 0 and jsonb_typeof(value) = 'array'
         and pg_temp.base_type(t.typelem) in ('json'::regtype, 'jsonb'::regtype) then
      (select jsonb_agg(pg_temp.read_as_json(e) order by n) from jsonb_array_elements(value) with ordinality x (e, n))
    else value
  end
  from pg_type t where t.oid = type_oid
$$;

-- a call's arguments, each by its parameter of the registered routine (an unknown key as it is)
create function pg_temp.arguments_as_revision_4(arguments jsonb, procedure_name text) returns jsonb
language sql stable as $$
  select coalesce(jsonb_object_agg(a.key, coalesce(pg_temp.as_revision_4(a.value, p.type_oid), a.value)), arguments)
    from jsonb_each(case when jsonb_typeof(arguments) = 'object' then arguments else '{}' end) a
    left join asyncproc.procedures r on r.name = procedure_name
    left join asyncproc.parameters p
           on p.proc = coalesce(to_regprocedure(r.signature), r.proc) and p.name = a.key
          and p.mode in ('IN', 'INOUT', 'VARIADIC')
$$;

update asyncproc.executions e
   set arguments = pg_temp.arguments_as_revision_4(e.arguments, e.procedure)
 where e.status not in ('SUCCEEDED', 'FAILED', 'CANCELLED')
   and e.arguments is distinct from pg_temp.arguments_as_revision_4(e.arguments, e.procedure);

update asyncproc.schedules s
   set arguments = pg_temp.arguments_as_revision_4(s.arguments, s.procedure)
 where s.arguments is distinct from pg_temp.arguments_as_revision_4(s.arguments, s.procedure);

drop function pg_temp.arguments_as_revision_4(jsonb, text);
drop function pg_temp.as_revision_4(jsonb, oid);
drop function pg_temp.read_as_json(jsonb);
drop function pg_temp.base_type(oid);
