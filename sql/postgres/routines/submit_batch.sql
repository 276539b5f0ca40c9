-- Submit a batch: stages is a JSON array of stages, each an array of calls
-- ({procedure, arguments, queue, runAt, maxAttempts, callerRoles}). One transaction: all or none.
-- Returns the executions in order (their batch_id is the batch). AP004: a malformed batch.
-- idempotency_key (0020_batch_idempotency_keys.sql): a key this caller (submitted_by) sent before
-- with the same batch returns that batch's executions, and nothing is submitted; with another
-- batch it is refused (AP012); held by another transaction that has not ended, waited for
-- (key_wait) or refused at once (AP013), as submit() does for a single call's key. Checked before
-- anything else: a replay is answered as the first batch was, whatever changed since.
drop function if exists asyncproc.submit_batch(jsonb, text, text, boolean);
create or replace function asyncproc.submit_batch(
  stages       jsonb,
  on_failure   text default 'CANCEL',
  submitted_by text default null,
  quiet        boolean default false,
  idempotency_key text default null,
  key_wait     boolean default true     -- false: a key another transaction holds is refused at once (AP013)
) returns setof asyncproc.executions
language plpgsql as $$
declare
  new_batch  uuid;
  calls      jsonb;
  stage_no   bigint;
  digest     bytea;
  made       asyncproc.batches;
  -- a batch's key is locked apart from a single call's same key (key_lock1/key_lock2's hash of it)
  lock_name  text := chr(2) || 'batch' || chr(2) || idempotency_key;
begin
  if jsonb_typeof(stages) is distinct from 'array' or jsonb_array_length(stages) = 0 then
    raise exception 'a batch needs at least one stage' using errcode = 'AP004';
  end if;
  if submit_batch.on_failure not in ('CANCEL', 'CONTINUE') then
    raise exception 'onFailure must be CANCEL or CONTINUE' using errcode = 'AP004';
  end if;
  for calls, stage_no in select s.value, s.n from jsonb_array_elements(stages) with ordinality s (value, n) loop
    if jsonb_typeof(calls) is distinct from 'array' or jsonb_array_length(calls) = 0 then
      raise exception 'stage % of the batch has no calls', stage_no using errcode = 'AP004';
    end if;
  end loop;
  if idempotency_key is not null then
    perform asyncproc.check_idempotency_key(idempotency_key);
    -- the batch as it was asked for: each call as submit() digests a single call's (not how its
    -- JSON is written, nor the caller's roles, which the service adds), in order, and on_failure
    -- (pg_catalog's functions, named: as submit's digest, a search_path's look-alikes must not decide it)
    digest := pg_catalog.sha256(pg_catalog.convert_to(pg_catalog.jsonb_build_array(
      (select pg_catalog.jsonb_agg((select pg_catalog.jsonb_agg(pg_catalog.jsonb_build_array(c.call ->> 'procedure', coalesce(c.call -> 'arguments', '{}'), c.call ->> 'queue',
                                                            extract(epoch from (c.call ->> 'runAt')::timestamptz),
                                                            (c.call ->> 'maxAttempts')::integer) order by c.n)
                           from pg_catalog.jsonb_array_elements(st.calls) with ordinality c (call, n)) order by st.n)
         from pg_catalog.jsonb_array_elements(stages) with ordinality st (calls, n)),
      submit_batch.on_failure)::text, 'UTF8'));
    -- held by every transaction that submits a batch with the key until it ends, as in submit()
    if key_wait then
      perform pg_advisory_xact_lock(asyncproc.key_lock1(submit_batch.submitted_by, lock_name),
                                    asyncproc.key_lock2(submit_batch.submitted_by, lock_name));
    elsif not pg_try_advisory_xact_lock(asyncproc.key_lock1(submit_batch.submitted_by, lock_name),
                                        asyncproc.key_lock2(submit_batch.submitted_by, lock_name)) then
      raise exception 'idempotency key "%" is in use by a transaction that has not ended', idempotency_key
        using errcode = 'AP013', hint = 'Send the batch again in a moment: the same batch then gets the one that transaction made, if it committed.';
    end if;
    select * into made from asyncproc.batches b
     where coalesce(b.submitted_by, '') = coalesce(submit_batch.submitted_by, '') and b.idempotency_key = submit_batch.idempotency_key;
    if found then
      if made.request_digest is distinct from digest then
        raise exception 'idempotency key "%" was sent before with another batch (batch %)', idempotency_key, made.id
          using errcode = 'AP012', hint = 'Send a new key for a new batch; the same key only with the very batch it was first sent with.';
      end if;
      return query select e.* from asyncproc.executions e where e.batch_id = made.id order by e.stage, e.id;
      return;
    end if;
  end if;
  -- under the key's lock no other transaction is inserting it; a row this transaction's snapshot
  -- does not see (REPEATABLE READ or SERIALIZABLE, begun before another committed the key) fails
  -- it with 40001 below, which can be tried again, instead of a unique violation
  insert into asyncproc.batches (on_failure, stage_count, submitted_by, idempotency_key, request_digest)
  values (submit_batch.on_failure, jsonb_array_length(stages), submit_batch.submitted_by, submit_batch.idempotency_key, digest)
  on conflict do nothing
  returning id into new_batch;
  if new_batch is null then
    raise exception 'idempotency key "%" was taken by a batch this transaction cannot read', idempotency_key
      using errcode = 'serialization_failure';
  end if;
  for calls, stage_no in select s.value, s.n from jsonb_array_elements(stages) with ordinality s (value, n) loop
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
