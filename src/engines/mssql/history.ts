import sql from 'mssql';
import { EngineError, type Attempt } from '../../engine.js';
import { toExecutionError, type Queryable } from './executions.js';

/** A row of asyncexec.AsyncExecAttempts (see sql/mssql/0001_tables.sql). */
export interface AttemptRow {
  execution_id: string | number;
  number: number;
  status: Attempt['status'];
  started_at: Date;
  finished_at: Date | null;
  session_id: number | null;
  worker: string | null;
  error_number: number | null;
  error_severity: number | null;
  error_state: number | null;
  error_line: number | null;
  error_procedure?: string | null;
  error_message: string | null;
}

export function toAttempt(row: AttemptRow): Attempt {
  return {
    number: row.number,
    status: row.status,
    startedAt: row.started_at,
    finishedAt: row.finished_at,
    worker: row.worker,
    sessionId: row.session_id,
    error: toExecutionError(row),
  };
}

const BIGINT_MAX = 9223372036854775807n;

/**
 * An execution id as the canonical decimal text of a bigint identity (`007` → `7`), or
 * null when no execution can have it (beyond bigint, or not positive). Malformed text is
 * BAD_USER_INPUT, as a malformed page cursor is.
 */
export function canonicalExecutionId(id: string): string | null {
  if (typeof id !== 'string' || !/^\d{1,30}$/.test(id)) throw new EngineError('BAD_USER_INPUT', `malformed execution id "${id}"`);
  const value = BigInt(id);
  return value < 1n || value > BIGINT_MAX ? null : value.toString();
}

/**
 * The execution log: every attempt of each execution, oldest first, keyed by the ids
 * as given. Every requested id is in the map; one without attempts maps to [].
 */
export async function getHistory(db: Queryable, executionIds: readonly string[]): Promise<Map<string, Attempt[]>> {
  const canonical = new Map<string, string | null>(executionIds.map((id) => [id, canonicalExecutionId(id)]));
  const wanted = [...new Set([...canonical.values()].filter((id): id is string => id !== null))];
  const byExecution = new Map<string, Attempt[]>();
  if (wanted.length) {
    const req = new sql.Request(db as sql.ConnectionPool);
    req.input('ids', sql.NVarChar(sql.MAX), JSON.stringify(wanted));
    const result = await req.query<AttemptRow>(
      `SELECT a.execution_id, a.number, a.status, a.started_at, a.finished_at, a.session_id, a.worker,
              a.error_number, a.error_severity, a.error_state, a.error_line, a.error_procedure, a.error_message
         FROM asyncexec.AsyncExecAttempts AS a
        WHERE a.execution_id IN (SELECT CONVERT(bigint, [value]) FROM OPENJSON(@ids))
        ORDER BY a.execution_id, a.number`,
    );
    for (const row of result.recordset) {
      const key = String(row.execution_id); // bigint arrives as text from the driver
      let attempts = byExecution.get(key);
      if (!attempts) byExecution.set(key, (attempts = []));
      attempts.push(toAttempt(row));
    }
  }
  const history = new Map<string, Attempt[]>();
  for (const [id, key] of canonical) {
    // each requested id gets its own array, even when two spell the same execution
    history.set(id, key === null ? [] : [...(byExecution.get(key) ?? [])]);
  }
  return history;
}
