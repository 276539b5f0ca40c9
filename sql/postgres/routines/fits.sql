-- Does a JSON value convert to a parameter's type? (no exception, so no savepoint per call)
-- json and jsonb take any JSON value, a domain over them what its constraints take; an array of
-- them any JSON array whose elements their type takes. Other arrays: a JSON array of scalars,
-- or PostgreSQL's array text ('{{1,2},{3,4}}', the only way to a multi-dimensional array).
create or replace function asyncproc.fits(value jsonb, type_oid oid) returns boolean
language sql stable as $$
  select case
    when value is null or jsonb_typeof(value) = 'null' then true
    when asyncproc.base_type(type_oid) in ('json'::regtype, 'jsonb'::regtype) then
      type_oid in ('json'::regtype, 'jsonb'::regtype) or pg_input_is_valid(value::text, format_type(type_oid, null))
    when jsonb_typeof(value) = 'array' and t.typelem <> 0 and t.typcategory = 'A'
         and asyncproc.base_type(t.typelem) in ('json'::regtype, 'jsonb'::regtype) then
      not exists (
        select 1 from jsonb_array_elements(value) e
        where jsonb_typeof(e) <> 'null' and not pg_input_is_valid(e::text, format_type(t.typelem, null)))
    when jsonb_typeof(value) = 'array' then
      t.typelem <> 0 and t.typcategory = 'A' and not exists (
        select 1 from jsonb_array_elements(value) e
        where jsonb_typeof(e) in ('object', 'array')
           or (jsonb_typeof(e) <> 'null' and not pg_input_is_valid(e #>> '{}', format_type(t.typelem, null))))
    when jsonb_typeof(value) = 'object' then false
    else pg_input_is_valid(value #>> '{}', format_type(type_oid, null))
  end
  from pg_type t where t.oid = type_oid
$$;
