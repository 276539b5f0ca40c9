-- Settle a batch after one of its executions ended: release the next stage when the
-- current one is complete, cancel the rest when the policy says so, end the batch when
-- nothing is left. Runs in the transaction that recorded the outcome: every path that ends
-- a member calls it right after (finish, abandon, conclude, recover, cancel, cancel_batch;
-- an explicit call, not a row trigger, which cost every update of executions a trigger
-- check); any path added later must too. Members it cancels itself need no settling.
--
-- Why exactly one finisher releases a stage: every caller first locks the batch row.
-- A finisher that waited for that lock runs its next statements (READ COMMITTED) on a
-- snapshot that includes the outcome committed by the finisher before it, and it sees
-- its own; so the last of them, and only the last, finds no unfinished execution.
--
-- Lock order: member rows that change status take their own row first and the batch
-- row second (their writer's call of this). Here, holding the batch row, we touch only WAITING and
-- PENDING members (a RUNNING one, locked by its finisher, does not match and is not
-- waited for), and ready rows before execution rows, as claim() does.
-- cancel() takes the batch row first for a member that has not started.
create or replace function asyncproc.settle_batch(settle_id uuid) returns void
-- lock_timeout = 0: the service's own lock waits, as in finish()
language plpgsql set lock_timeout = 0 as $$
declare
  batch  asyncproc.batches;
  moved  record;
begin
  select * into batch from asyncproc.batches b where b.id = settle_id for update;
  if not found or batch.status <> 'RUNNING' then
    return;
  end if;

  if batch.on_failure = 'CANCEL' and exists (
       select 1 from asyncproc.executions e
        where e.batch_id = settle_id and e.status in ('FAILED', 'CANCELLED')) then
    perform asyncproc.cancel_unstarted(settle_id, 'cancelled: an execution of its batch did not succeed');
  else
    loop
      exit when exists (select 1 from asyncproc.executions e
                         where e.batch_id = settle_id and e.stage <= batch.current_stage
                           and e.status not in ('SUCCEEDED', 'FAILED', 'CANCELLED'));
      exit when batch.current_stage >= batch.stage_count;
      batch.current_stage := batch.current_stage + 1;
      update asyncproc.batches b set current_stage = batch.current_stage where b.id = settle_id;
      for moved in
        update asyncproc.executions e
           set held = false,
               status = case when e.run_at > clock_timestamp() then 'WAITING' else 'PENDING' end,
               seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
         where e.batch_id = settle_id and e.stage = batch.current_stage and e.held
        returning e.id, e.seq, e.queue, e.status
      loop
        if moved.status = 'PENDING' then
          insert into asyncproc.ready (queue, id) values (moved.queue, moved.id);
        end if;
        perform asyncproc.emit(moved.id, moved.seq, moved.status);
        perform pg_notify('asyncproc_wake', moved.queue);   -- identical payloads are sent once
      end loop;
    end loop;
  end if;

  if not exists (select 1 from asyncproc.executions e
                  where e.batch_id = settle_id and e.status not in ('SUCCEEDED', 'FAILED', 'CANCELLED')) then
    update asyncproc.batches b
       set status = case
                      when exists (select 1 from asyncproc.executions e where e.batch_id = settle_id and e.status = 'FAILED') then 'FAILED'
                      when exists (select 1 from asyncproc.executions e where e.batch_id = settle_id and e.status = 'CANCELLED') then 'CANCELLED'
                      else 'SUCCEEDED' end,
           finished_at = clock_timestamp()
     where b.id = settle_id;
  end if;
end
$$;
