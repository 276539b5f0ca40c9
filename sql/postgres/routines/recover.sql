-- How many calls whose worker session is gone were taken (asyncproc.recover_lost says which).
create or replace function asyncproc.recover(max_recoveries integer default 5) returns integer
language plpgsql as $$
begin
  return (select count(*)::integer from asyncproc.recover_lost(max_recoveries));
end
$$;
