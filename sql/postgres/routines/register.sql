-- Register (or re-register) a routine as invocable.
create or replace function asyncproc.register(
  routine regprocedure, queue text default 'default', max_attempts integer default 1, timeout_ms integer default null
) returns text
language sql as $$
  insert into asyncproc.procedures (name, proc, signature, queue, max_attempts, timeout_ms)
  select n.nspname || '.' || p.proname, routine, asyncproc.signature(routine), register.queue, register.max_attempts,
         register.timeout_ms
    from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where p.oid = routine
  on conflict (name) do update
     set proc = excluded.proc, signature = excluded.signature, queue = excluded.queue,
         max_attempts = excluded.max_attempts, timeout_ms = excluded.timeout_ms
  returning name
$$;
