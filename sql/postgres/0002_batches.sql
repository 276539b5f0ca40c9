-- Batches: executions grouped in ordered stages. Stage n+1 is released when every
-- execution of stage n has ended, by whoever records that last outcome, in the same
-- transaction (a trigger on the status change); no worker waits for a stage.

create table asyncproc.batches (
  id            uuid primary key default gen_random_uuid(),
  status        text not null default 'RUNNING' check (status in ('RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED')),
  on_failure    text not null default 'CANCEL' check (on_failure in ('CANCEL', 'CONTINUE')),
  stage_count   integer not null check (stage_count >= 1),
  current_stage integer not null default 1,   -- the stage released last
  submitted_by  text,
  submitted_at  timestamptz not null default clock_timestamp(),
  finished_at   timestamptz
);
create index batches_finished on asyncproc.batches (finished_at) where finished_at is not null;

-- held: WAITING for its stage (not for run_at); release_due and next_due leave it alone.
alter table asyncproc.executions
  add column held boolean not null default false,
  add constraint executions_batch foreign key (batch_id) references asyncproc.batches (id);
create index executions_batch on asyncproc.executions (batch_id, stage) where batch_id is not null;

-- submit() learns the batch and stage; a call of a later stage is held (WAITING, no ready row).
drop function asyncproc.submit(text, jsonb, text, timestamptz, integer, text, boolean);
create function asyncproc.submit(
  procedure    text,
  arguments    jsonb default '{}',
  queue        text default null,
  run_at       timestamptz default null,
  max_attempts integer default null,
  submitted_by text default null,
  quiet        boolean default false,   -- true: the caller notifies after its commit
  in_batch     uuid default null,
  in_stage     integer default null     -- 1-based; stages after the first are held
) returns asyncproc.executions
language plpgsql as $$
declare
  registered asyncproc.procedures;
  submitted  asyncproc.executions;
  problems   text;
  queue_name text;
  is_held    boolean := in_batch is not null and coalesce(in_stage, 1) > 1;
begin
  arguments := coalesce(arguments, '{}');
  if jsonb_typeof(arguments) <> 'object' then
    raise exception 'arguments must be a JSON object keyed by parameter name' using errcode = 'AP002';
  end if;
  select * into registered from asyncproc.procedures r where r.name = submit.procedure;
  if not found then
    raise exception 'procedure "%" is not registered', submit.procedure using errcode = 'AP001';
  end if;
  if submit.max_attempts is not null and submit.max_attempts not between 1 and 100 then
    raise exception 'maxAttempts must be between 1 and 100' using errcode = 'AP002';
  end if;

  select string_agg(problem, '; ' order by ord, problem) into problems from (
    select 1 as ord, format('unknown argument "%s"', k) as problem
      from jsonb_object_keys(arguments) k
     where not exists (select 1 from asyncproc.parameters p
                        where p.proc = registered.proc and p.name = k and p.mode in ('IN', 'INOUT', 'VARIADIC'))
    union all
    select 2, format('missing argument "%s" (%s)', p.name, p.type_name)
      from asyncproc.parameters p
     where p.proc = registered.proc and p.mode in ('IN', 'INOUT', 'VARIADIC') and not p.has_default
       and not arguments ? p.name
    union all
    select 3, format('argument "%s": %s is not a valid %s', p.name, arguments -> p.name, p.type_name)
      from asyncproc.parameters p
     where p.proc = registered.proc and p.mode in ('IN', 'INOUT', 'VARIADIC') and arguments ? p.name
       and not asyncproc.fits(arguments -> p.name, p.type_oid)
  ) found;
  if problems is not null then
    raise exception 'invalid arguments for %: %', registered.name, problems using errcode = 'AP002';
  end if;

  queue_name := coalesce(submit.queue, registered.queue);
  perform 1 from asyncproc.queues q where q.name = queue_name;
  if not found then
    raise exception 'queue "%" does not exist', queue_name using errcode = 'AP003';
  end if;

  insert into asyncproc.executions (procedure, arguments, queue, status, run_at, max_attempts, submitted_by,
                                    batch_id, stage, held)
  values (registered.name, arguments, queue_name,
          case when is_held or submit.run_at > clock_timestamp() then 'WAITING' else 'PENDING' end, submit.run_at,
          coalesce(submit.max_attempts, registered.max_attempts), submit.submitted_by,
          in_batch, case when in_batch is not null then coalesce(in_stage, 1) end, is_held)
  returning * into submitted;
  if submitted.status = 'PENDING' then
    insert into asyncproc.ready (queue, id) values (submitted.queue, submitted.id);
  end if;

  if not quiet then
    -- WAITING too: activators then arm a timer for its run_at
    perform pg_notify('asyncproc_wake', queue_name);
    perform asyncproc.emit(submitted.id, submitted.seq, submitted.status);
  end if;
  return submitted;
