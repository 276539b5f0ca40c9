import { EngineError, type EngineErrorCode } from '../../engine.js';

/** SQLSTATEs raised by asyncproc.submit, submit_batch, unregister and resolve_routine (sql/postgres/routines). */
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
