-- The routine a registration stands for now, found by its signature, so one dropped and
-- created again is found again; null when no such routine exists. Registrations older
-- than the signature column fall back to the stored oid.
create or replace function asyncproc.current_routine(proc regprocedure, signature text) returns regprocedure
language sql stable as $$
  select case when signature is not null then to_regprocedure(signature)
              else (select p.oid::regprocedure from pg_proc p where p.oid = proc) end
$$;
