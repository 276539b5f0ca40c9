-- Does a JSON value convert to a parameter's type? (no exception, so no savepoint per call)
-- json and jsonb take any JSON value, a domain over them what its constraints take; an array of
-- them any JSON array whose elements their type takes. Other arrays: a JSON array of scalars,
-- or PostgreSQL's array text ('{{1,2},{3,4}}', the only way to a multi-dimensional array).
-- PL/pgSQL: asked for every argument of every submit, its plans are kept for the session (a SQL
-- function's body was planned again in each submit: 30 µs more for a call of 3 arguments).
-- Types are named by format_type(oid, -1), as argument_expression casts to them: a parameter has
-- no type modifier, and format_type(oid, null) names character and bit as SQL reads those words,
-- character(1) and bit(1), which refused "USD" for a char(3) parameter (it runs as bpchar).
-- A JSON null is a NULL of the type: a domain's NOT NULL or CHECK may refuse it (takes_null),
-- as it would at run time.
create or replace function asyncproc.fits(value jsonb, type_oid oid) returns boolean
language plpgsql stable as $$
declare
  shape text := jsonb_typeof(value);
  t     record;
begin
  if type_oid in ('json'::regtype, 'jsonb'::regtype) then
    return true;
  end if;
  select p.typtype, p.typelem, p.typcategory into t from pg_type p where p.oid = type_oid;
  if not found then
    return null;
  end if;
  if value is null or (shape = 'null' and not (t.typtype = 'd' and asyncproc.base_type(type_oid) in ('json'::regtype, 'jsonb'::regtype))) then
    return t.typtype <> 'd' or asyncproc.takes_null(type_oid);
  end if;
  -- base_type only for a domain: any other type is its own
  if t.typtype = 'd' and asyncproc.base_type(type_oid) in ('json'::regtype, 'jsonb'::regtype) then
    return pg_input_is_valid(value::text, format_type(type_oid, -1));
  end if;
  if shape = 'array' then
    if t.typelem = 0 or t.typcategory <> 'A' then
      return false;
    end if;
    if asyncproc.base_type(t.typelem) in ('json'::regtype, 'jsonb'::regtype) then
      return not exists (
        select 1 from jsonb_array_elements(value) e
         where jsonb_typeof(e) <> 'null' and not pg_input_is_valid(e::text, format_type(t.typelem, -1)));
    end if;
    return not exists (
      select 1 from jsonb_array_elements(value) e
       where jsonb_typeof(e) in ('object', 'array')
          or (jsonb_typeof(e) <> 'null' and not pg_input_is_valid(e #>> '{}', format_type(t.typelem, -1))))
       -- a null element is a NULL of the element type (not asked when there is none)
       and not (value @> '[null]' and (select e.typtype = 'd' from pg_type e where e.oid = t.typelem)
                and not asyncproc.takes_null(t.typelem));
  end if;
  if shape = 'object' then
    return false;
  end if;
  -- regclass: the run casts text, which takes a name only (text_regclass); its input function
  -- also takes a number (an oid), which the run would then look for as a name
  if type_oid = 'regclass'::regtype and value #>> '{}' ~ E'^\\s*[0-9]+\\s*$' then
    return false;
  end if;
  return pg_input_is_valid(value #>> '{}', format_type(type_oid, -1));
end
$$;
