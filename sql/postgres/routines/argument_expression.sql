-- The SQL expression that turns argument `name` of $1 (the arguments object) into a typed value.
-- $1 is cast, so the expression also types a parameter sent untyped (a top-level statement
-- bound by the worker, asyncproc.prepare_call).
-- json, jsonb and domains over them take the JSON value itself, and arrays of them their
-- elements as they are: read as text first, the string "1" arrived as the number 1.
-- PL/pgSQL, as fits: asked for every argument of every run, its plans are kept for the session.
-- format_type(oid, -1): a parameter has no type modifier (fits.sql), so "bpchar", not "character"
-- (character(1)), and "bit" quoted, not bit (bit(1)).
create or replace function asyncproc.argument_expression(name text, type_oid oid) returns text
language plpgsql stable as $$
declare
  t record;
begin
  select p.typtype, p.typelem, p.typcategory into t from pg_type p where p.oid = type_oid;
  -- base_type only for a domain: any other type is its own
  if type_oid in ('json'::regtype, 'jsonb'::regtype)
     or (t.typtype = 'd' and asyncproc.base_type(type_oid) in ('json'::regtype, 'jsonb'::regtype)) then
    return format('($1::jsonb->%L)::%s', name, format_type(type_oid, -1));
  end if;
  if t.typcategory = 'A' and t.typelem <> 0 then
    if asyncproc.base_type(t.typelem) in ('json'::regtype, 'jsonb'::regtype) then
      return format('asyncproc.json_array($1::jsonb->%L)::%s', name, format_type(type_oid, -1));
    end if;
    return format('asyncproc.text_array($1::jsonb->%L)::%s', name, format_type(type_oid, -1));
  end if;
  return format('($1::jsonb->>%L)::%s', name, format_type(type_oid, -1));
end
$$;
