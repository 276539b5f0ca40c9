-- Register (or re-register, replacing its options) a routine as invocable.
-- roles: who may invoke it through the service (any one of them, or admin); empty: any caller.
-- transactional => false: its calls run with no transaction open (a procedure may COMMIT, commit
-- in chunks, run what cannot run in a transaction block); the outcome is recorded afterwards in
-- a transaction of its own, so effects and outcome no longer commit together (a run whose worker
-- is lost ends FAILED, never re-run). Last, so calls by position keep their meaning.
drop function if exists asyncproc.register(regprocedure, text, integer, integer);
drop function if exists asyncproc.register(text, text, integer, integer, text[]);
drop function if exists asyncproc.register(regprocedure, text, integer, integer, text[]);
-- The service's own routines and PostgreSQL's are not procedures to run as calls
-- (asyncproc.refused_routine says why): registering one is refused (AP004), whoever asks.
create or replace function asyncproc.register(
  routine regprocedure, queue text default 'default', max_attempts integer default 1, timeout_ms integer default null,
  roles text[] default '{}', transactional boolean default true
) returns text
language plpgsql as $$
declare
  registered text;
  refused    text;
  named      record;
  previous   record;
begin
  refused := asyncproc.refused_routine(routine);
  if refused is not null then
    raise exception '% is %, not a procedure to run as a call', routine::text, refused using errcode = 'AP004';
  end if;
  select n.nspname, p.proname, n.nspname || '.' || p.proname as name
    into named
    from pg_proc p join pg_namespace n on n.oid = p.pronamespace where p.oid = routine;
  -- a routine is called by schema.name: "a.b".c and a."b.c" would both be a.b.c
  if position('.' in named.nspname) > 0 or position('.' in named.proname) > 0 then
    raise exception '% cannot be registered: its schema or name holds a ".", so "%" would not name it alone', routine::text, named.name
      using errcode = 'AP004', hint = 'Rename it, or register a routine without a dot in its schema and name that calls it.';
  end if;
  -- the name registered for another routine that still exists (another overload of the name):
  -- its calls not yet ended were checked against that routine's parameters, and would run this
  -- one (a call of ov(integer) with 5 ran ov(text) with '5'); with none waiting, this one
  -- replaces it. A routine created anew with other parameters (the old one gone) is registered
  -- again at once, as a migration does it.
  select r.signature into previous
    from asyncproc.procedures r
   where r.name = named.name and r.signature is distinct from asyncproc.signature(routine)
     and to_regprocedure(r.signature) is not null;
  if found and exists (select 1 from asyncproc.executions e
                        where e.procedure = named.name and e.status not in ('SUCCEEDED', 'FAILED', 'CANCELLED')) then
    raise exception '"%" is registered for %, and calls of it have not ended: % would run them', named.name, previous.signature, routine::text
      using errcode = 'AP009', hint = 'Let them end (or cancel them) first; one routine of a name is registered at a time.';
  end if;
  insert into asyncproc.procedures (name, proc, signature, queue, max_attempts, timeout_ms, roles, transactional)
  values (named.name, routine, asyncproc.signature(routine), register.queue, register.max_attempts,
          register.timeout_ms, coalesce(register.roles, '{}'), coalesce(register.transactional, true))
  on conflict (name) do update
     set proc = excluded.proc, signature = excluded.signature, queue = excluded.queue,
         max_attempts = excluded.max_attempts, timeout_ms = excluded.timeout_ms, roles = excluded.roles,
         transactional = excluded.transactional, unregistered_at = null
  returning name into registered;
  return registered;
end
$$;

-- The same by name: a signature or a bare name, as asyncproc.resolve_routine reads it
-- (`select asyncproc.register('billing.charge_order')` when it has no overloads).
create or replace function asyncproc.register(
  routine text, queue text default 'default', max_attempts integer default 1, timeout_ms integer default null,
  roles text[] default '{}', transactional boolean default true
) returns text
language sql as $$
  select asyncproc.register(asyncproc.resolve_routine(routine), queue, max_attempts, timeout_ms, roles, transactional)
$$;
