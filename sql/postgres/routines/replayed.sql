-- The execution a caller's idempotency key made (submit's idempotency_key, 0018_idempotency_keys.sql),
-- if any: null when the key is new. The key sent with another call than the one that made it
-- (another digest) is refused (AP012), naming the execution it made: a caller reusing a key by
-- mistake learns which call holds it, and nothing is submitted.
create or replace function asyncproc.replayed(submitted_by text, idempotency_key text, digest bytea)
returns asyncproc.executions
language plpgsql as $$
declare
  made asyncproc.executions;
begin
  select * into made from asyncproc.executions e
   where coalesce(e.submitted_by, '') = coalesce(replayed.submitted_by, '') and e.idempotency_key = replayed.idempotency_key;
  if found and made.request_digest is distinct from digest and made.xid = pg_current_xact_id_if_assigned() then
    -- made by this same transaction (two calls of one request, one key): it is not committed, and
    -- rolls back with this refusal; naming it would name an execution that never exists
    raise exception 'idempotency key "%" was given to two different calls in one transaction', idempotency_key
      using errcode = 'AP012', hint = 'Give each call its own key.';
  end if;
  if found and made.request_digest is distinct from digest then
    raise exception 'idempotency key "%" was sent before with another call (execution %)', idempotency_key, made.token
      using errcode = 'AP012', hint = 'Send a new key for a new call; the same key only with the very call it was first sent with.';
  end if;
  return made;
end
$$;
