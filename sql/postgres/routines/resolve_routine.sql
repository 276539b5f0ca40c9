-- The routine a name means, for register: a signature (`billing.charge_order(bigint)`), or a bare
-- name (`billing.charge_order`, or unqualified `charge_order`, found along search_path as the
-- catalog resolves function names) when exactly one routine has it. A signature lists the
-- input parameters only (IN, INOUT, VARIADIC): OUT parameters are not part of it.
-- AP001: no such routine; AP007: ambiguous (the overloads are listed).
create or replace function asyncproc.resolve_routine(name text) returns regprocedure
language plpgsql stable as $$
declare
  found     regprocedure;
  base      text := btrim(split_part(name, '(', 1));
  overloads text;
  matches   integer;
begin
  if position('(' in name) > 0 then
    found := to_regprocedure(name);
    if found is not null then
      return found;
    end if;
  end if;
  -- every routine the base name can mean: qualified, in that schema; unqualified, the visible ones
  select count(*), string_agg(format('%s', p.oid::regprocedure), ', ' order by p.oid::regprocedure::text)
    into matches, overloads
    from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where p.prokind in ('f', 'p')
     and case when parse_ident(base) is null then false
              when cardinality(parse_ident(base)) = 2
                then n.nspname = (parse_ident(base))[1] and p.proname = (parse_ident(base))[2]
              else p.proname = (parse_ident(base))[1] and pg_function_is_visible(p.oid)
         end;
  if position('(' in name) > 0 then
    raise exception 'no routine with the signature %', name using errcode = 'AP001',
      hint = case when matches > 0
                  then format('%s exists as: %s. A signature lists the input parameters only (IN, INOUT, VARIADIC); OUT parameters are not part of it.', base, overloads)
                  else 'A signature lists the input parameters only (IN, INOUT, VARIADIC); OUT parameters are not part of it.' end;
  end if;
  if matches = 1 then
    return overloads::regprocedure;
  elsif matches > 1 then
    raise exception '"%" is overloaded: give one of its signatures: %', name, overloads using errcode = 'AP007';
  end if;
  raise exception 'no routine "%" in the database', name using errcode = 'AP001',
    hint = case when position('.' in base) = 0
                then 'An unqualified name is looked up along search_path (' || current_setting('search_path') || '); qualify it with its schema.'
                else '' end;
end
$$;
