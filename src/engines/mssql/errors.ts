import sql from 'mssql';
import { EngineError, toError, type EngineErrorCode } from '../../engine.js';

/**
 * THROW numbers of our procedures (documented in sql/mssql/0004_invoke.sql, 0005_activated.sql,
 * 0007_batches.sql and docs/mssql.md): 50001 UNKNOWN_PROCEDURE, 50002 INVALID_ARGUMENTS,
 * 50003 UNKNOWN_QUEUE, 50005 BAD_USER_INPUT (also a bad batch or stage: usp_AsyncExecInvoke,
 * usp_AsyncExecBatchCreate); usp_AsyncExecCancel: 50006 NOT_FOUND, 50007 ALREADY_FINISHED,
 * 50008 FORBIDDEN; usp_AsyncExecInvoke (0009_identity.sql): 50009 FORBIDDEN, the caller's roles
 * do not allow the procedure. 50020–50022 and 50024 are faults of the machinery, 50023 one of the caller of
 * usp_AsyncExecCancelBatch (0008_cancel_batch.sql), 50041 of usp_AsyncExecPurge, 50042 of usp_AsyncExecRecover,
 * 50043 of usp_AsyncExecFireSchedule and 50044 of usp_AsyncExecListenerWake (called inside a transaction): they
 * stay unmapped, as 50045 (usp_AsyncExecProgress: a percent outside 0–100), which reaches the called procedure
 * that reported, never the service's caller. 50014 (the callee ended the
 * transaction it was called in) and 50015 (a non-transactional run lost mid-call) are recorded on
 * executions by usp_AsyncExecRun and usp_AsyncExecActivated, never thrown to a caller.
 */
export const THROWN: Readonly<Record<number, EngineErrorCode>> = {
  50001: 'UNKNOWN_PROCEDURE',
  50002: 'INVALID_ARGUMENTS',
  50003: 'UNKNOWN_QUEUE',
  50005: 'BAD_USER_INPUT',
  50006: 'NOT_FOUND',
  50007: 'ALREADY_FINISHED',
  50008: 'FORBIDDEN',
  50009: 'FORBIDDEN',
};

/** The SQL Server error number of a driver error, if it carries one. */
export function errorNumber(error: unknown): number | undefined {
  if (error instanceof sql.RequestError && typeof error.number === 'number') return error.number;
  const original = (error as { originalError?: { number?: unknown; info?: { number?: unknown } } } | null)?.originalError;
  const number = original?.info?.number ?? original?.number;
  return typeof number === 'number' ? number : undefined;
}

/** Expected refusals become EngineErrors; anything else stays an Error with its cause. */
export function mapDatabaseError(error: unknown): Error {
  const number = errorNumber(error);
  const code = number === undefined ? undefined : THROWN[number];
  if (code) return new EngineError(code, (error as Error).message, { cause: error });
  return toError(error);
}
