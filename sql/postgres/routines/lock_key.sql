-- The advisory lock that ties a claimed call to the worker running it, keyed on the whole id
-- (a key taken modulo 2^31 made two calls 2^31-1 apart block each other). Two int4 keys:
-- key1 = 16-bit tag 'AS' in the high word | id >> 32, key2 = the low 32 bits of id, so
-- keys are unique for ids below 2^48 (about 280 trillion calls) and never meet the
-- int8-keyed locks (queue slots, migrations), which pg_locks lists with objsubid 1, not 2.
drop function if exists asyncproc.lock_key(bigint);
create or replace function asyncproc.lock_key(execution_id bigint, out key1 integer, out key2 integer)
language sql immutable strict as $$
  select x'41530000'::integer | (execution_id >> 32)::integer, execution_id::bit(32)::integer
$$;
