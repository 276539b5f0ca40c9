-- Every writer of a status change stamps its transaction itself (xid = pg_current_xact_id()
-- beside seq = nextval(...), one line in each UPDATE): the row trigger that did it cost a
-- PL/pgSQL call per update, about a twelfth of a drained call's database work.
-- test/postgres.test.ts checks that every UPDATE of executions moving seq also sets xid.
drop trigger if exists executions_stamp_change on asyncproc.executions;
drop function if exists asyncproc.stamp_change();
-- its routine file is gone: forget it, so that an upgraded database lists what a new one does
do $$
begin
  if to_regclass('asyncproc.routines') is not null then
    delete from asyncproc.routines where name = 'stamp_change.sql';
  end if;
end
$$;
