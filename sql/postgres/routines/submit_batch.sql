-- Submit a batch: stages is a JSON array of stages, each an array of calls
-- ({procedure, arguments, queue, runAt, maxAttempts, callerRoles}). One transaction: all or none.
-- Returns the executions in order (their batch_id is the batch). AP004: a malformed batch.
create or replace function asyncproc.submit_batch(
  stages       jsonb,
  on_failure   text default 'CANCEL',
  submitted_by text default null,
  quiet        boolean default false
) returns setof asyncproc.executions
language plpgsql as $$
declare
  new_batch  uuid;
  calls      jsonb;
  stage_no   bigint;
begin
  if jsonb_typeof(stages) is distinct from 'array' or jsonb_array_length(stages) = 0 then
    raise exception 'a batch needs at least one stage' using errcode = 'AP004';
  end if;
  if submit_batch.on_failure not in ('CANCEL', 'CONTINUE') then
    raise exception 'onFailure must be CANCEL or CONTINUE' using errcode = 'AP004';
  end if;
  insert into asyncproc.batches (on_failure, stage_count, submitted_by)
  values (submit_batch.on_failure, jsonb_array_length(stages), submit_batch.submitted_by)
  returning id into new_batch;
  for calls, stage_no in select s.value, s.n from jsonb_array_elements(stages) with ordinality s (value, n) loop
    if jsonb_typeof(calls) <> 'array' or jsonb_array_length(calls) = 0 then
      raise exception 'stage % of the batch has no calls', stage_no using errcode = 'AP004';
    end if;
    return query
      select e.* from jsonb_array_elements(calls) with ordinality c (call, n),
             lateral asyncproc.submit(c.call ->> 'procedure', c.call -> 'arguments', c.call ->> 'queue',
                                      (c.call ->> 'runAt')::timestamptz, (c.call ->> 'maxAttempts')::integer,
                                      submit_batch.submitted_by, quiet, new_batch, stage_no::integer,
                                      asyncproc.text_array(c.call -> 'callerRoles'),
                                      -- refused (AP004): a batch's call takes no idempotency key
                                      idempotency_key => c.call ->> 'idempotencyKey') e
       order by c.n;
  end loop;
end
$$;
