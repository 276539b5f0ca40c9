-- Create a queue or change its concurrency limit; running activators pick it up at once.
create or replace function asyncproc.configure_queue(queue_name text, concurrency integer) returns asyncproc.queues
language plpgsql as $$
declare
  configured asyncproc.queues;
begin
  insert into asyncproc.queues (name, concurrency) values (queue_name, configure_queue.concurrency)
  on conflict (name) do update set concurrency = excluded.concurrency
  returning * into configured;
  perform pg_notify('asyncproc_queues', queue_name);
  return configured;
end
$$;
