-- A JSON array as text[] (cast on to the parameter's array type); CALL arguments may not hold subqueries.
-- A JSON string is PostgreSQL's array text ('{1,2,3}', '{{1,2},{3,4}}'), read as it is.
create or replace function asyncproc.text_array(value jsonb) returns text[]
language sql immutable as $$
  select case when value is null or jsonb_typeof(value) = 'null' then null
              when jsonb_typeof(value) = 'string' then (value #>> '{}')::text[]
              else coalesce((select array_agg(e.v order by e.o) from jsonb_array_elements_text(value) with ordinality e (v, o)), '{}')
         end
$$;

-- A JSON array as jsonb[], each element the JSON value it is (cast on to json[], jsonb[] or an
-- array of a domain over them), a JSON null an SQL NULL as in text_array. A JSON string is
-- PostgreSQL's array text, as for text_array.
create or replace function asyncproc.json_array(value jsonb) returns jsonb[]
language sql immutable as $$
  select case when value is null or jsonb_typeof(value) = 'null' then null
              when jsonb_typeof(value) = 'string' then (value #>> '{}')::jsonb[]
              else coalesce((select array_agg(nullif(e.v, 'null') order by e.o) from jsonb_array_elements(value) with ordinality e (v, o)), '{}')
         end
$$;
