-- Withdraw a registration: nothing new can be submitted for it. The row stays (marked), so
-- the executions submitted before still run and stay readable; register brings it back.
-- AP006: not registered.
create or replace function asyncproc.unregister(procedure text) returns text
language plpgsql as $$
begin
  update asyncproc.procedures r set unregistered_at = now()
   where r.name = unregister.procedure and r.unregistered_at is null;
  if not found then
    raise exception 'procedure "%" is not registered', unregister.procedure using errcode = 'AP006';
  end if;
  return unregister.procedure;
end
$$;
