-- Claim the oldest ready call of a queue for this session: RUNNING, and locked for the session's life.
-- The caller notifies (id:seq:RUNNING) after commit.
create or replace function asyncproc.claim(queue_name text, worker text, out id bigint, out seq bigint)
language plpgsql as $$
declare
  ready_id bigint;
begin
  loop
    delete from asyncproc.ready r
     where r.queue = queue_name
       and r.id = (select x.id from asyncproc.ready x where x.queue = queue_name
                    order by x.id limit 1 for update skip locked)
    returning r.id into ready_id;
    exit when ready_id is null;
    update asyncproc.executions e
       set status = 'RUNNING', started_at = clock_timestamp(), finished_at = null, attempts = e.attempts + 1,
           worker = claim.worker, backend_pid = pg_backend_pid(), seq = nextval('asyncproc.change_seq')
     where e.id = ready_id and e.status = 'PENDING'   -- a ready row of a call cancelled meanwhile is dropped
    returning e.id, e.seq into claim.id, claim.seq;
    exit when claim.id is not null;
  end loop;
  if claim.id is not null then
    perform pg_advisory_lock(x'41535943'::integer, asyncproc.lock_key(claim.id));
  end if;
end
$$;
