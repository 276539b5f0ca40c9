-- The change feed's position: the transaction that wrote a row's latest status change.
--
-- seq (a sequence value taken at write time) is not commit order: a reader that saw
-- seq 101 never sees 100 if 100 commits later. A row instead records its writer's
-- top-level transaction id (pg_current_xact_id(), 64 bits, never wraps), and a reader
-- remembers the snapshot it read with (pg_current_snapshot()): the rows changed since
-- are exactly those whose xid that snapshot does not see. Whatever commits later has
-- an xid that was in progress or not yet assigned at that snapshot, so nothing is
-- skipped, and no reader waits for a long transaction to end (see src/changeCursor.ts).
alter table asyncproc.executions add column xid xid8 not null default pg_current_xact_id();
create index executions_xid on asyncproc.executions (xid);
drop index asyncproc.executions_seq;

-- Every status change takes a new seq; the trigger stamps the writer with it, so no
-- path (ours, or one added later) can change a row without moving it in the feed.
create function asyncproc.stamp_change() returns trigger
language plpgsql as $$
begin
  new.xid := pg_current_xact_id();
  return new;
end
$$;
create trigger executions_stamp_change
  before update on asyncproc.executions
  for each row when (old.seq is distinct from new.seq)
  execute function asyncproc.stamp_change();
