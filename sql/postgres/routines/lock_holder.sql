-- The session holding a call's lock (the worker running it), from pg_locks: a call's
-- recorded backend_pid may be a dead worker's, since given to an unrelated backend.
create or replace function asyncproc.lock_holder(execution_id bigint) returns integer
language sql stable strict as $$
  select l.pid
    from asyncproc.lock_key(execution_id) k
    join pg_locks l on l.locktype = 'advisory' and l.granted and l.objsubid = 2
                   and l.classid = k.key1::oid and l.objid = k.key2::oid
   where l.database = (select oid from pg_database where datname = current_database())
   limit 1
$$;
