-- Whether a value of the type holds a date or a time that is read by the session that reads it
-- (resolve_relative_times): a date/time type ('D': date, time, timetz, timestamp, timestamptz),
-- or a domain, array, range, multirange or composite with one inside, at any depth.
create or replace function asyncproc.holds_time(type_oid oid) returns boolean
language sql stable as $$
  with recursive inside (oid) as (
    select type_oid
    union
    select x.oid
      from inside i
      join pg_type t on t.oid = i.oid
     cross join lateral (
       select t.typbasetype where t.typtype = 'd'
       union all select t.typelem where t.typcategory = 'A' and t.typelem <> 0
       union all select r.rngsubtype from pg_range r where r.rngtypid = t.oid
       union all select r.rngtypid from pg_range r where r.rngmultitypid = t.oid
       union all select a.atttypid from pg_attribute a
                  where t.typtype = 'c' and a.attrelid = t.typrelid and a.attnum > 0 and not a.attisdropped
     ) x (oid)
  )
  select exists (select 1 from inside i join pg_type t on t.oid = i.oid where t.typcategory = 'D')
$$;
