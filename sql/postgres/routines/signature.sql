-- A routine's signature as text that to_regprocedure() resolves under any search_path
-- (every schema spelled out), stored with its registration.
create or replace function asyncproc.signature(routine regprocedure) returns text
language sql stable set search_path = pg_catalog as $$
  select routine::text
$$;
