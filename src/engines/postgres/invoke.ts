import type pg from 'pg';
import { EngineError, type Execution, type InvokeCall } from '../../engine.js';
import { callerRoles } from '../identity.js';
import { mapDatabaseError } from './errors.js';
import { EXECUTION_COLUMNS, toExecution, type ExecutionRow } from './rows.js';

/** Arguments are a JSON object keyed by parameter name (the database checks the rest). */
export function checkArguments(call: InvokeCall): void {
  if (call.arguments === null || typeof call.arguments !== 'object' || Array.isArray(call.arguments)) {
    throw new EngineError('INVALID_ARGUMENTS', 'arguments must be a JSON object keyed by parameter name');
  }
}

/**
 * Enqueue one call on the caller's open transaction (any pg client inside BEGIN).
 * Validation happens in asyncproc.submit itself, so plain SQL callers get the same checks.
 * `quiet`: the caller sends the notifications after its commit (see notifier.ts);
 * otherwise they are part of the transaction.
 */
export async function invoke(tx: pg.ClientBase, call: InvokeCall, quiet = false): Promise<Execution> {
  checkArguments(call);
  try {
    const { rows } = await tx.query<ExecutionRow>(
      `select ${EXECUTION_COLUMNS} from asyncproc.submit($1, $2::jsonb, $3, $4, $5, $6, $7, caller_roles => $8::text[]) e`,
      [
        call.procedure,
        JSON.stringify(call.arguments),
        call.queue ?? null,
        call.runAt ?? null,
        call.maxAttempts ?? null,
        call.submittedBy ?? null,
        quiet,
        callerRoles(call.callerRoles),
      ],
    );
    return toExecution(rows[0]);
  } catch (error) {
    throw mapDatabaseError(error);
  }
}

/** Calls as the database reads them from JSON (submitMany, submit_batch): caller roles checked here. */
export function callsAsJson(calls: readonly InvokeCall[]): InvokeCall[] {
  return calls.map((call) => ({ ...call, callerRoles: callerRoles(call.callerRoles) }));
}

/** All calls in one statement (so one transaction, one round trip): all or none, in order. */
export async function submitMany(pool: pg.Pool, calls: readonly InvokeCall[]): Promise<Execution[]> {
  for (const call of calls) checkArguments(call);
  try {
    const { rows } = await pool.query<ExecutionRow>(
      `select ${EXECUTION_COLUMNS}
         from jsonb_array_elements($1::jsonb) with ordinality c (call, n),
              lateral asyncproc.submit(c.call ->> 'procedure', c.call -> 'arguments', c.call ->> 'queue',
                                       (c.call ->> 'runAt')::timestamptz, (c.call ->> 'maxAttempts')::integer,
                                       c.call ->> 'submittedBy', true,
                                       caller_roles => asyncproc.text_array(c.call -> 'callerRoles')) e
        order by c.n`,
      [JSON.stringify(callsAsJson(calls))],
    );
    return rows.map(toExecution);
  } catch (error) {
    throw mapDatabaseError(error);
  }
}
