-- Stamps a row's status change with its writer's transaction (the change feed's position).
create or replace function asyncproc.stamp_change() returns trigger
language plpgsql as $$
begin
  new.xid := pg_current_xact_id();
  return new;
end
$$;
