-- Grouped commits: a worker of a queue with group_size > 1 runs up to group_size short calls
-- in one transaction (asyncproc.run_group), each under its own savepoint, for at most group_ms
-- before it commits them together. 1 (the default): one transaction per call, as before.
alter table asyncproc.queues
  add column group_size integer not null default 1 check (group_size between 1 and 1000),
  add column group_ms integer not null default 50 check (group_ms between 1 and 10000);
