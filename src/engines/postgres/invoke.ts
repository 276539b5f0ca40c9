import type pg from 'pg';
import { EngineError, type Execution, type InvokeCall } from '../../engine.js';
import { mapDatabaseError } from './errors.js';
import { EXECUTION_COLUMNS, toExecution, type ExecutionRow } from './rows.js';

/**
 * Enqueue one call on the caller's open transaction (any pg client inside BEGIN).
 * Validation happens in asyncproc.submit itself, so plain SQL callers get the same checks.
 * `quiet`: the caller sends the notifications after its commit (see notifier.ts);
 * otherwise they are part of the transaction.
 */
export async function invoke(tx: pg.ClientBase, call: InvokeCall, quiet = false): Promise<Execution> {
  if (call.arguments === null || typeof call.arguments !== 'object' || Array.isArray(call.arguments)) {
    throw new EngineError('INVALID_ARGUMENTS', 'arguments must be a JSON object keyed by parameter name');
  }
  try {
    const { rows } = await tx.query<ExecutionRow>(
      `select ${EXECUTION_COLUMNS} from asyncproc.submit($1, $2::jsonb, $3, $4, $5, $6, $7) e`,
      [
        call.procedure,
        JSON.stringify(call.arguments),
        call.queue ?? null,
        call.runAt ?? null,
        call.maxAttempts ?? null,
        call.submittedBy ?? null,
        quiet,
      ],
    );
    return toExecution(rows[0]);
  } catch (error) {
    throw mapDatabaseError(error);
  }
}
