-- Does a JSON value convert to a parameter's type? (no exception, so no savepoint per call)
-- json and jsonb take any JSON value, a domain over them what its constraints take; an array of
-- them any JSON array whose elements their type takes. Other arrays: a JSON array of scalars,
-- or PostgreSQL's array text ('{{1,2},{3,4}}', the only way to a multi-dimensional array).
-- PL/pgSQL: asked for every argument of every submit, its plans are kept for the session (a SQL
-- function's body was planned again in each submit: 30 µs more for a call of 3 arguments).
create or replace function asyncproc.fits(value jsonb, type_oid oid) returns boolean
language plpgsql stable as $$
declare
  shape text := jsonb_typeof(value);
  t     record;
begin
  if value is null or shape = 'null' or type_oid in ('json'::regtype, 'jsonb'::regtype) then
    return true;
  end if;
  select p.typtype, p.typelem, p.typcategory into t from pg_type p where p.oid = type_oid;
  if not found then
    return null;
  end if;
  -- base_type only for a domain: any other type is its own
  if t.typtype = 'd' and asyncproc.base_type(type_oid) in ('json'::regtype, 'jsonb'::regtype) then
    return pg_input_is_valid(value::text, format_type(type_oid, null));
  end if;
  if shape = 'array' then
    if t.typelem = 0 or t.typcategory <> 'A' then
      return false;
    end if;
    if asyncproc.base_type(t.typelem) in ('json'::regtype, 'jsonb'::regtype) then
      return not exists (
        select 1 from jsonb_array_elements(value) e
         where jsonb_typeof(e) <> 'null' and not pg_input_is_valid(e::text, format_type(t.typelem, null)));
    end if;
    return not exists (
      select 1 from jsonb_array_elements(value) e
       where jsonb_typeof(e) in ('object', 'array')
          or (jsonb_typeof(e) <> 'null' and not pg_input_is_valid(e #>> '{}', format_type(t.typelem, null))));
  end if;
  if shape = 'object' then
    return false;
  end if;
  return pg_input_is_valid(value #>> '{}', format_type(type_oid, null));
end
$$;
