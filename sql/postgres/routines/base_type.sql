-- The type a domain is built on, through domains over domains; any other type is its own.
-- What a value of the domain is, to the conversions of arguments and results: a domain over
-- jsonb is JSON (never text read again as JSON), a domain over a composite type is a row.
create or replace function asyncproc.base_type(type_oid oid) returns oid
language sql stable as $$
  with recursive chain (oid, typtype, typbasetype) as (
    select t.oid, t.typtype, t.typbasetype from pg_type t where t.oid = type_oid
    union all
    select t.oid, t.typtype, t.typbasetype from pg_type t join chain c on t.oid = c.typbasetype where c.typtype = 'd'
  )
  select c.oid from chain c where c.typtype <> 'd'
$$;
