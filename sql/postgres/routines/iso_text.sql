-- A value as text in ISO 8601 dates (resolve_relative_times): the value was read by the caller's
-- session (its TimeZone, DateStyle, 'now'); written here with DateStyle ISO, so that a session
-- with another DateStyle (the worker's) reads it back the same. A timestamptz is written with its
-- offset, so another TimeZone reads the same instant. The SET clauses hold while the function
-- runs, and its argument is evaluated before, by the caller ("CREATE FUNCTION", SET).
create or replace function asyncproc.iso_text(value anyelement) returns text
language sql stable
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
as $$
  select value::text
$$;
