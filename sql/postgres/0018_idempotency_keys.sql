-- Idempotency keys: a caller that is not sure its call was submitted (its invoke timed out, got a
-- 503, lost its connection while the commit was on its way) sends it again with the same key, and
-- gets the execution the first one made: nothing is submitted twice. A key belongs to its caller
-- (submitted_by; callers without one share a single scope) and is held as long as the execution's
-- history is: retention's purge frees it with the row. request_digest: what the first call asked
-- for (asyncproc.submit), so that a key sent again with another call is refused, not replayed.
-- Adding nullable columns without a default rewrites nothing; the index is partial, so a call
-- without a key (and every new version of its row an update writes) gets no entry in it.
alter table asyncproc.executions add column idempotency_key text, add column request_digest bytea;
create unique index executions_idempotency_key on asyncproc.executions ((coalesce(submitted_by, '')), idempotency_key)
  where idempotency_key is not null;
