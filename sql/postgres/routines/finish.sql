-- Record an outcome (and retry when attempts are left). Used by run() and by abandon()
-- when a call escaped run() (cancelled statement, timeout) and must still end. Only the
-- session that claimed the call may end it: a worker that lost its lock (recover then
-- started the call again elsewhere) must not overwrite the state of the new run.
-- member_started, member_worker: the call is a member of a grouped commit that this
-- transaction took PENDING and locked (run_group()) and ran without making it RUNNING first:
-- its start (time, attempt, worker, session) is recorded here, with its end, in one update.
drop function if exists asyncproc.finish(bigint, boolean, jsonb, text, text, text, text);
create or replace function asyncproc.finish(
  execution_id bigint, succeeded boolean, outcome jsonb,
  err_number text default null, err_message text default null, err_detail text default null, err_context text default null,
  member_started timestamptz default null, member_worker text default null,
  out done_seq bigint, out done_status text
)
-- the service's own lock waits (a batch row, the call's row or lock) are not cut by a database's
-- default lock_timeout: cut after a call ran, they failed a call that had succeeded, or dropped
-- the worker's session and ran it again; the call itself keeps the caller's lock_timeout
language plpgsql set lock_timeout = 0 as $$
declare
  ended_batch uuid;
  member      boolean := member_started is not null;
  -- the attempt this end closes: a member's is counted here, a claimed call's was counted by its claim
  started     integer := case when member then 1 else 0 end;
begin
  -- by its key: `(status = 'RUNNING') is true` is not a condition the planner proves the partial
  -- index executions_active from, so it cannot prefer a walk of every RUNNING entry (each call's
  -- RUNNING version stays in that index until vacuumed: the walk grows with the drain)
  update asyncproc.executions e
     set status = case
                    when succeeded then 'SUCCEEDED'
                    when e.attempts + started < e.max_attempts then 'WAITING'
                    else 'FAILED' end,
         -- exponential backoff with jitter: about 2^attempts seconds, at most five minutes
         run_at = case when not succeeded and e.attempts + started < e.max_attempts
                       then clock_timestamp() + least(300, 2 ^ (e.attempts + started)) * (0.75 + random() / 2) * interval '1 second'
                       else e.run_at end,
         finished_at = case when succeeded or e.attempts + started >= e.max_attempts then clock_timestamp() end,
         attempts = e.attempts + started,
         started_at = case when member then member_started else e.started_at end,
         worker = case when member then member_worker else e.worker end,
         backend_pid = case when member then pg_backend_pid() else e.backend_pid end,
         transactional = case when member then true else e.transactional end,
         result = case when succeeded then outcome else null end,
         error_number = err_number, error_message = err_message, error_detail = err_detail, error_context = err_context,
         seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
   where e.id = execution_id
     and case when member then e.status = 'PENDING'
              else (e.status = 'RUNNING') is true and e.backend_pid = pg_backend_pid() end
  returning e.seq, e.status, e.batch_id into finish.done_seq, finish.done_status, ended_batch;
  if ended_batch is not null and finish.done_status in ('SUCCEEDED', 'FAILED') then
    perform asyncproc.settle_batch(ended_batch);
  end if;
  if finish.done_status = 'WAITING' then
    insert into asyncproc.attempts (execution_id, number, status, started_at, finished_at, worker, backend_pid,
                                    error_number, error_message, error_detail, error_context)
    select e.id, e.attempts + e.recoveries, 'FAILED', e.started_at, clock_timestamp(), e.worker, e.backend_pid,
           err_number, err_message, err_detail, err_context
      from asyncproc.executions e where e.id = execution_id;
  end if;
end
$$;
