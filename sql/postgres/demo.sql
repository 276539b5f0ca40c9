-- Demo procedures: installed and registered by the embedded default, or with --demo / ASYNCPROC_DEMO=1.
-- Re-runnable: every statement replaces or skips what is there.
create schema if not exists demo;

create table if not exists demo.ledger (
  id          bigint generated always as identity primary key,
  tag         text not null,
  recorded_at timestamptz not null default clock_timestamp()
);
create index if not exists ledger_tag on demo.ledger (tag);

-- reports its progress (asyncproc.progress) as it starts and as it wakes
create or replace procedure demo.sleep(seconds double precision)
language plpgsql as $$
begin
  perform asyncproc.progress(0, 'sleeping');
  perform pg_sleep(seconds);
  perform asyncproc.progress(100, 'awake');
end $$;

-- live progress seen while a call runs: records tag (visible only when the call commits),
-- reports half way, then holds until a row tagged tag || '/go' is committed (by another call of
-- demo.record), at most two minutes, and reports done
create or replace procedure demo.halfway(tag text)
language plpgsql as $$
declare
  deadline timestamptz := clock_timestamp() + interval '120 seconds';
begin
  insert into demo.ledger (tag) values (halfway.tag);
  perform asyncproc.progress(50, 'half way');
  -- read committed: each statement sees what was committed before it began
  while not exists (select 1 from demo.ledger l where l.tag = halfway.tag || '/go') and clock_timestamp() < deadline loop
    perform pg_sleep(0.05);
  end loop;
  perform asyncproc.progress(100, 'done');
end $$;

create or replace procedure demo.fail(message text)
language plpgsql as $$ begin raise exception '%', message; end $$;

create or replace procedure demo.add(a integer, b integer, out total integer)
language plpgsql as $$ begin total := a + b; end $$;

create or replace procedure demo.record(tag text)
language sql as $$ insert into demo.ledger (tag) values (tag) $$;

create or replace procedure demo.noop()
language plpgsql as $$ begin end $$;

-- money-like exact values keep four decimals; a timestamp given as yyyy-mm-dd is that day
create or replace procedure demo.echo_money(amount numeric(19,4), out same numeric(19,4))
language plpgsql as $$ begin same := amount; end $$;

create or replace procedure demo.date_parts(at timestamp, out month integer, out day integer)
language plpgsql as $$ begin month := extract(month from at); day := extract(day from at); end $$;

select asyncproc.register('demo.sleep(double precision)');
select asyncproc.register('demo.fail(text)');
select asyncproc.register('demo.add(integer, integer)');
select asyncproc.register('demo.record(text)');
select asyncproc.register('demo.noop()');
select asyncproc.register('demo.echo_money(numeric)');
select asyncproc.register('demo.date_parts(timestamp without time zone)');
select asyncproc.register('demo.halfway(text)');
