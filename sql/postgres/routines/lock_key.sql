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
-- Dropped only when it is not the definition below (CREATE OR REPLACE cannot change its OUT
-- parameters): applied again as it is (an upgrade, a process of another version), it is replaced
-- in place and keeps its OID, so a worker inside it at that moment goes on. Dropped each time,
-- it failed every call then running (XX000: cache lookup failed for function).
do $guard$
begin
  if pg_get_function_arguments(to_regprocedure('asyncproc.lock_key(bigint)'))
     is distinct from 'execution_id bigint, OUT key1 integer, OUT key2 integer' then
    drop function if exists asyncproc.lock_key(bigint);
  end if;
end
$guard$;
create or replace function asyncproc.lock_key(execution_id bigint, out key1 integer, out key2 integer)
language sql immutable strict as $$
  select asyncproc.lock_key1(execution_id), asyncproc.lock_key2(execution_id)
$$;
-- The cancel gate of a call: an advisory lock of its own key (tag 'AC' in the high word, the
-- call's lock_key2 below), which cancel() and cancel_batch_running() take exclusively for their
-- transaction before they ask a RUNNING call to stop and signal its session. A signal that
-- finds the session idle (between its claim's commit and its run) cancels nothing; the run then
-- passes the gate before it reads cancel_requested: it waits while a cancel is open and reads
-- the flag once committed. Read without the gate, the flag was still false while the cancel was
-- open, and the call ran to its end with the cancel lost. (A lock of the row itself would be held
-- by the run until its commit, and every cancel would wait for the whole call.)
create or replace function asyncproc.cancel_key1(execution_id bigint) returns integer
language sql immutable strict as $$ select x'41430000'::integer | (execution_id >> 32)::integer $$;
-- Wait for any cancel of the call still open: take the gate shared, and let go at once (a lock
-- held for the run would make every cancel wait for the call's end). True once passed.
-- CASE: the unlock is evaluated after the lock (an OR or AND may be evaluated in either order).
create or replace function asyncproc.pass_cancel_gate(execution_id bigint) returns boolean
language sql strict as $$
  select case when pg_advisory_lock_shared(asyncproc.cancel_key1(execution_id), asyncproc.lock_key2(execution_id)) is null then false
              else pg_advisory_unlock_shared(asyncproc.cancel_key1(execution_id), asyncproc.lock_key2(execution_id)) end
$$;
-- Close the gate until this transaction ends (cancel, cancel_batch_running). True once closed.
create or replace function asyncproc.close_cancel_gate(execution_id bigint) returns boolean
language sql strict as $$
  select pg_advisory_xact_lock(asyncproc.cancel_key1(execution_id), asyncproc.lock_key2(execution_id)) is not null
$$;
-- The advisory lock of an idempotency key (submit): the two int4 keys of lock_key1/lock_key2's
-- space with the tag 'IK' in the high word of key1 (calls are 'AS': they never meet), and 48 bits
-- of a 64-bit hash of the caller and the key. Two keys whose hashes agree in those bits would only
-- make one of them wait for the other's transaction to end (AP013), never mix their calls.
create or replace function asyncproc.key_lock1(submitted_by text, idempotency_key text) returns integer
language sql immutable as $$
  select x'494B0000'::integer | ((pg_catalog.hashtextextended(coalesce(submitted_by, '') || chr(1) || idempotency_key, 0) >> 32) & 65535)::integer
$$;
create or replace function asyncproc.key_lock2(submitted_by text, idempotency_key text) returns integer
language sql immutable as $$
  select pg_catalog.hashtextextended(coalesce(submitted_by, '') || chr(1) || idempotency_key, 0)::bit(32)::integer
$$;
