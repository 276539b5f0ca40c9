-- Claim the oldest ready call of a queue for this session: RUNNING, and locked for the
-- session's life (until run(), conclude() or abandon() hands the lock over to their transaction).
-- Returns the procedure's timeout too (0: none), which the worker arms as statement_timeout
-- before the statement that runs the call, and how the call runs: transactional (inside
-- run()) or not (sent at top level by the worker; the claim records that mode on the call for
-- recover). The caller notifies (id:seq:RUNNING) after commit.
-- after_id: only calls past it (a group's next claim starts past its last one: the ready rows
-- that other groups hold deleted but uncommitted lie below, and skipping each costs a visit).
-- look_ahead: say in `more` whether the queue holds a ready call past this one (the worker then
-- wakes an idle sibling for it; without one, the sibling's claim would find nothing). A hint:
-- a row another claim is taking counts, one committed a moment later does not (its wake comes).
drop function if exists asyncproc.claim(text, text);
drop function if exists asyncproc.claim(text, text, bigint);
create or replace function asyncproc.claim(
  queue_name text, worker text, after_id bigint default 0, look_ahead boolean default false,
  out id bigint, out seq bigint, out timeout_ms integer, out transactional boolean,
  out token uuid, out procedure text,   -- for the worker's log lines (grep a token, read its story)
  out more boolean
)
-- lock_timeout = 0: the service's own lock waits, as in finish()
language plpgsql set lock_timeout = 0 as $$
declare
  ready_id bigint;
  started  record;
begin
  loop
    ready_id := asyncproc.take_ready(queue_name, after_id);
    exit when ready_id is null;
    -- an assignment, not a query: evaluated as a simple expression (no executor)
    started := asyncproc.start(ready_id, worker);
    if started.id is not null then
      claim.id := started.id;
      claim.seq := started.seq;
      claim.timeout_ms := started.timeout_ms;
      claim.transactional := started.transactional;
      claim.token := started.token;
      claim.procedure := started.procedure;
      exit;
    end if;
  end loop;
  if claim.id is not null and look_ahead then
    more := exists (select from asyncproc.ready x where x.queue = queue_name and x.id > claim.id);
  end if;
end
$$;
