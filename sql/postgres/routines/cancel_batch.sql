-- Cancel a whole batch, step one: every member that has not started ends CANCELLED, in one
-- transaction that holds the batch row first (settle_batch's lock order: batch row, then
-- ready rows, then member rows, touching WAITING and PENDING members only). Running members
-- are step two, asyncproc.cancel_batch_running(), in a transaction of its own: a finisher
-- holds its member row while it waits for the batch row, so we never wait for a running
-- member while holding its batch.
-- outcome: CANCELLED (step two may follow), FINISHED (the batch had ended), NOT_FOUND.
create or replace function asyncproc.cancel_batch(cancel_id uuid, out outcome text)
language plpgsql as $$
begin
  perform 1 from asyncproc.batches b where b.id = cancel_id;
  if not found then
    outcome := 'NOT_FOUND';
    return;
  end if;
  perform 1 from asyncproc.batches b where b.id = cancel_id and b.status = 'RUNNING' for update;
  if not found then
    outcome := 'FINISHED';
    return;
  end if;
  perform asyncproc.cancel_unstarted(cancel_id, 'cancelled with its batch');
  -- it ends now if nothing is running
  perform asyncproc.settle_batch(cancel_id);
  outcome := 'CANCELLED';
end
$$;
