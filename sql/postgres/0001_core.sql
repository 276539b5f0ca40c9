-- asyncproc core objects for PostgreSQL (16 or later: pg_input_is_valid).
-- Everything of ours lives in schema asyncproc; callers need only EXECUTE on asyncproc.invoke.

create table asyncproc.queues (
  name        text primary key check (name ~ '^[A-Za-z0-9_.:-]{1,128}$'),
  concurrency integer not null default 10 check (concurrency between 1 and 1000),
  created_at  timestamptz not null default now()
);
insert into asyncproc.queues (name) values ('default');

-- The procedure registry: nothing unregistered can be invoked.
create table asyncproc.procedures (
  name          text primary key,               -- schema.name, as callers write it
  proc          regprocedure not null unique,   -- the exact routine (overload) it stands for
  queue         text not null default 'default' references asyncproc.queues (name),
  max_attempts  integer not null default 1 check (max_attempts between 1 and 100),
  timeout_ms    integer check (timeout_ms > 0),
  registered_at timestamptz not null default now()
);

-- Every status change takes a new value: the change cursor (like SQL Server's rowversion).
create sequence asyncproc.change_seq;

create table asyncproc.executions (
  id             bigint generated always as identity primary key,
  token          uuid not null default gen_random_uuid() unique,
  procedure      text not null,
  arguments      jsonb not null,
  queue          text not null,
  status         text not null check (status in ('WAITING', 'PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED')),
  submitted_at   timestamptz not null default clock_timestamp(),
  run_at         timestamptz,
  started_at     timestamptz,
  finished_at    timestamptz,
  attempts       integer not null default 0,
  max_attempts   integer not null default 1,
  recoveries     integer not null default 0,   -- runs lost with their worker and started again
  cancel_requested boolean not null default false, -- cancelExecution asked to stop it while RUNNING
  submitted_by   text,
  error_number   text,                         -- SQLSTATE
  error_message  text,
  error_detail   text,
  error_context  text,
  result         jsonb,
  worker         text,
  backend_pid    integer,
  batch_id       uuid,
  stage          integer,
  seq            bigint not null default nextval('asyncproc.change_seq')
);
create index executions_active on asyncproc.executions (queue, status) where status in ('RUNNING', 'WAITING');
create index executions_seq on asyncproc.executions (seq);
create index executions_procedure on asyncproc.executions (procedure, id);
create index executions_finished on asyncproc.executions (finished_at) where finished_at is not null;

-- The execution log. The latest attempt lives in the executions row itself; an attempt
-- that ends without ending its execution (failed with a retry to come, or lost with
-- its worker) is moved here, so the happy path writes nothing extra.
create table asyncproc.attempts (
  execution_id  bigint not null references asyncproc.executions (id) on delete cascade,
  number        integer not null,
  status        text not null check (status in ('FAILED', 'LOST')),
  started_at    timestamptz not null,
  finished_at   timestamptz not null,
  worker        text,
  backend_pid   integer,
  error_number  text,
  error_message text,
  error_detail  text,
  error_context text,
  primary key (execution_id, number)
);

-- The hot table: one row per PENDING execution, in claim order. Claims scan only this
-- (a partial index on executions loses to its primary key once statistics say most
-- rows are pending, and the claim then walks every finished row).
create table asyncproc.ready (
  queue text not null,
  id    bigint not null,
  primary key (queue, id)
);
-- a queue table churns: vacuum it by dead rows, not by a fraction of its (small) size
alter table asyncproc.ready set (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000);

-- Parameters of every routine, read from the catalog. Defaults belong to the last pronargdefaults input arguments.
create view asyncproc.parameters as
select p.oid as proc,
       a.ord::integer as position,
       a.name,
       a.type_oid,
       format_type(a.type_oid, null) as type_name,
       case a.mode when 'i' then 'IN' when 'o' then 'OUT' when 'b' then 'INOUT' when 'v' then 'VARIADIC' else 'TABLE' end as mode,
       (a.mode in ('i', 'b', 'v') and a.arg_ord > p.pronargs - p.pronargdefaults) as has_default
from pg_proc p
cross join lateral (
  select u.ord, u.type_oid,
         coalesce(p.proargnames[u.ord], '') as name,
         coalesce(p.proargmodes[u.ord], 'i') as mode,
         count(*) filter (where coalesce(p.proargmodes[u.ord], 'i') in ('i', 'b', 'v')) over (order by u.ord) as arg_ord
  from unnest(coalesce(p.proallargtypes, p.proargtypes::oid[])) with ordinality as u (type_oid, ord)
) a;

-- Does a JSON value convert to a parameter's type? (no exception, so no savepoint per call)
create function asyncproc.fits(value jsonb, type_oid oid) returns boolean
language sql stable as $$
  select case
    when value is null or jsonb_typeof(value) = 'null' then true
    when type_oid in ('json'::regtype, 'jsonb'::regtype) then true
    when jsonb_typeof(value) = 'array' then
      t.typelem <> 0 and t.typcategory = 'A' and not exists (
        select 1 from jsonb_array_elements(value) e
        where jsonb_typeof(e) in ('object', 'array')
           or (jsonb_typeof(e) <> 'null' and not pg_input_is_valid(e #>> '{}', format_type(t.typelem, null))))
    when jsonb_typeof(value) = 'object' then false
    else pg_input_is_valid(value #>> '{}', format_type(type_oid, null))
  end
  from pg_type t where t.oid = type_oid
$$;

-- A JSON array as text[] (cast on to the parameter's array type); CALL arguments may not hold subqueries.
create function asyncproc.text_array(value jsonb) returns text[]
language sql immutable as $$
  select case when value is null or jsonb_typeof(value) = 'null' then null
              else coalesce((select array_agg(e.v order by e.o) from jsonb_array_elements_text(value) with ordinality e (v, o)), '{}')
         end
$$;

-- The SQL expression that turns argument `name` of $1 (the arguments object) into a typed value.
create function asyncproc.argument_expression(name text, type_oid oid) returns text
language sql stable as $$
  select case
    when type_oid in ('json'::regtype, 'jsonb'::regtype) then format('($1->%L)::%s', name, format_type(type_oid, null))
    when t.typcategory = 'A' and t.typelem <> 0 then
      format('asyncproc.text_array($1->%L)::%s', name, format_type(type_oid, null))
    else format('($1->>%L)::%s', name, format_type(type_oid, null))
  end
  from pg_type t where t.oid = type_oid
$$;

-- Notifications. A transaction that NOTIFYs holds a database-wide lock from its commit
-- until its WAL is flushed, so notifying transactions commit one at a time. The hot
-- paths (the service's invokes, claims, completions) therefore do not NOTIFY: the
-- service sends their notifications right after commit, batched, on a connection with
-- synchronous_commit off. Plain-SQL callers of asyncproc.invoke and the rare paths
-- (recover, release_due) notify inside their own transaction.
-- Payload of asyncproc_events: `id:seq:status`, several joined by `;` (keys, not rows).

-- Session-level advisory locks tie a claim to the life of the worker's session.
create function asyncproc.lock_key(execution_id bigint) returns integer
language sql immutable as $$ select (execution_id % 2147483647)::integer $$;

create function asyncproc.emit(execution_id bigint, seq bigint, status text) returns void
language sql as $$ select pg_notify('asyncproc_events', execution_id || ':' || seq || ':' || status) $$;

-- Enqueue a call inside the caller's transaction; returns the new row (asyncproc.invoke returns its token).
-- Errors: AP001 unknown procedure, AP002 invalid arguments, AP003 unknown queue.
create function asyncproc.submit(
  procedure    text,
  arguments    jsonb default '{}',
  queue        text default null,
  run_at       timestamptz default null,
  max_attempts integer default null,
  submitted_by text default null,
  quiet        boolean default false   -- true: the caller notifies after its commit
) returns asyncproc.executions
language plpgsql as $$
declare
  registered asyncproc.procedures;
  submitted  asyncproc.executions;
  problems   text;
  queue_name text;
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

  insert into asyncproc.executions (procedure, arguments, queue, status, run_at, max_attempts, submitted_by)
  values (registered.name, arguments, queue_name,
          case when submit.run_at > clock_timestamp() then 'WAITING' else 'PENDING' end, submit.run_at,
          coalesce(submit.max_attempts, registered.max_attempts), submit.submitted_by)
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

-- The SQL interface for backend services: call it inside your own transaction.
create function asyncproc.invoke(
  procedure    text,
  arguments    jsonb default '{}',
  queue        text default null,
  run_at       timestamptz default null,
  max_attempts integer default null,
  submitted_by text default null
) returns uuid
language sql as $$
  select s.token from asyncproc.submit(procedure, arguments, queue, run_at, max_attempts, submitted_by) s
$$;

-- Claim the oldest ready call of a queue for this session: RUNNING, and locked for the session's life.
-- The caller notifies (id:seq:RUNNING) after commit.
create function asyncproc.claim(queue_name text, worker text, out id bigint, out seq bigint)
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

-- Record an outcome (and retry when attempts are left). Used by run() and by the
-- worker when a call escaped run() (cancelled statement, timeout) and must still end.
create function asyncproc.finish(
  execution_id bigint, succeeded boolean, outcome jsonb,
  err_number text default null, err_message text default null, err_detail text default null, err_context text default null,
  out done_seq bigint, out done_status text
)
language plpgsql as $$
begin
  update asyncproc.executions e
     set status = case
                    when succeeded then 'SUCCEEDED'
                    when e.attempts < e.max_attempts then 'WAITING'
                    else 'FAILED' end,
         -- exponential backoff with jitter: about 2^attempts seconds, at most five minutes
         run_at = case when not succeeded and e.attempts < e.max_attempts
                       then clock_timestamp() + least(300, 2 ^ e.attempts) * (0.75 + random() / 2) * interval '1 second'
                       else e.run_at end,
         finished_at = case when succeeded or e.attempts >= e.max_attempts then clock_timestamp() end,
         result = case when succeeded then outcome else null end,
         error_number = err_number, error_message = err_message, error_detail = err_detail, error_context = err_context,
         seq = nextval('asyncproc.change_seq')
   where e.id = execution_id and e.status = 'RUNNING'
  returning e.seq, e.status into finish.done_seq, finish.done_status;
  if finish.done_status = 'WAITING' then
    insert into asyncproc.attempts (execution_id, number, status, started_at, finished_at, worker, backend_pid,
                                    error_number, error_message, error_detail, error_context)
    select e.id, e.attempts + e.recoveries, 'FAILED', e.started_at, clock_timestamp(), e.worker, e.backend_pid,
           err_number, err_message, err_detail, err_context
      from asyncproc.executions e where e.id = execution_id;
  end if;
end
$$;

-- Run one claimed call; its writes and its outcome commit together (the service
-- notifies right after). Then release it and claim the next call of next_queue in
-- the same transaction and round trip.
create function asyncproc.run(
  execution_id bigint, worker text, next_queue text, row_cap integer default 100,
  out done_seq bigint, out done_status text, out next_id bigint, out next_seq bigint
)
language plpgsql as $$
declare
  call         record;
  args_sql     text;
  out_names    text[];
  statement    text;
  outcome      jsonb;
  output       record;
  v_state      text;
  v_message    text;
  v_detail     text;
  v_context    text;
  succeeded    boolean := false;
begin
  select e.arguments, e.status, r.proc, p.prokind, p.proretset, p.prorettype,
         format('%I.%I', n.nspname, p.proname) as routine
    into call
    from asyncproc.executions e
    join asyncproc.procedures r on r.name = e.procedure
    join pg_proc p on p.oid = r.proc
    join pg_namespace n on n.oid = p.pronamespace
   where e.id = execution_id;

  if found and call.status = 'RUNNING' then
    begin
      select string_agg(format('%I => %s', pa.name,
                          case when pa.mode = 'OUT' then format('null::%s', pa.type_name)
                               else asyncproc.argument_expression(pa.name, pa.type_oid) end), ', ' order by pa.position),
             array_agg(pa.name order by pa.position) filter (where pa.mode in ('OUT', 'INOUT'))
        into args_sql, out_names
        from asyncproc.parameters pa
       where pa.proc = call.proc
         and ((pa.mode in ('IN', 'INOUT', 'VARIADIC') and call.arguments ? pa.name)
              or (pa.mode = 'OUT' and call.prokind = 'p'));

      if call.prokind = 'p' then
        statement := format('call %s(%s)', call.routine, coalesce(args_sql, ''));
        if out_names is null then
          execute statement using call.arguments;
          outcome := jsonb_build_object('returnValue', null, 'outputParameters', null, 'rows', null);
        else
          execute statement into output using call.arguments;
          outcome := jsonb_build_object('returnValue', null, 'outputParameters', to_jsonb(output), 'rows', null);
        end if;
      else
        statement := format('select coalesce(jsonb_agg(to_jsonb(t)), ''[]'') from (select * from %s(%s) limit %s) t',
                            call.routine, coalesce(args_sql, ''), row_cap);
        execute statement into outcome using call.arguments;
        outcome := case
          when call.proretset then jsonb_build_object('returnValue', null, 'outputParameters', null, 'rows', outcome)
          when out_names is not null or (select typtype = 'c' from pg_type where oid = call.prorettype)
            then jsonb_build_object('returnValue', null, 'outputParameters', outcome -> 0, 'rows', null)
          else jsonb_build_object('returnValue', (select v from jsonb_each(outcome -> 0) x (k, v) limit 1),
                                  'outputParameters', null, 'rows', null)
        end;
      end if;
      succeeded := true;
    exception when others then
      -- the block's implicit savepoint has undone the call's writes; record the failure instead
      get stacked diagnostics v_state = returned_sqlstate, v_message = message_text,
                              v_detail = pg_exception_detail, v_context = pg_exception_context;
    end;
    -- outside the block, so the outcome is written by the main transaction, not a subtransaction
    select f.done_seq, f.done_status into run.done_seq, run.done_status
      from asyncproc.finish(execution_id, succeeded, case when succeeded then outcome end,
                            v_state, v_message, nullif(v_detail, ''), nullif(v_context, '')) f;
  end if;

  perform pg_advisory_unlock(x'41535943'::integer, asyncproc.lock_key(execution_id));
  if next_queue is not null then
    select c.id, c.seq into run.next_id, run.next_seq from asyncproc.claim(next_queue, worker) c;
  end if;
end
$$;

-- Start again the calls whose worker session is gone (its advisory lock is free).
-- A call lost five times is failed rather than run forever.
create function asyncproc.recover(max_recoveries integer default 5) returns integer
language plpgsql as $$
declare
  lost      record;
  recovered integer := 0;
  new_seq   bigint;
  new_stat  text;
begin
  for lost in
    select e.id, e.queue from asyncproc.executions e
     where e.status = 'RUNNING'
       and not exists (select 1 from pg_locks l
                        where l.locktype = 'advisory' and l.granted and l.objsubid = 2
                          and l.database = (select oid from pg_database where datname = current_database())
                          and l.classid = x'41535943'::integer::oid
                          and l.objid = asyncproc.lock_key(e.id)::oid)
  loop
    -- holding the lock ourselves proves no live session runs it
    continue when not pg_try_advisory_lock(x'41535943'::integer, asyncproc.lock_key(lost.id));
    insert into asyncproc.attempts (execution_id, number, status, started_at, finished_at, worker, backend_pid)
    select e.id, e.attempts + e.recoveries, 'LOST', e.started_at, clock_timestamp(), e.worker, e.backend_pid
      from asyncproc.executions e
     where e.id = lost.id and e.status = 'RUNNING' and e.recoveries + 1 < max_recoveries;
    update asyncproc.executions e
       set status = case when e.recoveries + 1 >= max_recoveries then 'FAILED' else 'PENDING' end,
           attempts = e.attempts - 1, recoveries = e.recoveries + 1,
           finished_at = case when e.recoveries + 1 >= max_recoveries then clock_timestamp() end,
           error_number = case when e.recoveries + 1 >= max_recoveries then 'AP010' end,
           error_message = case when e.recoveries + 1 >= max_recoveries
                                then format('the worker running this call was lost %s times', e.recoveries + 1) end,
           seq = nextval('asyncproc.change_seq')
     where e.id = lost.id and e.status = 'RUNNING'
    returning e.seq, e.status into new_seq, new_stat;
    if new_stat = 'PENDING' then
      insert into asyncproc.ready (queue, id) values (lost.queue, lost.id);
    end if;
    perform pg_advisory_unlock(x'41535943'::integer, asyncproc.lock_key(lost.id));
    if new_seq is not null then
      recovered := recovered + 1;
      perform asyncproc.emit(lost.id, new_seq, new_stat);
      perform pg_notify('asyncproc_wake', lost.queue);
    end if;
  end loop;
  return recovered;
end
$$;

-- Move calls whose run_at has come from WAITING to PENDING.
create function asyncproc.release_due() returns integer
language plpgsql as $$
declare
  released integer := 0;
  due      record;
begin
  for due in
    update asyncproc.executions e
       set status = 'PENDING', seq = nextval('asyncproc.change_seq')
     where e.status = 'WAITING' and e.run_at <= clock_timestamp()
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

-- Cancel by token. outcome: CANCELLED (it was WAITING/PENDING and now never starts),
-- RUNNING (cancel_requested is set; the caller signals backend_pid), FINISHED, NOT_FOUND.
create function asyncproc.cancel(cancel_token uuid, out outcome text, out backend_pid integer)
language plpgsql as $$
declare
  target   record;
  new_seq  bigint;
begin
  select e.id, e.queue into target from asyncproc.executions e where e.token = cancel_token;
  if not found then
    outcome := 'NOT_FOUND';
    return;
  end if;
  -- the ready row first, as a claim takes it: a claim in progress makes us wait for its commit
  delete from asyncproc.ready r where r.queue = target.queue and r.id = target.id;
  update asyncproc.executions e
     set status = 'CANCELLED', finished_at = clock_timestamp(), seq = nextval('asyncproc.change_seq')
   where e.id = target.id and e.status in ('WAITING', 'PENDING')
  returning e.seq into new_seq;
  if new_seq is not null then
    perform asyncproc.emit(target.id, new_seq, 'CANCELLED');
    outcome := 'CANCELLED';
    return;
  end if;
  update asyncproc.executions e set cancel_requested = true
   where e.id = target.id and e.status = 'RUNNING'
  returning e.backend_pid into cancel.backend_pid;
  outcome := case when found then 'RUNNING' else 'FINISHED' end;
end
$$;

-- End a call whose statement was interrupted outside run()'s own error capture
-- (query_canceled and the like), then release it. Cancelled on request: CANCELLED.
-- Interrupted without a request (a cancel meant for the call before it on this
-- session): its transaction rolled back, so it goes back to PENDING, at most five times.
create function asyncproc.abandon(
  execution_id bigint, err_number text, err_message text, out done_seq bigint, out done_status text
)
language plpgsql as $$
declare
  call record;
begin
  select e.cancel_requested, e.recoveries, e.queue, e.status into call
    from asyncproc.executions e where e.id = execution_id for update;
  if call.status = 'RUNNING' and call.cancel_requested then
    update asyncproc.executions e
       set status = 'CANCELLED', finished_at = clock_timestamp(), error_number = err_number,
           error_message = 'cancelled while running: ' || err_message, seq = nextval('asyncproc.change_seq')
     where e.id = execution_id
    returning e.seq, e.status into abandon.done_seq, abandon.done_status;
  elsif call.status = 'RUNNING' and err_number = '57014' and call.recoveries + 1 < 5 then
    update asyncproc.executions e
       set status = 'PENDING', attempts = e.attempts - 1, recoveries = e.recoveries + 1,
           seq = nextval('asyncproc.change_seq')
     where e.id = execution_id
    returning e.seq, e.status into abandon.done_seq, abandon.done_status;
    insert into asyncproc.ready (queue, id) values (call.queue, execution_id);
    perform pg_notify('asyncproc_wake', call.queue);
  elsif call.status = 'RUNNING' then
    select f.done_seq, f.done_status into abandon.done_seq, abandon.done_status
      from asyncproc.finish(execution_id, false, null, err_number, err_message) f;
  end if;
  perform pg_advisory_unlock(x'41535943'::integer, asyncproc.lock_key(execution_id));
end
$$;

-- Create a queue or change its concurrency limit; running activators pick it up at once.
create function asyncproc.configure_queue(queue_name text, concurrency integer) returns asyncproc.queues
language plpgsql as $$
declare
  configured asyncproc.queues;
begin
  insert into asyncproc.queues (name, concurrency) values (queue_name, configure_queue.concurrency)
  on conflict (name) do update set concurrency = excluded.concurrency
  returning * into configured;
  perform pg_notify('asyncproc_queues', queue_name);
  return configured;
end
$$;

-- When the next WAITING call is due (null: none), so activators can wake exactly then.
create function asyncproc.next_due() returns timestamptz
language sql stable as $$
  select min(run_at) from asyncproc.executions where status = 'WAITING'
$$;

-- Register (or re-register) a routine as invocable.
create function asyncproc.register(
  routine regprocedure, queue text default 'default', max_attempts integer default 1, timeout_ms integer default null
) returns text
language sql as $$
  insert into asyncproc.procedures (name, proc, queue, max_attempts, timeout_ms)
  select n.nspname || '.' || p.proname, routine, register.queue, register.max_attempts, register.timeout_ms
    from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where p.oid = routine
  on conflict (name) do update
     set proc = excluded.proc, queue = excluded.queue, max_attempts = excluded.max_attempts, timeout_ms = excluded.timeout_ms
  returning name
$$;

-- Delete finished history older than the retention.
create function asyncproc.purge(older_than interval) returns integer
language sql as $$
  with gone as (
    delete from asyncproc.executions
     where finished_at < clock_timestamp() - older_than and status in ('SUCCEEDED', 'FAILED', 'CANCELLED')
    returning 1)
  select count(*)::integer from gone
$$;
