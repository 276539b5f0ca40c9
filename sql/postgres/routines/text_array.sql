-- A JSON array as text[] (cast on to the parameter's array type); CALL arguments may not hold subqueries.
create or replace function asyncproc.text_array(value jsonb) returns text[]
language sql immutable as $$
  select case when value is null or jsonb_typeof(value) = 'null' then null
              else coalesce((select array_agg(e.v order by e.o) from jsonb_array_elements_text(value) with ordinality e (v, o)), '{}')
         end
$$;