end
$$;

-- Submit a batch: stages is a JSON array of stages, each an array of calls
-- ({procedure, arguments, queue, runAt, maxAttempts}). One transaction: all or none.
-- Returns the executions in order (their batch_id is the batch). AP004: a malformed batch.
create function asyncproc.submit_batch(
  stages       jsonb,
  on_failure   text default 'CANCEL',
  submitted_by text default null,
  quiet        boolean default false
) returns setof asyncproc.executions
language plpgsql as $$
declare
  new_batch  uuid;
  calls      jsonb;
  stage_no   bigint;
begin
  if jsonb_typeof(stages) is distinct from 'array' or jsonb_array_length(stages) = 0 then
    raise exception 'a batch needs at least one stage' using errcode = 'AP004';
  end if;
  if submit_batch.on_failure not in ('CANCEL', 'CONTINUE') then
    raise exception 'onFailure must be CANCEL or CONTINUE' using errcode = 'AP004';
  end if;
  insert into asyncproc.batches (on_failure, stage_count, submitted_by)
  values (submit_batch.on_failure, jsonb_array_length(stages), submit_batch.submitted_by)
  returning id into new_batch;
  for calls, stage_no in select s.value, s.n from jsonb_array_elements(stages) with ordinality s (value, n) loop
    if jsonb_typeof(calls) <> 'array' or jsonb_array_length(calls) = 0 then
      raise exception 'stage % of the batch has no calls', stage_no using errcode = 'AP004';
    end if;
    return query
      select e.* from jsonb_array_elements(calls) with ordinality c (call, n),
             lateral asyncproc.submit(c.call ->> 'procedure', c.call -> 'arguments', c.call ->> 'queue',
                                      (c.call ->> 'runAt')::timestamptz, (c.call ->> 'maxAttempts')::integer,
                                      submit_batch.submitted_by, quiet, new_batch, stage_no::integer) e
       order by c.n;
  end loop;
end
$$;

-- The SQL interface for backend services: submit a batch inside your own transaction; returns its id.
create function asyncproc.invoke_batch(stages jsonb, on_failure text default 'CANCEL', submitted_by text default null)
returns uuid
language sql as $$
  select e.batch_id from asyncproc.submit_batch(stages, on_failure, submitted_by) e limit 1
$$;

-- Cancel every member of a batch that has not started (WAITING, held or not, and PENDING).
-- The caller holds the batch row. Ready rows go first, as claim() takes them: a claim in
-- progress is waited for, and its call, RUNNING by then, is left alone. A RUNNING member
-- (locked by its finisher, maybe) does not match and is not waited for.
create function asyncproc.cancel_unstarted(batch uuid, reason text) returns void
language plpgsql as $$
declare
  moved record;
begin
  delete from asyncproc.ready r
   using asyncproc.executions e
   where e.batch_id = batch and e.status = 'PENDING' and r.queue = e.queue and r.id = e.id;
  for moved in
    update asyncproc.executions e
       set status = 'CANCELLED', held = false, finished_at = clock_timestamp(), error_number = 'AP011',
           error_message = reason, seq = nextval('asyncproc.change_seq')
     where e.batch_id = batch and e.status in ('WAITING', 'PENDING')
    returning e.id, e.seq
  loop
    perform asyncproc.emit(moved.id, moved.seq, 'CANCELLED');
  end loop;
end
$$;

-- Settle a batch after one of its executions ended: release the next stage when the
-- current one is complete, cancel the rest when the policy says so, end the batch when
-- nothing is left. Runs in the transaction that recorded the outcome.
--
-- Why exactly one finisher releases a stage: every caller first locks the batch row.
-- A finisher that waited for that lock runs its next statements (READ COMMITTED) on a
-- snapshot that includes the outcome committed by the finisher before it, and it sees
-- its own; so the last of them, and only the last, finds no unfinished execution.
--
-- Lock order: member rows that change status take their own row first and the batch
-- row second (this trigger). Here, holding the batch row, we touch only WAITING and
-- PENDING members (a RUNNING one, locked by its finisher, does not match and is not
-- waited for), and ready rows before execution rows, as claim() does.
-- cancel() takes the batch row first for a member that has not started.
create function asyncproc.settle_batch(settle_id uuid) returns void
language plpgsql as $$
declare
  batch  asyncproc.batches;
  moved  record;
