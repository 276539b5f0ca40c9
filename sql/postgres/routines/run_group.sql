-- Run a claimed transactional call, then more ready calls of next_queue, all in ONE
-- transaction (a grouped commit; the queue's group_size > 1). Each call runs under its own
-- savepoint, as run() runs one: a failing call rolls back alone and still records its outcome,
-- and the group commits together. A lost worker undoes the whole group: the calls taken inside
-- it were never committed RUNNING, so they are simply PENDING again, and the first one is
-- recovered as any lost call; each runs again once.
-- A call after the first is never seen RUNNING by anyone else, so it is not made RUNNING at
-- all: its ready row is deleted and its row locked (what a claim's update held), it runs, and
-- one update records its start and its end (finish() for a member). That is one write of the
-- row and its indexes per call instead of two. The call itself finds its row PENDING.
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
-- Dropped only when it is not the definition below (CREATE OR REPLACE cannot change its OUT
-- parameters): applied again as it is (an upgrade, a process of another version), it is replaced
-- in place and keeps its OID, so a worker inside it at that moment goes on. Dropped each time,
-- it failed every call then running (XX000: cache lookup failed for function).
do $guard$
begin
  if pg_get_function_arguments(to_regprocedure('asyncproc.run_group(bigint, text, text, integer, integer, integer)'))
     is distinct from 'execution_id bigint, worker text, next_queue text, max_count integer, max_ms integer, row_cap integer DEFAULT 100' then
    drop function if exists asyncproc.run_group(bigint, text, text, integer, integer, integer);
  end if;
end
$guard$;
create or replace function asyncproc.run_group(
  execution_id bigint, worker text, next_queue text, max_count integer, max_ms integer, row_cap integer default 100
)
returns table (id bigint, seq bigint, status text, token uuid, procedure text, timeout_ms integer, transactional boolean)
language plpgsql as $$
#variable_conflict use_column
declare
  deadline  timestamptz := clock_timestamp() + max_ms * interval '1 millisecond';
  ran       integer := 1;
  taken     bigint;
  member    record;
  claimed   record;
  past      bigint := execution_id;   -- takes start past the group's last call (see claim())
  ended     record;
  group_user name := current_user;
  group_path text := current_setting('search_path');
  alone      boolean;
begin
  -- a batch member runs alone, first or not (see above): run() runs it and claims the next
  -- call, as without grouped commits. At the head of a group it held its batch's row locked
  -- until the whole group committed: a cancel of the batch, and its other members' ends, waited.
  alone := (select e.batch_id from asyncproc.executions e where e.id = execution_id) is not null;
  if not alone then
    -- for run_call(): the first call too runs in a group (its deadlock is the group's)
    perform set_config('asyncproc.grouped', 'on', true);
  end if;
  ended := asyncproc.run(execution_id, worker, case when alone then next_queue end, row_cap);
  if ended.done_seq is not null then
    return query select execution_id, ended.done_seq, ended.done_status, null::uuid, null::text, null::integer, null::boolean;
  end if;
  if alone then
    if ended.next_id is not null then
      return query select ended.next_id, ended.next_seq, 'RUNNING'::text, ended.next_token, ended.next_procedure,
                          ended.next_timeout_ms, ended.next_transactional;
    end if;
    return;
  end if;
  loop
    exit when next_queue is null;
    -- a call that changed the role or the search path with SET LOCAL changed it for the rest of
    -- the transaction, which the group's later calls share: the group ends with it (the next call
    -- runs in a transaction of its own, as a call on a queue without grouped commits does)
    if current_user is distinct from group_user or current_setting('search_path') is distinct from group_path then
      -- no next call is claimed here: a loop of the queue is woken for it (at the commit)
      perform pg_notify('asyncproc_wake', next_queue);
      exit;
    end if;
    -- the next ready call past the last one, as claim() takes it (a cancel of it then waits for
    -- the group's commit and finds the call ended)
    taken := asyncproc.take_ready(next_queue, past);
    if taken is null and past > 0 then
      -- nothing past it: once more from the start (a retry released meanwhile has an older id)
      past := 0;
      continue;
    end if;
    exit when taken is null;
    past := taken;
    -- by its key; locked as a claim's update would lock it, until the group ends
    select e.token, e.procedure, e.arguments, e.batch_id, p.proc, p.transactional, coalesce(p.timeout_ms, 0) as timeout_ms
      into member
      from asyncproc.executions e
      join asyncproc.procedures p on p.name = e.procedure
     where e.id = taken and e.status = 'PENDING'
       for update of e;
    -- no longer PENDING (cancelled meanwhile): its ready row is dropped, as claim() drops it
    continue when not found;
    if ran >= max_count or clock_timestamp() >= deadline or not member.transactional or member.timeout_ms <> 0
       or member.batch_id is not null then
      -- it runs alone: claimed as claim() claims, committed RUNNING with the group
      claimed := asyncproc.start(taken, worker);
      return query select claimed.id, claimed.seq, 'RUNNING'::text, claimed.token, claimed.procedure,
                          claimed.timeout_ms, claimed.transactional;
      exit;
    end if;
    -- its progress reports name it (progress.sql), until the group's transaction ends
    perform set_config('asyncproc.execution', taken::text, true);
    ended := asyncproc.run_call(taken, member.proc, member.arguments, row_cap, clock_timestamp(), worker);
    ran := ran + 1;
    return query select taken, ended.done_seq, ended.done_status, member.token, member.procedure, null::integer, null::boolean;
  end loop;
end
$$;
