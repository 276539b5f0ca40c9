-- Register (or re-register, replacing its options) a routine as invocable.
-- roles: who may invoke it through the service (any one of them, or admin); empty: any caller.
drop function if exists asyncproc.register(regprocedure, text, integer, integer);
create or replace function asyncproc.register(
  routine regprocedure, queue text default 'default', max_attempts integer default 1, timeout_ms integer default null,
  roles text[] default '{}'
) returns text
language sql as $$
  insert into asyncproc.procedures (name, proc, signature, queue, max_attempts, timeout_ms, roles)
  select n.nspname || '.' || p.proname, routine, asyncproc.signature(routine), register.queue, register.max_attempts,
         register.timeout_ms, coalesce(register.roles, '{}')
    from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where p.oid = routine
  on conflict (name) do update
     set proc = excluded.proc, signature = excluded.signature, queue = excluded.queue,
         max_attempts = excluded.max_attempts, timeout_ms = excluded.timeout_ms, roles = excluded.roles,
         unregistered_at = null
  returning name
$$;

-- The same by name: a signature or a bare name, as asyncproc.resolve_routine reads it
-- (`select asyncproc.register('billing.charge_order')` when it has no overloads).
create or replace function asyncproc.register(
  routine text, queue text default 'default', max_attempts integer default 1, timeout_ms integer default null,
  roles text[] default '{}'
) returns text
language sql as $$
  select asyncproc.register(asyncproc.resolve_routine(routine), queue, max_attempts, timeout_ms, roles)
$$;
