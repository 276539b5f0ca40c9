-- Fire the due schedules the service has planned: `fires` is a JSON array of
-- { name, due, next, missed } where `due` is the schedule's next_run_at as the service read
-- it, `next` the instant after it that croner computed, and `missed` whether `due` was missed
-- (the service was down past it: see src/schedules.ts).
--
-- Exactly once: a fire is this transaction, which moves next_run_at from `due` to `next`
-- and submits the call together. The row is taken only while next_run_at still equals
-- `due` (a compare-and-set under the row lock), and `skip locked` passes over a row another
-- process is firing now: a racer finds it locked, or finds next_run_at moved on, and does
-- nothing. The plan is computed before the transaction and nothing is stored until it
-- commits, so a crash anywhere before the commit leaves next_run_at at `due` (the next tick
-- fires it) and a crash after it leaves the fire done and next_run_at moved (never again).
create or replace function asyncproc.fire_due_schedules(now timestamptz, fires jsonb)
returns setof asyncproc.executions
language plpgsql as $$
declare
  fire     record;
  s        asyncproc.schedules;
  started  asyncproc.executions;
  previous text;
  fires_now boolean;
  zone      text := current_setting('TimeZone');
  refused   text;
  why       text;
begin
  for fire in
    select f.name, f.due, f.next, coalesce(f.missed, false) as missed
      from jsonb_to_recordset(fires) as f (name text, due timestamptz, next timestamptz, missed boolean)
  loop
    select * into s from asyncproc.schedules x
     where x.name = fire.name and x.next_run_at = fire.due and not x.paused and x.next_run_at <= fire_due_schedules.now
       for update skip locked;
    continue when not found;
    if fire.next is not null and fire.next <= fire.due then
      raise exception 'schedule "%": next run % is not after %', s.name, fire.next, fire.due;
    end if;
    -- missed fires (everything was down) collapse into one (catch_up ONCE) or none (SKIP)
    fires_now := not fire.missed or s.catch_up = 'ONCE';
    if fires_now and s.overlap = 'SKIP' and s.last_execution_id is not null then
      select e.status into previous from asyncproc.executions e where e.id = s.last_execution_id;
      fires_now := previous is null or previous in ('SUCCEEDED', 'FAILED', 'CANCELLED');
    end if;
    started := null;
    refused := null;
    if fires_now then
      begin
        -- relative dates in its arguments ('today', 'tomorrow 08:00') are read in the schedule's
        -- time zone, not the session's: for this transaction, and reverted by the block's end or
        -- its exception (a zone PostgreSQL does not know leaves the session's, as before)
        begin
          perform set_config('TimeZone', s.timezone, true);
        exception when invalid_parameter_value then
          null;
        end;
        -- run_at: the scheduled instant this execution stands for
        started := asyncproc.submit(s.procedure, s.arguments, s.queue, fire.due, s.max_attempts, s.created_by);
        perform set_config('TimeZone', zone, true);
      exception when others then
        -- what may pass (a deadlock, a serialization failure, a lock or resource limit, the server
        -- shutting down, an internal error) is raised: the page is fired again at the next tick
        if left(sqlstate, 2) in ('40', '53', '55', '57', '58', 'XX') then
          raise;
        end if;
        refused := sqlstate;
        why := sqlerrm;
      end;
      if refused is not null then
        -- a call that cannot be submitted fails visibly, and alone: a FAILED execution, in the queue
        -- its call would have had (the schedule's, else the procedure's registered one). A procedure
        -- unregistered or changed since (AP001–AP005), or arguments its types now refuse (a
        -- domain's check raising, say): raised, it rolled back the whole page, and this schedule,
        -- the oldest due, headed every page after it, so no schedule fired in any process again
        insert into asyncproc.executions (procedure, arguments, queue, status, run_at, finished_at, max_attempts,
                                          submitted_by, error_number, error_message)
        values (s.procedure, s.arguments,
                coalesce(s.queue, (select r.queue from asyncproc.procedures r where r.name = s.procedure), 'default'),
                'FAILED', fire.due, clock_timestamp(),
                coalesce(s.max_attempts, 1), s.created_by, refused, 'schedule "' || s.name || '": ' || why)
        returning * into started;
        perform asyncproc.emit(started.id, started.seq, started.status);
      end if;
      update asyncproc.executions e set schedule_name = s.name where e.id = started.id returning * into started;
    end if;
    update asyncproc.schedules x
       set next_run_at = fire.next,
           last_run_at = case when fires_now then fire_due_schedules.now else x.last_run_at end,
           last_execution_id = coalesce(started.id, x.last_execution_id)
     where x.name = s.name;
    if started.id is not null then
      return next started;
    end if;
  end loop;
end
$$;