begin
  select * into batch from asyncproc.batches b where b.id = settle_id for update;
  if not found or batch.status <> 'RUNNING' then
    return;
  end if;

  if batch.on_failure = 'CANCEL' and exists (
       select 1 from asyncproc.executions e
        where e.batch_id = settle_id and e.status in ('FAILED', 'CANCELLED')) then
    perform asyncproc.cancel_unstarted(settle_id, 'cancelled: an execution of its batch did not succeed');
  else
    loop
      exit when exists (select 1 from asyncproc.executions e
                         where e.batch_id = settle_id and e.stage <= batch.current_stage
                           and e.status not in ('SUCCEEDED', 'FAILED', 'CANCELLED'));
      exit when batch.current_stage >= batch.stage_count;
      batch.current_stage := batch.current_stage + 1;
      update asyncproc.batches b set current_stage = batch.current_stage where b.id = settle_id;
      for moved in
        update asyncproc.executions e
           set held = false,
               status = case when e.run_at > clock_timestamp() then 'WAITING' else 'PENDING' end,
               seq = nextval('asyncproc.change_seq')
         where e.batch_id = settle_id and e.stage = batch.current_stage and e.held
        returning e.id, e.seq, e.queue, e.status
      loop
        if moved.status = 'PENDING' then
          insert into asyncproc.ready (queue, id) values (moved.queue, moved.id);
        end if;
        perform asyncproc.emit(moved.id, moved.seq, moved.status);
        perform pg_notify('asyncproc_wake', moved.queue);   -- identical payloads are sent once
      end loop;
    end loop;
  end if;

  if not exists (select 1 from asyncproc.executions e
                  where e.batch_id = settle_id and e.status not in ('SUCCEEDED', 'FAILED', 'CANCELLED')) then
    update asyncproc.batches b
       set status = case
                      when exists (select 1 from asyncproc.executions e where e.batch_id = settle_id and e.status = 'FAILED') then 'FAILED'
                      when exists (select 1 from asyncproc.executions e where e.batch_id = settle_id and e.status = 'CANCELLED') then 'CANCELLED'
                      else 'SUCCEEDED' end,
           finished_at = clock_timestamp()
     where b.id = settle_id;
  end if;
end
$$;

