import type pg from 'pg';
import type { Attempt } from '../../engine.js';
import { toExecutionError } from './rows.js';

interface AttemptRow {
  execution_id: string;
  number: number;
  status: Attempt['status'];
  started_at: Date;
  finished_at: Date | null;
  worker: string | null;
  backend_pid: number | null;
  error_number: string | null;
  error_message: string | null;
  error_detail: string | null;
  error_context: string | null;
}

/**
 * The execution log: attempts moved to asyncproc.attempts (retried, lost), then the
 * latest attempt, which lives in the executions row while it runs or once it ended the execution.
 */
export async function getHistory(pool: pg.Pool, ids: readonly string[]): Promise<Map<string, Attempt[]>> {
  const history = new Map<string, Attempt[]>(ids.map((id) => [id, []]));
  if (!ids.length) return history;
  const { rows } = await pool.query<AttemptRow>(
    `select a.execution_id, a.number, a.status, a.started_at, a.finished_at, a.worker, a.backend_pid,
            a.error_number, a.error_message, a.error_detail, a.error_context
       from asyncproc.attempts a where a.execution_id = any($1::bigint[])
     union all
     select e.id, e.attempts + e.recoveries, e.status, e.started_at, e.finished_at, e.worker, e.backend_pid,
            e.error_number, e.error_message, e.error_detail, e.error_context
       from asyncproc.executions e
      where e.id = any($1::bigint[]) and e.status in ('RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED') and e.started_at is not null
        -- cancelled while it ran: that run is its last attempt; cancelled while waiting for a retry: already logged
        and (e.status <> 'CANCELLED' or not exists (select 1 from asyncproc.attempts a
                                                    where a.execution_id = e.id and a.number = e.attempts + e.recoveries))
     order by 1, 2`,
    [ids],
  );
  for (const row of rows) {
    history.get(row.execution_id)?.push({
      number: row.number,
      status: row.status,
      startedAt: row.started_at,
      finishedAt: row.finished_at,
      worker: row.worker,
      sessionId: row.backend_pid,
      error: toExecutionError(row),
    });
  }
  return history;
}
