-- The advisory lock that ties a claimed call to the worker running it, keyed on the whole id
-- (a key taken modulo 2^31 made two calls 2^31-1 apart block each other). Two int4 keys:
-- key1 = 16-bit tag 'AS' in the high word | id >> 32, key2 = the low 32 bits of id, so
-- keys are unique for ids below 2^48 (about 280 trillion calls) and never meet the
-- int8-keyed locks (queue slots, migrations), which pg_locks lists with objsubid 1, not 2.
-- lock_key1 and lock_key2 are the two keys as plain SQL expressions, which the planner inlines:
-- a PL/pgSQL routine that passes them to pg_advisory_* evaluates the whole call as a simple
-- expression (no query, no executor). Reading them through lock_key (a row) took a query with
-- a function scan at each use, twice on every drained call.
create or replace function asyncproc.lock_key1(execution_id bigint) returns integer
language sql immutable strict as $$ select x'41530000'::integer | (execution_id >> 32)::integer $$;
create or replace function asyncproc.lock_key2(execution_id bigint) returns integer
language sql immutable strict as $$ select execution_id::bit(32)::integer $$;
drop function if exists asyncproc.lock_key(bigint);
create or replace function asyncproc.lock_key(execution_id bigint, out key1 integer, out key2 integer)
language sql immutable strict as $$
  select asyncproc.lock_key1(execution_id), asyncproc.lock_key2(execution_id)
$$;
