-- Held members wait for their stage, not for a time.
create or replace function asyncproc.release_due() returns integer
language plpgsql as $$
declare
  released integer := 0;
  due      record;
begin
  for due in
    update asyncproc.executions e
       set status = 'PENDING', seq = nextval('asyncproc.change_seq'), xid = pg_current_xact_id()
     where e.status = 'WAITING' and not e.held and e.run_at <= clock_timestamp()
    returning e.id, e.seq, e.queue
  loop
    released := released + 1;
    insert into asyncproc.ready (queue, id) values (due.queue, due.id);
    perform asyncproc.emit(due.id, due.seq, 'PENDING');
    perform pg_notify('asyncproc_wake', due.queue);
  end loop;
  return released;
end
$$;
