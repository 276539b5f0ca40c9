-- Create a queue or change its concurrency limit and its commit grouping (group_size calls
-- at most per transaction, for at most group_ms; null: keep the current value, or the
-- default for a new queue); running activators pick it up at once.
drop function if exists asyncproc.configure_queue(text, integer);
create or replace function asyncproc.configure_queue(
  queue_name text, concurrency integer, group_size integer default null, group_ms integer default null
) returns asyncproc.queues
language plpgsql as $$
declare
  configured asyncproc.queues;
begin
  insert into asyncproc.queues as q (name, concurrency, group_size, group_ms)
  values (queue_name, configure_queue.concurrency, coalesce(configure_queue.group_size, 1), coalesce(configure_queue.group_ms, 50))
  on conflict (name) do update
     set concurrency = excluded.concurrency,
         group_size = coalesce(configure_queue.group_size, q.group_size),
         group_ms = coalesce(configure_queue.group_ms, q.group_ms)
  returning * into configured;
  perform pg_notify('asyncproc_queues', queue_name);
  return configured;
end
$$;
