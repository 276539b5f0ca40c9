import sql from 'mssql';
import { EngineError, toError, type EngineErrorCode } from '../../engine.js';

/**
 * THROW numbers of our procedures (documented in sql/mssql/0004_invoke.sql, 0005_activated.sql,
 * 0007_batches.sql and docs/mssql.md): 50001 UNKNOWN_PROCEDURE, 50002 INVALID_ARGUMENTS,
 * 50003 UNKNOWN_QUEUE, 50005 BAD_USER_INPUT (also a bad batch or stage: usp_AsyncExecInvoke,
 * usp_AsyncExecBatchCreate); usp_AsyncExecCancel: 50006 NOT_FOUND, 50007 ALREADY_FINISHED,
 * 50008 FORBIDDEN; usp_AsyncExecInvoke (0009_identity.sql): 50009 FORBIDDEN, the caller's roles
 * do not allow the procedure; usp_AsyncExecReplay (0017_idempotency_keys.sql): 50016 IDEMPOTENCY_KEY_REUSED, a key
 * the caller sent before with another call, and 50017 IDEMPOTENCY_KEY_IN_USE (also usp_AsyncExecInvoke), one
 * another transaction holds. 50020–50022 and 50024 are faults of the machinery, 50023 one of the caller of
 * usp_AsyncExecCancelBatch (0008_cancel_batch.sql), 50025 of usp_AsyncExecReplay (sp_getapplock failed on an idempotency key), 50041 of usp_AsyncExecPurge, 50042 of usp_AsyncExecRecover,
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
  50016: 'IDEMPOTENCY_KEY_REUSED',
  50017: 'IDEMPOTENCY_KEY_IN_USE',
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

/**
 * Error numbers that pass by themselves: SqlClient's baseline list of transient errors
 * (SqlConfigurableRetryFactory.BaselineTransientErrors: a login cut by the transport, 233 and
 * 997; no LOCK resource now, 1204; a deadlock victim, 1205 ("Rerun the transaction"); a lock
 * request timeout, 1222; a database the login cannot open now, 4060, as during a restart or an
 * availability group's failover; a read-secondary not ready, 4221; a connection that failed or
 * was reset, 10053, 10054, 10060, 64, 20; Azure SQL's resource limits and reconfigurations,
 * 10928, 10929, 40143, 40197, 40501, 40540, 40613, 42108, 42109, 49918–49920), and -2, the
 * driver's request timeout.
 */
const TRANSIENT_NUMBERS = new Set([
  -2, 20, 64, 233, 997, 1204, 1205, 1222, 4060, 4221, 10053, 10054, 10060, 10928, 10929, 40143, 40197, 40501, 40540, 40613, 42108, 42109, 49918,
  49919, 49920,
  // ours: an idempotency key another transaction holds (usp_AsyncExecReplay): sent again shortly, it is replayed or made
  50017,
]);
/** mssql's and tedious's codes of a connection that is gone, not open yet, timed out or was cut (not ELOGIN: a refused login is for a person). */
const TRANSIENT_CODES = new Set(['ESOCKET', 'ECONNCLOSED', 'ETIMEOUT', 'ENOTOPEN', 'ENOCONN', 'EINSTLOOKUP', 'ECANCEL', 'ECONNRESET', 'ECONNREFUSED', 'EPIPE']);

/**
 * Whether a failed request may succeed when tried again (Engine.isTransient): a transient error
 * number, a connection that is gone (its code), or a login tedious itself marks transient (its
 * ConnectionError.isTransient: Azure SQL's). Anything else (208 an invalid object name, 229 a
 * permission denied, 18456 a login failed) waits for a person. A driver error may wrap the
 * server's in `originalError`, and ours in `cause`: both are looked into.
 */
export function isTransient(error: unknown, depth = 0): boolean {
  if (error === null || typeof error !== 'object' || depth > 3) return false;
  const number = errorNumber(error);
  if (number !== undefined && TRANSIENT_NUMBERS.has(number)) return true;
  const { code, isTransient: marked, originalError, cause } = error as { code?: unknown; isTransient?: unknown; originalError?: unknown; cause?: unknown };
  if (marked === true || (typeof code === 'string' && TRANSIENT_CODES.has(code))) return true;
  return isTransient(originalError, depth + 1) || (cause !== error && isTransient(cause, depth + 1));
}
