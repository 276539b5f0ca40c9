-- Idempotency keys of batches (submit_batch's idempotency_key; 0018_idempotency_keys.sql for single
-- calls): a caller that is not sure its batch was submitted sends it again with the same key and
-- gets the batch the first one made. A batch's key is its caller's (submitted_by; callers without
-- one share a single scope), apart from the keys of single calls, and is held as long as the batch
-- is: retention's purge frees it with the batch's row. request_digest: what the first one asked
-- for, so that the key sent again with another batch is refused, not replayed.
alter table asyncproc.batches add column idempotency_key text, add column request_digest bytea;
create unique index batches_idempotency_key on asyncproc.batches ((coalesce(submitted_by, '')), idempotency_key)
  where idempotency_key is not null;
