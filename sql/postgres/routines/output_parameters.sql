-- A procedure's output row as JSON, from the row a top-level CALL returned to the worker as
-- text (names, type oids and values of its columns): each value is read back as its type,
-- so the JSON is the one to_jsonb gives the row inside asyncproc.run (numbers stay numbers).
create or replace function asyncproc.output_parameters(names text[], types oid[], "values" text[]) returns jsonb
language plpgsql stable as $$
declare
  outputs jsonb;
begin
  if names is null then
    return null;
  end if;
  execute format('select to_jsonb(t) from (select %s) t',
                 (select string_agg(format('$1[%s]::%s as %I', i, format_type(types[i], null), names[i]), ', ' order by i)
                    from generate_subscripts(names, 1) i))
     into outputs using "values";
  return outputs;
end
$$;
