-- Why a routine may not be run as a call, or null when it may: read by register (which refuses
-- to register it, AP004) and by submit (which refuses a call of a registration an earlier release
-- made before register refused such routines, AP001).
--   * the service's own routines (schema asyncproc: submit, claim, purge, …) are its machinery;
--   * PostgreSQL's (pg_catalog, information_schema: pg_sleep, pg_terminate_backend, …) are the
--     server's: registered, any caller allowed to invoke could run them with the service's role.
create or replace function asyncproc.refused_routine(routine regprocedure) returns text
language sql stable set search_path = pg_catalog as $$
  select case
    when n.nspname = 'asyncproc' then 'one of the service''s own routines (schema asyncproc)'
    when n.nspname in ('pg_catalog', 'information_schema') then 'one of PostgreSQL''s own routines'
  end
  from pg_proc p join pg_namespace n on n.oid = p.pronamespace
  where p.oid = routine
$$;
