-- Start a call whose ready row this transaction has just deleted (claim(), run_group()):
-- RUNNING, and locked for the session's life (until run(), conclude() or abandon() hands the
-- lock over to their transaction). No row: the call is no longer PENDING (a ready row of a call
-- cancelled meanwhile is dropped). Returns what claim() returns of it.
create or replace function asyncproc.start(
  execution_id bigint, worker text,
  out id bigint, out seq bigint, out timeout_ms integer, out transactional boolean, out token uuid, out procedure text
)
-- lock_timeout = 0: the service's own lock waits, as in finish()
language plpgsql set lock_timeout = 0 as $$
begin
  update asyncproc.executions e
     set status = 'RUNNING', started_at = clock_timestamp(), finished_at = null, attempts = e.attempts + 1,
         worker = start.worker, backend_pid = pg_backend_pid(), seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id(),
         transactional = p.transactional
    from asyncproc.procedures p
   where e.id = execution_id and e.status = 'PENDING'
     and p.name = e.procedure
  returning e.id, e.seq, coalesce(p.timeout_ms, 0), p.transactional, e.token, e.procedure
       into start.id, start.seq, start.timeout_ms, start.transactional, start.token, start.procedure;
  if start.id is not null then
    -- taken before the commit that makes the call RUNNING: recover never sees it RUNNING and unlocked
    perform pg_advisory_lock(asyncproc.lock_key1(start.id), asyncproc.lock_key2(start.id));
  end if;
end
$$;
