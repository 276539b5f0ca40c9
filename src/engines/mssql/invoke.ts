import sql from 'mssql';
import { checkIdempotencyKey, EngineError, markReplayed, purgedWhileReplayed, type Execution, type InvokeCall } from '../../engine.js';
import { callerRoles } from '../identity.js';
import { mapDatabaseError } from './errors.js';
import { getExecutionsById } from './executions.js';
import { encodeArguments } from './types.js';

/** Where a call goes in a batch (usp_AsyncExecBatchCreate made the batch in the same transaction). */
export interface BatchPlacement {
  batchId: string;
  /** 1-based. */
  stage: number;
}

/**
 * Enqueue a call inside the caller's open transaction through usp_AsyncExecInvoke, which
 * takes a savepoint there (or its own transaction when none is open); returns its id, and
 * whether an idempotency key replayed an execution an earlier request made.
 * Refusals arrive as EngineErrors. In a batch, a call of a stage not yet released is held
 * (WAITING, no message) by the procedure itself.
 */
export async function enqueue(tx: sql.Transaction, call: InvokeCall, placement?: BatchPlacement): Promise<{ id: string; replayed: boolean }> {
  // The procedure's parameters are sized; a longer value would be cut by SQL Server,
  // and trailing blanks compare equal in T-SQL: refuse both before the database sees them.
  if (typeof call.procedure !== 'string' || call.procedure.length > 261 || call.procedure !== call.procedure.trim()) {
    throw new EngineError('UNKNOWN_PROCEDURE', `procedure "${String(call.procedure)}" is not registered`);
  }
  if (call.queue != null && (call.queue.length > 100 || call.queue !== call.queue.trim())) {
    throw new EngineError('UNKNOWN_QUEUE', `queue "${call.queue}" does not exist`);
  }
  if (call.submittedBy != null && call.submittedBy.length > 256) {
    throw new EngineError('BAD_USER_INPUT', 'submittedBy is at most 256 characters');
  }
  if (call.runAt != null && Number.isNaN(call.runAt.getTime())) throw new EngineError('BAD_USER_INPUT', 'runAt is not a valid time');
  checkIdempotencyKey(call.idempotencyKey);
  // no parameter's name is longer than a sysname (128), and what OPENJSON does with a key past
  // its nvarchar(4000) is not documented: refused here, as the unknown argument it is
  const longKey = call.arguments && typeof call.arguments === 'object' ? Object.keys(call.arguments).find((key) => key.length > 128) : undefined;
  if (longKey !== undefined) {
    throw new EngineError('INVALID_ARGUMENTS', `invalid arguments for ${call.procedure}: unknown argument "${longKey.slice(0, 200)}…"`);
  }

  const request = new sql.Request(tx);
  request.input('procedure', sql.NVarChar(261), call.procedure);
  request.input('arguments', sql.NVarChar(sql.MAX), encodeArguments(call.arguments));
  request.input('queue', sql.NVarChar(100), call.queue ?? null);
  request.input('runAt', sql.DateTime2(3), call.runAt ?? null);
  request.input('maxAttempts', sql.Int, call.maxAttempts ?? null);
  request.input('submittedBy', sql.NVarChar(256), call.submittedBy ?? null);
  request.input('batchId', sql.UniqueIdentifier, placement?.batchId ?? null);
  request.input('stage', sql.Int, placement?.stage ?? null);
  const roles = callerRoles(call.callerRoles);
  request.input('callerRoles', sql.NVarChar(sql.MAX), roles && JSON.stringify(roles));
  // declared as the procedure declares it (one longer than a key may be: usp_AsyncExecInvoke.sql)
  request.input('idempotencyKey', sql.NVarChar(129), call.idempotencyKey ?? null);
  request.output('token', sql.UniqueIdentifier);
  request.output('id', sql.BigInt);
  request.output('replayed', sql.Bit);
  try {
    const result = await request.execute('asyncexec.usp_AsyncExecInvoke');
    return { id: String(result.output.id), replayed: result.output.replayed === true };
  } catch (error) {
    throw mapDatabaseError(error);
  }
}

/** Enqueue a call inside the caller's open transaction and read the new row back on it. */
export async function invoke(tx: sql.Transaction, call: InvokeCall): Promise<Execution> {
  const { id, replayed } = await enqueue(tx, call);
  const [execution] = await getExecutionsById(tx, [id]);
  // only a replayed execution can be gone: purged since its key was read
  if (!execution) throw replayed ? purgedWhileReplayed(call.idempotencyKey, 'call') : new Error(`execution ${id} was enqueued but cannot be read back`);
  return replayed ? markReplayed(execution) : execution;
}
