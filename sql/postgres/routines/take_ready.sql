-- Take the oldest ready call of a queue past after_id that no other transaction is taking:
-- its ready row deleted by this transaction (held until it ends: a cancel, which deletes that
-- row first, waits for it), its id returned; null when there is none. claim() then starts it;
-- run_group() starts it or runs it inside its group. None of a paused queue (pause_queue): the
-- check is part of this statement, so it holds in every process, whether or not its activator
-- has heard of the pause.
create or replace function asyncproc.take_ready(queue_name text, after_id bigint) returns bigint
language plpgsql as $$
declare
  taken bigint;
begin
  delete from asyncproc.ready r
   where r.queue = queue_name
     and r.id = (select x.id from asyncproc.ready x where x.queue = queue_name and x.id > after_id
                  order by x.id limit 1 for update skip locked)
     and not exists (select from asyncproc.queues q where q.name = queue_name and q.paused)
  returning r.id into taken;
  return taken;
end
$$;
