-- Batches are settled by an explicit call of asyncproc.settle_batch() in every routine that
-- ends a member (see settle_batch.sql), not by a row trigger: an AFTER trigger with a WHEN
-- condition cost every update of executions its check, batch member or not, about a tenth
-- of a drained call's backend CPU.
drop trigger if exists executions_batch_member_ended on asyncproc.executions;
drop function if exists asyncproc.batch_member_ended();
-- its routine file is gone: forget it, so that an upgraded database lists what a new one does
do $$
begin
  if to_regclass('asyncproc.routines') is not null then
    delete from asyncproc.routines where name = 'batch_member_ended.sql';
  end if;
end
$$;
