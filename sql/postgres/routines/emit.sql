create or replace function asyncproc.emit(execution_id bigint, seq bigint, status text) returns void
language sql as $$ select pg_notify('asyncproc_events', execution_id || ':' || seq || ':' || status) $$;
