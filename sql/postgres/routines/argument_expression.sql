-- The SQL expression that turns argument `name` of $1 (the arguments object) into a typed value.
-- $1 is cast, so the expression also types a parameter sent untyped (a top-level statement
-- bound by the worker, asyncproc.prepare_call).
-- json, jsonb and domains over them take the JSON value itself, and arrays of them their
-- elements as they are: read as text first, the string "1" arrived as the number 1.
create or replace function asyncproc.argument_expression(name text, type_oid oid) returns text
language sql stable as $$
  select case
    when asyncproc.base_type(type_oid) in ('json'::regtype, 'jsonb'::regtype) then
      format('($1::jsonb->%L)::%s', name, format_type(type_oid, null))
    when t.typcategory = 'A' and t.typelem <> 0 and asyncproc.base_type(t.typelem) in ('json'::regtype, 'jsonb'::regtype) then
      format('asyncproc.json_array($1::jsonb->%L)::%s', name, format_type(type_oid, null))
    when t.typcategory = 'A' and t.typelem <> 0 then
      format('asyncproc.text_array($1::jsonb->%L)::%s', name, format_type(type_oid, null))
    else format('($1::jsonb->>%L)::%s', name, format_type(type_oid, null))
  end
  from pg_type t where t.oid = type_oid
$$;
