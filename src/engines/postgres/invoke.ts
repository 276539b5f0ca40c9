import type pg from 'pg';
import { EngineError, type Execution, type InvokeCall } from '../../engine.js';
import { mapDatabaseError } from './errors.js';
import { EXECUTION_COLUMNS, toExecution, type ExecutionRow } from './rows.js';

/**
 * Enqueue one call on the caller's open transaction (any pg client inside BEGIN).
 * Validation happens in asyncproc.invoke itself, so plain SQL callers get the same checks.
 */
export async function invoke(tx: pg.ClientBase, call: InvokeCall): Promise<Execution> {
  if (call.arguments === null || typeof call.arguments !== 'object' || Array.isArray(call.arguments)) {
    throw new EngineError('INVALID_ARGUMENTS', 'arguments must be a JSON object keyed by parameter name');
  }
  try {
    const { rows } = await tx.query<ExecutionRow>(
      `select ${EXECUTION_COLUMNS} from asyncproc.submit($1, $2::jsonb, $3, $4, $5, $6) e`,
      [
        call.procedure,
        JSON.stringify(call.arguments),
        call.queue ?? null,
        call.runAt ?? null,
        call.maxAttempts ?? null,
        call.submittedBy ?? null,
      ],
    );
    return toExecution(rows[0]);
  } catch (error) {
    throw mapDatabaseError(error);
  }
}
