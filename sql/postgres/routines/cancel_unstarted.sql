-- Cancel every member of a batch that has not started (WAITING, held or not, and PENDING).
-- The caller holds the batch row. Ready rows go first, as claim() takes them: a claim in
-- progress is waited for, and its call, RUNNING by then, is left alone. A RUNNING member
-- (locked by its finisher, maybe) does not match and is not waited for.
create or replace function asyncproc.cancel_unstarted(batch uuid, reason text) returns void
language plpgsql as $$
declare
  moved record;
begin
  delete from asyncproc.ready r
   using asyncproc.executions e
   where e.batch_id = batch and e.status = 'PENDING' and r.queue = e.queue and r.id = e.id;
  for moved in
    update asyncproc.executions e
       set status = 'CANCELLED', held = false, finished_at = clock_timestamp(), error_number = 'AP011',
           error_message = reason, seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
     where e.batch_id = batch and e.status in ('WAITING', 'PENDING')
    returning e.id, e.seq
  loop
    perform asyncproc.emit(moved.id, moved.seq, 'CANCELLED');
  end loop;
end
$$;
