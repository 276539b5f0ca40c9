-- An idempotency key as the service checks it (engine.ts checkIdempotencyKey), for submit() and
-- submit_batch(): 128 UTF-16 code units at most (a character past U+FFFF is two, as SQL Server's
-- nvarchar(128) counts), no control character, no white space at either end. AP004 otherwise.
create or replace function asyncproc.check_idempotency_key(idempotency_key text) returns void
language plpgsql immutable as $$
begin
  -- E'' literals: a backslash means the same whatever standard_conforming_strings the session that
  -- first runs this has (with it off, '\s' was read as 's': a valid key was refused, ' x' taken)
  if length(idempotency_key) + length(regexp_replace(idempotency_key, E'[^\\U00010000-\\U0010FFFF]', '', 'g')) not between 1 and 128
     or idempotency_key ~ E'[[:cntrl:]]|^\\s|\\s$' then
    raise exception 'an idempotency key is 1 to 128 characters, none of them a control character, and no white space at either end'
      using errcode = 'AP004';
  end if;
end
$$;
