-- caller_roles: the roles of a caller the service has verified; a procedure registered with
-- roles refuses (AP005) a caller holding none of them and not admin. null: not checked (SQL
-- callers in their own transactions, the service with authentication off).
-- idempotency_key (0018_idempotency_keys.sql): a key this caller (submitted_by) sent before with
-- the same call returns that call's execution, and nothing is submitted; with another call it is
-- refused (AP012); held by another transaction that has not ended, waited for (key_wait) or refused
-- at once (AP013). Checked
-- before anything else: a replay is answered as the first call was, whatever changed since (the
-- procedure unregistered, the caller's roles).
drop function if exists asyncproc.submit(text, jsonb, text, timestamptz, integer, text, boolean, uuid, integer);
drop function if exists asyncproc.submit(text, jsonb, text, timestamptz, integer, text, boolean, uuid, integer, text[]);
drop function if exists asyncproc.submit(text, jsonb, text, timestamptz, integer, text, boolean, uuid, integer, text[], text);
create or replace function asyncproc.submit(
  procedure    text,
  arguments    jsonb default '{}',
  queue        text default null,
  run_at       timestamptz default null,
  max_attempts integer default null,
  submitted_by text default null,
  quiet        boolean default false,   -- true: the caller notifies after its commit
  in_batch     uuid default null,
  in_stage     integer default null,    -- 1-based; stages after the first are held
  caller_roles text[] default null,
  idempotency_key text default null,
  key_wait     boolean default true     -- false: a key another transaction holds is refused at once (AP013)
) returns asyncproc.executions
language plpgsql as $$
declare
  registered asyncproc.procedures;
  routine    regprocedure;
  submitted  asyncproc.executions;
  problems   text;
  queue_name text;
  refused    text;
  is_held    boolean := in_batch is not null and coalesce(in_stage, 1) > 1;
  digest     bytea;
begin
  arguments := coalesce(arguments, '{}');
  if idempotency_key is not null then
    perform asyncproc.check_idempotency_key(idempotency_key);
    if in_batch is not null then
      raise exception 'a call of a batch takes no idempotency key (the batch takes one)' using errcode = 'AP004';
    end if;
    -- the call as it was asked for, before any default or resolution is applied (run_at as an
    -- epoch: its text would follow the session's TimeZone)
    -- pg_catalog's functions, named: another schema of the session's search_path with exact-typed
    -- look-alikes would otherwise make every call one digest (a probe's hostile search_path)
    digest := pg_catalog.sha256(pg_catalog.convert_to(pg_catalog.jsonb_build_array(submit.procedure, arguments, submit.queue,
                                                  extract(epoch from submit.run_at), submit.max_attempts)::text, 'UTF8'));
    -- Every transaction that submits with the key holds this lock until it ends, so under it no
    -- other is inserting the key. A caller's own transaction (invoke_once, the library's invoke,
    -- a procedure a worker runs) waits for it, as for any row lock, and then replays what the other
    -- committed. The service's own statements (key_wait false) are refused at once instead (AP013,
    -- send it again shortly): one of them waiting on a caller's long transaction froze every single
    -- invoke of its instance, which share one statement at a time (SubmitCoalescer). The same
    -- transaction takes the lock again at once.
    if key_wait then
      perform pg_advisory_xact_lock(asyncproc.key_lock1(submit.submitted_by, submit.idempotency_key),
                                    asyncproc.key_lock2(submit.submitted_by, submit.idempotency_key));
    elsif not pg_try_advisory_xact_lock(asyncproc.key_lock1(submit.submitted_by, submit.idempotency_key),
                                        asyncproc.key_lock2(submit.submitted_by, submit.idempotency_key)) then
      raise exception 'idempotency key "%" is in use by a transaction that has not ended', idempotency_key
        using errcode = 'AP013', hint = 'Send the call again in a moment: the same call then gets the execution that transaction made, if it committed.';
    end if;
    submitted := asyncproc.replayed(submit.submitted_by, submit.idempotency_key, digest);
    if submitted.id is not null then
      return submitted;
    end if;
  end if;
  if jsonb_typeof(arguments) <> 'object' then
    raise exception 'arguments must be a JSON object keyed by parameter name' using errcode = 'AP002';
  end if;
  select * into registered from asyncproc.procedures r where r.name = submit.procedure and r.unregistered_at is null;
  if not found then
    -- registered names are schema-qualified: name the ones a bare name may have meant
    raise exception 'procedure "%" is not registered', submit.procedure using errcode = 'AP001',
      hint = (select coalesce('Registered names are schema-qualified: did you mean ' || string_agg(r.name, ' or ' order by r.name) || '?', '')
                from asyncproc.procedures r
               where r.unregistered_at is null and position('.' in submit.procedure) = 0
                 and r.name like '%.' || replace(replace(replace(submit.procedure, E'\\', E'\\\\'), '_', E'\\_'), '%', E'\\%'));
  end if;
  if caller_roles is not null and cardinality(registered.roles) > 0
     and not (registered.roles && caller_roles or 'admin' = any(caller_roles)) then
    raise exception 'the caller''s roles do not allow invoking "%"', registered.name using errcode = 'AP005';
  end if;
  routine := asyncproc.current_routine(registered.proc, registered.signature);
  if routine is null then
    raise exception 'procedure "%" is registered, but % no longer exists in the database', registered.name,
                    coalesce(registered.signature, 'its routine')
      using errcode = 'AP001', hint = 'Create it again, or register the routine that replaced it.';
  end if;
  -- a registration an earlier release made of a routine register refuses now (PostgreSQL's own)
  refused := asyncproc.refused_routine(routine);
  if refused is not null then
    raise exception 'procedure "%" is %, not a procedure to run as a call', registered.name, refused
      using errcode = 'AP001', hint = 'It was registered before the service refused such routines: unregister it.';
  end if;
  if submit.max_attempts is not null and submit.max_attempts not between 1 and 100 then
    raise exception 'maxAttempts must be between 1 and 100' using errcode = 'AP002';
  end if;

  select string_agg(problem, '; ' order by ord, problem) into problems from (
    select 1 as ord, format('unknown argument "%s"', k) as problem
      from jsonb_object_keys(arguments) k
     where not exists (select 1 from asyncproc.parameters p
                        where p.proc = routine and p.name = k and p.mode in ('IN', 'INOUT', 'VARIADIC'))
    union all
    select 2, format('missing argument "%s" (%s)', p.name, p.type_name)
      from asyncproc.parameters p
     where p.proc = routine and p.mode in ('IN', 'INOUT', 'VARIADIC') and not p.has_default
       and not arguments ? p.name
    union all
    select 3, format('argument "%s": %s is not a valid %s', p.name, arguments -> p.name, p.type_name)
      from asyncproc.parameters p
     where p.proc = routine and p.mode in ('IN', 'INOUT', 'VARIADIC') and arguments ? p.name
       and not asyncproc.fits(arguments -> p.name, p.type_oid)
  ) found;
  if problems is not null then
    raise exception 'invalid arguments for %: %', registered.name, problems using errcode = 'AP002';
  end if;
  -- cheap test first: most calls hold no text a date or time is read from (a relative moment,
  -- digits with a date's or time's separator between them, a month's name, or ISO 8601's basic
  -- form: a date and time '20240601T120000', or a string that is a date '20240601' or a time
  -- '120000' alone). Any six digits in a row sent every call with an id past 99,999 down the
  -- slow path, 70% more CPU a submit
  -- (E'': the backslashes mean the same whatever the session's standard_conforming_strings)
  if arguments::text ~* E'(now|today|tomorrow|yesterday)|\\d[-/.:]\\d|\\d{8}T\\d|"\\d{6}"|"\\d{8}"|(jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)' then
    arguments := asyncproc.resolve_relative_times(arguments, routine);
  end if;

  queue_name := coalesce(submit.queue, registered.queue);
  perform 1 from asyncproc.queues q where q.name = queue_name;
  if not found then
    raise exception 'queue "%" does not exist', queue_name using errcode = 'AP003';
  end if;

  if submit.idempotency_key is null then
    insert into asyncproc.executions (procedure, arguments, queue, status, run_at, max_attempts, submitted_by,
                                      batch_id, stage, held)
    values (registered.name, arguments, queue_name,
            case when is_held or submit.run_at > clock_timestamp() then 'WAITING' else 'PENDING' end, submit.run_at,
            coalesce(submit.max_attempts, registered.max_attempts), submit.submitted_by,
            in_batch, case when in_batch is not null then coalesce(in_stage, 1) end, is_held)
    returning * into submitted;
  else
    -- (never in a batch: refused above)
    insert into asyncproc.executions (procedure, arguments, queue, status, run_at, max_attempts, submitted_by,
                                      idempotency_key, request_digest)
    values (registered.name, arguments, queue_name,
            case when submit.run_at > clock_timestamp() then 'WAITING' else 'PENDING' end, submit.run_at,
            coalesce(submit.max_attempts, registered.max_attempts), submit.submitted_by, submit.idempotency_key, digest)
    -- under the key's lock no other transaction is inserting it; a row this transaction's
    -- snapshot does not see (REPEATABLE READ or SERIALIZABLE, begun before another committed the
    -- key) fails it with 40001 here, which can be tried again, instead of a unique violation.
    -- No conflict target: the key's index is on an expression of a column named as a parameter
    -- here, which a target cannot qualify; the other unique columns (id, token) are generated.
    on conflict do nothing
    returning * into submitted;
    if not found then
      submitted := asyncproc.replayed(submit.submitted_by, submit.idempotency_key, digest);
      if submitted.id is null then
        -- the row it met is not there to read (purged in between): a try later finds the key free
        raise exception 'idempotency key "%" was taken by a call this transaction cannot read', idempotency_key
          using errcode = 'serialization_failure';
      end if;
      return submitted;
    end if;
  end if;
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
