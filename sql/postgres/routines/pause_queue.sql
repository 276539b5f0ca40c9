-- Pause a queue (paused true) or resume it (false); returns the queue, null when there is no
-- such queue. A paused queue still takes calls, and they wait PENDING: take_ready() starts none
-- of its calls in any process from the commit of the pause on (the activators also drop their
-- slots of it, told at once by the notification). Calls already running end as they would.
-- Resuming wakes every process's workers of the queue (the same notification).
create or replace function asyncproc.pause_queue(queue_name text, paused boolean) returns asyncproc.queues
language plpgsql as $$
declare
  changed asyncproc.queues;
begin
  update asyncproc.queues q set paused = pause_queue.paused where q.name = queue_name
  returning * into changed;
  if found then
    perform pg_notify('asyncproc_queues', queue_name);
  end if;
  return changed;
end
$$;
