-- Called by a running procedure: report how far it has got. A NOTICE is not transactional
-- and reaches the worker's connection at once; the worker (src/engines/postgres/progress.ts)
-- knows which execution its connection runs, stores the latest report outside the call's
-- transaction (at most a few a second) and tells every service process. Outside a worker
-- (psql, a direct call) it is only a notice. Procedures run as the service's role, which
-- owns this function, so no grant is needed; a SECURITY DEFINER procedure owned by another
-- role needs `grant execute on function asyncproc.progress(numeric, text)` for its owner.
create or replace function asyncproc.progress(percent numeric, message text default null) returns void
language plpgsql as $$
declare
  level text := current_setting('client_min_messages');
begin
  if percent is null or percent < 0 or percent > 100 then
    raise exception 'asyncproc.progress: percent must be between 0 and 100, not %', coalesce(percent::text, 'null')
      using errcode = 'invalid_parameter_value';
  end if;
  -- a procedure (or the server's configuration) may have silenced notices: not this one
  if level not in ('debug5', 'debug4', 'debug3', 'debug2', 'debug1', 'log', 'notice') then
    perform set_config('client_min_messages', 'notice', true);
  end if;
  -- 'execution': set by run_group() for the calls of a grouped commit after its first, whose
  -- worker cannot know which of them runs now; absent, the worker's own call is meant
  raise notice 'asyncproc.progress %', jsonb_strip_nulls(jsonb_build_object('percent', percent, 'message', left(message, 200),
    'execution', nullif(current_setting('asyncproc.execution', true), '')));
  if level not in ('debug5', 'debug4', 'debug3', 'debug2', 'debug1', 'log', 'notice') then
    perform set_config('client_min_messages', level, true);
  end if;
end
$$;
