-- Parameters of every routine, read from the catalog. Defaults belong to the last pronargdefaults input arguments.
create or replace view asyncproc.parameters as
select p.oid as proc,
       a.ord::integer as position,
       a.name,
       a.type_oid,
       format_type(a.type_oid, null) as type_name,
       case a.mode when 'i' then 'IN' when 'o' then 'OUT' when 'b' then 'INOUT' when 'v' then 'VARIADIC' else 'TABLE' end as mode,
       (a.mode in ('i', 'b', 'v') and a.arg_ord > p.pronargs - p.pronargdefaults) as has_default
from pg_proc p
cross join lateral (
  select u.ord, u.type_oid,
         coalesce(p.proargnames[u.ord], '') as name,
         coalesce(p.proargmodes[u.ord], 'i') as mode,
         count(*) filter (where coalesce(p.proargmodes[u.ord], 'i') in ('i', 'b', 'v')) over (order by u.ord) as arg_ord
  from unnest(coalesce(p.proallargtypes, p.proargtypes::oid[])) with ordinality as u (type_oid, ord)
) a;
