-- The purge horizon: the newest writer (executions.xid) of any execution retention deleted.
-- A subscriber resuming from a cursor that may not see that writer may have missed a change
-- of a call that is gone since: it is refused with CURSOR_EXPIRED, never resumed with a
-- silent gap. One row; purge() raises it in the transaction that deletes. Seeded with this
-- migration's own transaction: a database upgraded to this may have been purged before, without
-- a horizon kept; a cursor given before the upgrade is refused once, one given after it sees
-- this transaction.
create table asyncproc.purge_horizon (
  only_row boolean primary key default true check (only_row),
  writer   xid8 not null
);
insert into asyncproc.purge_horizon (writer) values (pg_current_xact_id());
