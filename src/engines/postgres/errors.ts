import { EngineError, type EngineErrorCode } from '../../engine.js';

/** SQLSTATEs raised by asyncproc.submit, submit_batch and unregister (sql/postgres/routines). */
const CODES: Record<string, EngineErrorCode> = {
  AP001: 'UNKNOWN_PROCEDURE',
  AP002: 'INVALID_ARGUMENTS',
  AP003: 'UNKNOWN_QUEUE',
  AP004: 'BAD_USER_INPUT',
  /** submit: the caller's roles do not allow the procedure. */
  AP005: 'FORBIDDEN',
  /** unregister: not registered. */
  AP006: 'NOT_FOUND',
};

/** Our own SQLSTATEs become EngineErrors; anything else passes through unchanged. */
export function mapDatabaseError(error: unknown): unknown {
  const code = (error as { code?: unknown })?.code;
  if (typeof code === 'string' && code in CODES) {
    return new EngineError(CODES[code], (error as Error).message, { cause: error });
  }
  return error;
}
