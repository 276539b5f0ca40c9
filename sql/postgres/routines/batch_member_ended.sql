-- Every path that ends an execution (run, finish, abandon, recover, cancel, and any
-- added later) settles its batch in the same transaction. Settling cancels members
-- itself; those nested changes do not settle again (marked by a transaction-local
-- setting, not by trigger depth: a caller's own trigger may end a member too).
create or replace function asyncproc.batch_member_ended() returns trigger
language plpgsql as $$
begin
  if current_setting('asyncproc.settling', true) is distinct from new.batch_id::text then
    perform set_config('asyncproc.settling', new.batch_id::text, true);
    perform asyncproc.settle_batch(new.batch_id);
    perform set_config('asyncproc.settling', '', true);
  end if;
  return null;
end
$$;
