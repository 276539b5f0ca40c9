-- A registration remembers its routine's signature (schema, name, argument types), so a
-- routine dropped and created again, as an ordinary migration does, is found again by it;
-- the stored oid alone points at nothing once the routine is dropped.
alter table asyncproc.procedures add column signature text;

-- printed with search_path = pg_catalog: every name qualified, so it resolves under any search_path
set local search_path = pg_catalog;
update asyncproc.procedures r set signature = r.proc::text where exists (select from pg_proc p where p.oid = r.proc);