-- Every path that ends an execution (run, finish, abandon, recover, cancel, and any
-- added later) settles its batch in the same transaction. Settling cancels members
-- itself; those nested changes do not settle again (marked by a transaction-local
-- setting, not by trigger depth: a caller's own trigger may end a member too).
create function asyncproc.batch_member_ended() returns trigger
language plpgsql as $$
begin
  if current_setting('asyncproc.settling', true) is distinct from new.batch_id::text then
    perform set_config('asyncproc.settling', new.batch_id::text, true);
    perform asyncproc.settle_batch(new.batch_id);
    perform set_config('asyncproc.settling', '', true);
  end if;
  return null;
end
$$;
create trigger executions_batch_member_ended
  after update of status on asyncproc.executions
  for each row
  when (new.batch_id is not null and new.status in ('SUCCEEDED', 'FAILED', 'CANCELLED')
        and old.status not in ('SUCCEEDED', 'FAILED', 'CANCELLED'))
  execute function asyncproc.batch_member_ended();

-- Cancel by token, as before, plus: a batch member that has not started takes its batch
-- row first (see settle_batch for the lock order). If it started meanwhile, outcome RETRY:
-- call again in a new transaction (never wait for a running member while holding its batch).
drop function asyncproc.cancel(uuid);
create function asyncproc.cancel(cancel_token uuid, out outcome text, out backend_pid integer)
language plpgsql as $$
declare
  target   record;
  new_seq  bigint;
begin
  select e.id, e.queue, e.batch_id, e.status into target from asyncproc.executions e where e.token = cancel_token;
  if not found then
    outcome := 'NOT_FOUND';
    return;
  end if;
  if target.batch_id is not null and target.status in ('WAITING', 'PENDING') then
    perform 1 from asyncproc.batches b where b.id = target.batch_id for update;
  end if;
  -- the ready row first, as a claim takes it: a claim in progress makes us wait for its commit
  delete from asyncproc.ready r where r.queue = target.queue and r.id = target.id;
  update asyncproc.executions e
     set status = 'CANCELLED', held = false, finished_at = clock_timestamp(), seq = nextval('asyncproc.change_seq')
   where e.id = target.id and e.status in ('WAITING', 'PENDING')
  returning e.seq into new_seq;
  if new_seq is not null then
    perform asyncproc.emit(target.id, new_seq, 'CANCELLED');
    outcome := 'CANCELLED';
    return;
  end if;
  if target.batch_id is not null and target.status in ('WAITING', 'PENDING') then
    outcome := 'RETRY';
    return;
  end if;
  update asyncproc.executions e set cancel_requested = true
   where e.id = target.id and e.status = 'RUNNING'
  returning e.backend_pid into cancel.backend_pid;
  outcome := case when found then 'RUNNING' else 'FINISHED' end;
end
$$;

-- Held members wait for their stage, not for a time.
create or replace function asyncproc.release_due() returns integer
language plpgsql as $$
declare
  released integer := 0;
  due      record;
begin
  for due in
    update asyncproc.executions e
       set status = 'PENDING', seq = nextval('asyncproc.change_seq')
     where e.status = 'WAITING' and not e.held and e.run_at <= clock_timestamp()
    returning e.id, e.seq, e.queue
  loop
    released := released + 1;
    insert into asyncproc.ready (queue, id) values (due.queue, due.id);
    perform asyncproc.emit(due.id, due.seq, 'PENDING');
    perform pg_notify('asyncproc_wake', due.queue);
  end loop;
  return released;
end
$$;

create or replace function asyncproc.next_due() returns timestamptz
language sql stable as $$
  select min(run_at) from asyncproc.executions where status = 'WAITING' and not held
$$;

-- Purge finished history; a batch's executions go together with their batch, once it ended.
drop function asyncproc.purge(interval);
create function asyncproc.purge(older_than interval) returns integer
language plpgsql as $$
declare
  cutoff timestamptz := clock_timestamp() - older_than;
  purged integer;
begin
  delete from asyncproc.executions e
   where e.finished_at < cutoff and e.status in ('SUCCEEDED', 'FAILED', 'CANCELLED')
     and (e.batch_id is null
          or exists (select 1 from asyncproc.batches b where b.id = e.batch_id and b.finished_at < cutoff));
  get diagnostics purged = row_count;
  delete from asyncproc.batches b
   where b.finished_at < cutoff
     and not exists (select 1 from asyncproc.executions e where e.batch_id = b.id);
  return purged;
end
$$;

-- Cancel a whole batch, step one: every member that has not started ends CANCELLED, in one
-- transaction that holds the batch row first (settle_batch's lock order: batch row, then
-- ready rows, then member rows, touching WAITING and PENDING members only). Running members
-- are step two, asyncproc.cancel_batch_running(), in a transaction of its own: a finisher
-- holds its member row while it waits for the batch row, so we never wait for a running
-- member while holding its batch.
-- outcome: CANCELLED (step two may follow), FINISHED (the batch had ended), NOT_FOUND.
create function asyncproc.cancel_batch(cancel_id uuid, out outcome text)
language plpgsql as $$
begin
  perform 1 from asyncproc.batches b where b.id = cancel_id;
  if not found then
    outcome := 'NOT_FOUND';
    return;
  end if;
  perform 1 from asyncproc.batches b where b.id = cancel_id and b.status = 'RUNNING' for update;
  if not found then
    outcome := 'FINISHED';
    return;
  end if;
  -- the trigger settles the batch as members end: it ends now if nothing is running
  perform asyncproc.cancel_unstarted(cancel_id, 'cancelled with its batch');
  outcome := 'CANCELLED';
end
$$;

-- Step two: ask every running member of the batch to stop (as cancel() does for one call);
-- returns the sessions of those not asked before, for pg_cancel_backend. The service
-- repeats both steps until the batch has ended: a member that went from RUNNING back to
-- WAITING (a retry) while step one ran is caught by the next round.
create function asyncproc.cancel_batch_running(cancel_id uuid) returns setof integer
language sql as $$
  update asyncproc.executions e set cancel_requested = true
   where e.batch_id = cancel_id and e.status = 'RUNNING' and not e.cancel_requested
  returning e.backend_pid
$$;
