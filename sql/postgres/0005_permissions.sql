-- Callers reach asyncproc only through asyncproc.invoke and asyncproc.invoke_batch: both
-- are SECURITY DEFINER (their routine files say so), so a caller needs USAGE on the schema
-- and EXECUTE on them, and never a right on a table. Everything else belongs to the role
-- that runs the service (and its migrations). A DBA grants a caller:
--   grant usage on schema asyncproc to app_role;
--   grant execute on function asyncproc.invoke(text, jsonb, text, timestamptz, integer, text),
--                             asyncproc.invoke_batch(jsonb, text, text) to app_role;
-- No role is created here: roles are cluster-wide, so a ready-made one would open every
-- asyncproc database on the cluster at once, and the service's role seldom has CREATEROLE.

-- PostgreSQL grants EXECUTE on every new function to PUBLIC: without this, a role with
-- USAGE on the schema could call claim, run, finish, register, configure_queue…
-- A per-schema ALTER DEFAULT PRIVILEGES cannot take that grant back (and a global one would
-- reach the owner's functions in every schema), so the migrator repeats this revoke in each
-- transaction that creates routines (CLOSE_ROUTINES in src/engines/postgres/migrator.ts).
revoke execute on all routines in schema asyncproc from public;

-- Nothing is granted to PUBLIC on tables, sequences or the schema by default; say so
-- anyway, so an install where someone did is closed too.
revoke all on all tables in schema asyncproc from public;
revoke all on all sequences in schema asyncproc from public;
revoke all on schema asyncproc from public;
