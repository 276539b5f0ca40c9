-- asyncproc.invoke_batch with an idempotency key (0020_batch_idempotency_keys.sql), for a backend
-- service that may send a batch again when it cannot tell whether its transaction committed: the
-- same key with the same batch returns the batch the first one made, and submits nothing; with
-- another batch it is refused (AP012). A function of its own, as invoke_once: a DBA's grant names
-- invoke_batch's signature, which stays as it was. Grant it as invoke_batch:
--   grant execute on function asyncproc.invoke_batch_once(text, jsonb, text, text) to app_role;
create or replace function asyncproc.invoke_batch_once(
  idempotency_key text,
  stages       jsonb,
  on_failure   text default 'CANCEL',
  submitted_by text default null
) returns uuid
security definer set search_path = pg_catalog, asyncproc, pg_temp  -- callers need only EXECUTE (0005_permissions.sql)
language sql as $$
  select e.batch_id from asyncproc.submit_batch(stages, on_failure, submitted_by,
                                                idempotency_key => coalesce(idempotency_key, '')) e limit 1
$$;
