-- Recurring schedules (issue 15). A schedule starts its procedure at the instants of a
-- cron expression in a time zone. The service computes each next instant (croner, which
-- knows the time zone's daylight-saving rules) and stores it in next_run_at; a fire is the
-- one transaction that moves next_run_at forward and submits the call
-- (asyncproc.fire_due_schedules), so a fire happens exactly once however many processes race.
create table asyncproc.schedules (
  name              text primary key check (name ~ '^[A-Za-z0-9_.:-]{1,128}$'),
  procedure         text not null,
  arguments         jsonb not null default '{}',
  cron              text not null,
  timezone          text not null default 'UTC',
  queue             text,                 -- null: the procedure's registered queue at each fire
  max_attempts      integer check (max_attempts between 1 and 100),
  overlap           text not null default 'ALLOW' check (overlap in ('ALLOW', 'SKIP')),
  catch_up          text not null default 'ONCE' check (catch_up in ('ONCE', 'SKIP')),
  paused            boolean not null default false,
  next_run_at       timestamptz,          -- null while paused
  last_run_at       timestamptz,          -- when it last fired (the scheduled instant it fired for is the execution's run_at)
  last_execution_id bigint,               -- the execution it started last (overlap SKIP looks at it)
  created_at        timestamptz not null default clock_timestamp(),
  created_by        text,
  updated_at        timestamptz not null default clock_timestamp()
);
create index schedules_due on asyncproc.schedules (next_run_at) where not paused;

-- The schedule that started an execution (null: invoked directly).
alter table asyncproc.executions add column schedule_name text;
create index executions_schedule on asyncproc.executions (schedule_name, id) where schedule_name is not null;
