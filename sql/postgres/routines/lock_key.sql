-- Session-level advisory locks tie a claim to the life of the worker's session.
create or replace function asyncproc.lock_key(execution_id bigint) returns integer
language sql immutable as $$ select (execution_id % 2147483647)::integer $$;
