-- Live progress (asyncproc.progress()): the latest progress a running call reported. The
-- worker writes it from its own pool connection, outside the call's transaction, so it is
-- visible while the call runs and even if the call is rolled back. The foreign key's check
-- takes KEY SHARE on the execution's row, which the call's own NO KEY UPDATEs do not block;
-- a purged execution takes its progress with it.
create table asyncproc.execution_progress (
  execution_id bigint primary key references asyncproc.executions (id) on delete cascade,
  percent      numeric not null check (percent between 0 and 100),
  message      text check (length(message) <= 200),
  at           timestamptz not null default clock_timestamp()
);
revoke all on asyncproc.execution_progress from public;
