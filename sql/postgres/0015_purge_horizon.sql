-- The purge horizon: the newest writer (executions.xid) of any execution retention deleted.
-- A subscriber resuming from a cursor that may not see that writer may have missed a change
-- of a call that is gone since: it is refused with CURSOR_EXPIRED, never resumed with a
-- silent gap. One row; purge() raises it in the transaction that deletes.
create table asyncproc.purge_horizon (
  only_row boolean primary key default true check (only_row),
  writer   xid8 not null
);
