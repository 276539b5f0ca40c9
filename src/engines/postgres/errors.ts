import { EngineError, type EngineErrorCode } from '../../engine.js';

/** SQLSTATEs raised by asyncproc.submit, submit_batch, register, unregister and resolve_routine (sql/postgres/routines). */
const CODES: Record<string, EngineErrorCode> = {
  AP001: 'UNKNOWN_PROCEDURE',
  AP002: 'INVALID_ARGUMENTS',
  AP003: 'UNKNOWN_QUEUE',
  AP004: 'BAD_USER_INPUT',
  /** submit: the caller's roles do not allow the procedure. */
  AP005: 'FORBIDDEN',
  /** unregister: not registered. */
  AP006: 'NOT_FOUND',
  /** resolve_routine (register by name): more than one routine has the name. */
  AP007: 'BAD_USER_INPUT',
  /** register: the name is registered for another routine (an overload), whose calls have not ended. */
  AP009: 'BAD_USER_INPUT',
  /** submit: an idempotency key the caller sent before with another call (replayed.sql). */
  AP012: 'IDEMPOTENCY_KEY_REUSED',
  /** submit: the idempotency key is held by a transaction that has not ended (submit.sql). */
  AP013: 'IDEMPOTENCY_KEY_IN_USE',
};

/** Our own SQLSTATEs become EngineErrors; anything else passes through unchanged. */
export function mapDatabaseError(error: unknown): unknown {
  const code = (error as { code?: unknown })?.code;
  if (typeof code === 'string' && code in CODES) {
    // the HINT says what to do instead (the registered name meant, a signature's rule)
    const hint = (error as { hint?: unknown }).hint;
    const message = typeof hint === 'string' && hint ? `${(error as Error).message}. ${hint}` : (error as Error).message;
    return new EngineError(CODES[code], message, { cause: error });
  }
  return error;
}

/**
 * An error a submit raised, as mapDatabaseError maps it; and one raised by the arguments' own
 * types rather than by asyncproc is INVALID_ARGUMENTS with the database's words: a data exception
 * (class 22) or a check violation (23514) an input function or a domain's check raised as a hard
 * error (the checks before the insert read types with pg_input_is_valid, which reports soft errors
 * only), or a PL/pgSQL RAISE (P0001) of a function a domain's check calls. Passed through, they
 * were answered as unexpected errors (INTERNAL_SERVER_ERROR). Nothing was stored either way.
 */
export function mapSubmitError(error: unknown): unknown {
  const code = (error as { code?: unknown })?.code;
  if (typeof code === 'string' && (code.startsWith('22') || code === '23514' || code === 'P0001')) {
    return new EngineError('INVALID_ARGUMENTS', (error as Error).message, { cause: error });
  }
  return mapDatabaseError(error);
}

/**
 * SQLSTATEs that pass by themselves (besides class 08, connection exception): the server shutting
 * down or starting up (57P01–57P03, also a failover's new primary coming up), too many
 * connections and out of memory (53300, 53200), a serialization failure or deadlock (40001,
 * 40P01: "the transaction can be retried"), a lock not available now (55P03), a statement
 * cancelled, as a statement_timeout does (57014), and a database "not currently accepting
 * connections" (55000, raised at connect while ALLOW_CONNECTIONS is false for maintenance), and
 * an idempotency key another transaction holds (AP013, IDEMPOTENCY_KEY_IN_USE: sent again shortly,
 * it is replayed or made).
 */
const TRANSIENT_SQLSTATES = new Set(['57P01', '57P02', '57P03', '53300', '53200', '40001', '40P01', '55P03', '57014', '55000', 'AP013']);

/**
 * Whether a failed request may succeed when tried again (Engine.isTransient): a SQLSTATE of
 * class 08 or above; a Node socket error (ECONNREFUSED, ECONNRESET, EPIPE, ETIMEDOUT, ...); or
 * one of pg's own errors without a code, which are all about the connection ("Connection
 * terminated unexpectedly", a pool's "timeout exceeded when trying to connect", a client "not
 * queryable", "Query read timeout"). Any other SQLSTATE (42P01 a missing table, 42501 permission
 * denied, 3D000 no such database, 28P01 a password refused) is for a person to mend.
 */
export function isTransient(error: unknown): boolean {
  if (error instanceof EngineError) return error.code === 'IDEMPOTENCY_KEY_IN_USE';
  const code = (error as { code?: unknown } | null)?.code;
  if (typeof code === 'string' && code) {
    // Node's system errors; no SQLSTATE class begins with E
    if (/^E[A-Z_]+$/.test(code)) return true;
    return code.startsWith('08') || TRANSIENT_SQLSTATES.has(code);
  }
  const message = error instanceof Error ? error.message : String(error);
  return /connect|terminat|timeout|not queryable|closed/i.test(message);
}
