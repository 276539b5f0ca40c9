-- Whether a NULL of a domain passes its constraints (fits: a JSON null argument, or null element,
-- of a domain type): NOT NULL, or a CHECK that a NULL fails, refuses it at run time, where the
-- call would fail after it was accepted. Asked only for a null of a domain, the one case that
-- needs the exception block (a subtransaction).
create or replace function asyncproc.takes_null(type_oid oid) returns boolean
language plpgsql stable as $$
begin
  execute format('select null::%s', format_type(type_oid, -1));
  return true;
exception
  when not_null_violation or check_violation then
    return false;
end
$$;
