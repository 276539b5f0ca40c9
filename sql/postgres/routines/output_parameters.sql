-- A procedure's output row as JSON, from the row a top-level CALL returned to the worker as
-- text (names, type oids and values of its columns): each value is read back as its type,
-- so the JSON is the one to_jsonb gives the row inside asyncproc.run (numbers stay numbers).
-- format_type(oid, -1): an output column has no type modifier; format_type(oid, null) names bpchar
-- "character", character(1), which cut a char(5) output of 'abcde' to 'a' (fits.sql).
create or replace function asyncproc.output_parameters(names text[], types oid[], "values" text[]) returns jsonb
language plpgsql stable as $$
declare
  outputs jsonb;
begin
  if names is null then
    return null;
  end if;
  execute format('select to_jsonb(t) from (select %s) t',
                 (select string_agg(format('$1[%s]::%s as %I', i, format_type(types[i], -1), names[i]), ', ' order by i)
                    from generate_subscripts(names, 1) i))
     into outputs using "values";
  return outputs;
end
$$;
