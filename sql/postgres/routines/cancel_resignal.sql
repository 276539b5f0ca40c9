-- Signal again the worker of a RUNNING call whose cancel was asked (committed) and is not yet
-- honoured; the service calls it while it waits for the call to end. For a call run outside a
-- transaction: cancel()'s signal may find its worker idle between prepare_call()'s answer and
-- the call's own statement (one round trip), and nothing reads the flag after that. Signalled
-- only while the worker (the call's lock holder) is running a statement, and from this
-- statement while it holds the call's row: the worker cannot record the call's end (conclude()
-- waits for the row) and so cannot move on to another call, so whatever the signal stops belongs
-- to this call (its statement; or conclude() in its wait, which the worker retries). Returns
-- whether it signalled.
create or replace function asyncproc.cancel_resignal(cancel_token uuid) returns boolean
language plpgsql as $$
declare
  target record;
begin
  select e.id, e.backend_pid into target
    from asyncproc.executions e
   where e.token = cancel_token and (e.status = 'RUNNING') is true and e.cancel_requested and not e.transactional
     for no key update of e skip locked;
  if not found or target.backend_pid is distinct from asyncproc.lock_holder(target.id) then
    return false;
  end if;
  -- an idle session ignores a signal: wait for it to be running something
  if not exists (select from pg_stat_activity a where a.pid = target.backend_pid and a.state = 'active') then
    return false;
  end if;
  return pg_cancel_backend(target.backend_pid);
end
$$;
