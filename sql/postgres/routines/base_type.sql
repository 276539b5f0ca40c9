-- The type a domain is built on, through domains over domains; any other type is its own (null:
-- no such type). What a value of the domain is, to the conversions of arguments and results: a
-- domain over jsonb is JSON (never text read again as JSON), a domain over a composite type is a row.
-- PL/pgSQL, as fits and argument_expression that ask it for every argument of every call: its
-- plans are kept for the session, where a SQL function's body is planned again in each statement.
create or replace function asyncproc.base_type(type_oid oid) returns oid
language plpgsql stable as $$
declare
  current oid := type_oid;
  kind    "char";
  base    oid;
begin
  loop
    select t.typtype, t.typbasetype into kind, base from pg_type t where t.oid = current;
    if not found then
      return null;
    end if;
    if kind <> 'd' then
      return current;
    end if;
    current := base;
  end loop;
end
$$;
