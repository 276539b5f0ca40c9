-- The revision of the routines installed (sql/postgres/routines/REVISION, raised with every
-- change of them; test/migrations.test.ts pins it), and a guard: only a migrator of that
-- revision or a newer one may write asyncproc.routines. A process of an older release started
-- after a newer one had upgraded the database (a pod restarted in the middle of a rolling
-- upgrade, a rollback) applied its own older routine files over the newer ones (every file
-- whose digest differs from the one recorded), and every process then ran with them: the
-- cancel gate, the purge horizon, a schedule's time zone were gone until the next restart of
-- a newer process. Its migrator's write of asyncproc.routines now fails, and its whole
-- transaction (the older definitions with it): it refuses to start. A migrator says its
-- revision in the setting asyncproc.routines_revision, for its transaction.
create table if not exists asyncproc.routines (
  name text primary key, sha256 text not null, applied_at timestamptz not null default now());
create table asyncproc.routines_revision (
  only_row boolean primary key default true check (only_row),
  revision integer not null
);
create function asyncproc.routines_guard() returns trigger language plpgsql as $$
declare
  installed integer := (select r.revision from asyncproc.routines_revision r);
  mine      integer := coalesce(nullif(current_setting('asyncproc.routines_revision', true), '')::integer, 0);
begin
  if installed is not null and mine < installed then
    raise exception 'the routines of this database are revision %, installed by a newer asyncproc; this one (revision %) may not replace them', installed, mine
      using errcode = 'AP020', hint = 'Run the newer release here too: a downgrade is not supported (migrations cannot be undone).';
  end if;
  return new;
end
$$;
create trigger routines_guard before insert or update on asyncproc.routines
  for each row execute function asyncproc.routines_guard();
