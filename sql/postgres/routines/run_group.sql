-- Run a claimed transactional call, then more ready calls of next_queue, all in ONE
-- transaction (a grouped commit; the queue's group_size > 1). Each call runs as run() runs it,
-- under its own savepoint: a failing call rolls back alone and still records its outcome, and
-- the group commits together. A lost worker undoes the whole group: the calls claimed inside
-- it were never committed RUNNING, so they are simply PENDING again, and the first one is
-- recovered as any lost call; each runs again once.
-- The group closes after max_count calls, or once max_ms have passed since it began (checked
-- before each further claim: a slow call ends its group), or at a call that must run alone:
-- non-transactional, with a timeout (its statement_timeout would cut the whole group), or a
-- batch member (a cancel locks its batch before its ready row, settle_batch the other way
-- round). The call claimed then is returned as RUNNING, committed with the group as run()
-- commits its next claim, and the worker runs it its own way.
-- Returns every call it ended (id, seq, status) and the next claimed one (status RUNNING), for
-- the worker's notifications and log lines after the commit.
-- cancel() never signals a grouped call after the first: it is PENDING as far as any other
-- session can see, so cancel() waits on its ready row until the group commits, and finds it
-- ended. A cancel of the first call signals the group's statement: the group rolls back and
-- the worker abandons the first call (CANCELLED); the others are PENDING again.
drop function if exists asyncproc.run_group(bigint, text, text, integer, integer, integer);
create or replace function asyncproc.run_group(
  execution_id bigint, worker text, next_queue text, max_count integer, max_ms integer, row_cap integer default 100
)
returns table (id bigint, seq bigint, status text, token uuid, procedure text, timeout_ms integer, transactional boolean)
language plpgsql as $$
#variable_conflict use_column
declare
  deadline timestamptz := clock_timestamp() + max_ms * interval '1 millisecond';
  ran      integer := 1;
  claimed  record;
  past     bigint := execution_id;   -- claims start past the group's last call (see claim())
  ended    record;
begin
  select r.done_seq, r.done_status into ended from asyncproc.run(execution_id, worker, null, row_cap) r;
  if ended.done_seq is not null then
    return query select execution_id, ended.done_seq, ended.done_status, null::uuid, null::text, null::integer, null::boolean;
  end if;
  loop
    exit when next_queue is null;
    select c.id, c.seq, c.timeout_ms, c.transactional, c.token, c.procedure into claimed
      from asyncproc.claim(next_queue, worker, past) c;
    if claimed.id is null and past > 0 then
      -- nothing past it: once more from the start (a retry released meanwhile has an older id)
      past := 0;
      continue;
    end if;
    exit when claimed.id is null;
    past := claimed.id;
    if ran >= max_count or clock_timestamp() >= deadline or not claimed.transactional or claimed.timeout_ms <> 0
       -- by its key (a condition on batch_id would let the planner walk the partial index of batch members)
       or (select e.batch_id from asyncproc.executions e where e.id = claimed.id) is not null then
      return query select claimed.id, claimed.seq, 'RUNNING'::text, claimed.token, claimed.procedure,
                          claimed.timeout_ms, claimed.transactional;
      exit;
    end if;
    -- grouped: run() finds it RUNNING for this session (uncommitted, seen by no one else);
    -- its progress reports name it (progress.sql), until the group's transaction ends
    perform set_config('asyncproc.execution', claimed.id::text, true);
    select r.done_seq, r.done_status into ended from asyncproc.run(claimed.id, worker, null, row_cap) r;
    ran := ran + 1;
    if ended.done_seq is not null then
      return query select claimed.id, ended.done_seq, ended.done_status, claimed.token, claimed.procedure, null::integer, null::boolean;
    end if;
  end loop;
end
$$;
