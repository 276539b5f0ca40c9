/**
 * Live progress on SQL Server. A running call reports with asyncexec.usp_AsyncExecProgress,
 * which puts the report in its session's CONTEXT_INFO (not transactional; layout in that file);
 * the progress reader polls the sessions running calls (usp_AsyncExecProgressRead, every
 * `intervalMs`), stores each new report in asyncexec.AsyncExecProgress outside the call's
 * transaction and tells the sink, as the PostgreSQL listener does on NOTIFY asyncproc_progress.
 * Every service process that listens polls on its own: there is no notification to share, and
 * the table keeps the newest report whoever stored it. Polling throttles a chatty procedure to
 * at most one stored report per execution and interval, the latest winning.
 *
 * Reading other sessions' CONTEXT_INFO needs VIEW SERVER STATE (VIEW SERVER PERFORMANCE STATE on
 * 2022) for the service's login; without it the reader says so once in the log and does not
 * run, and Execution.progress keeps only what usp_AsyncExecRun stores with each outcome.
 */
import sql from 'mssql';
import { toError, type Closeable, type ExecutionProgress, type ListenerSink } from '../../engine.js';
import type { Logger } from '../../logger.js';
import { canonicalExecutionId } from './history.js';

/**
 * Whether this login can see other sessions in sys.dm_exec_requests / sys.dm_exec_sessions.
 * Without the permission those views raise no error: "otherwise, the user will see only the
 * current session" (sys.dm_exec_requests), "everyone can see their own session information"
 * (sys.dm_exec_sessions), so usp_AsyncExecProgressRead would silently find nothing; this check
 * is what makes the missing grant visible (once, in the log).
 */
export async function canReadOtherSessions(pool: sql.ConnectionPool): Promise<boolean> {
  // HAS_PERMS_BY_NAME(NULL, NULL, ...) tests a server-level permission ("if the securable is the
  // server itself, this value should be set to NULL"), "in the security context of the caller"
  // (the pool's login), counting a permission "implied by a higher-level permission"; both are
  // asked, so either grant suffices on 2022 whatever the hierarchy. It returns NULL "if the
  // securable class or permission isn't valid" (VIEW SERVER PERFORMANCE STATE before 2022): 0 then.
  const { recordset } = await pool.request().query<{ allowed: number }>(
    `SELECT CASE WHEN COALESCE(HAS_PERMS_BY_NAME(NULL, NULL, N'VIEW SERVER STATE'), 0) = 1
                   OR COALESCE(HAS_PERMS_BY_NAME(NULL, NULL, N'VIEW SERVER PERFORMANCE STATE'), 0) = 1
                 THEN 1 ELSE 0 END AS allowed`,
  );
  return recordset[0]?.allowed === 1;
}

export interface ProgressReaderOptions {
  pool: sql.ConnectionPool;
  sink: ListenerSink;
  logger: Logger;
  /** Between two reads of the running calls' sessions. @default 500 */
  intervalMs?: number;
}

/** Poll the running calls' reports until closed; a failed round is logged and tried again. */
export function startProgressReader(options: ProgressReaderOptions): Closeable {
  const { pool, sink, logger } = options;
  const intervalMs = options.intervalMs ?? 500;
  let closed = false;
  let timer: NodeJS.Timeout | null = null;
  let round: Promise<void> = Promise.resolve();
  let failures = 0;
  const run = async () => {
    try {
      const { recordset } = await pool.request().execute<{ execution_id: string | number }>('asyncexec.usp_AsyncExecProgressRead');
      failures = 0;
      for (const row of recordset) if (!closed) sink.onProgress?.(String(row.execution_id));
    } catch (error) {
      if (++failures <= 3 || failures % 120 === 0) logger.warn({ err: toError(error), failures }, 'reading live progress failed; will read again');
    }
  };
  const next = () => {
    if (closed) return;
    timer = setTimeout(() => {
      timer = null;
      round = run().finally(next);
    }, intervalMs);
  };
  next();
  return {
    close: async () => {
      closed = true;
      if (timer) clearTimeout(timer);
      await round;
    },
  };
}

/** The latest progress of each of these executions, reported during their current (or last) run. */
export async function getProgress(pool: sql.ConnectionPool, executionIds: readonly string[]): Promise<Map<string, ExecutionProgress>> {
  const wanted = [...new Set(executionIds.map(canonicalExecutionId).filter((id): id is string => id !== null))];
  const found = new Map<string, ExecutionProgress>();
  if (!wanted.length) return found;
  const { recordset } = await pool
    .request()
    .input('ids', sql.NVarChar(sql.MAX), JSON.stringify(wanted))
    .query<{ execution_id: string | number; percent: number | string; message: string | null; at: Date }>(
      `SELECT p.execution_id, p.[percent], p.message, p.at
         FROM asyncexec.AsyncExecProgress AS p
         JOIN asyncexec.AsyncExecResults AS e ON e.id = p.execution_id
        WHERE p.execution_id IN (SELECT CONVERT(bigint, [value]) FROM OPENJSON(@ids))
          AND p.run_started_at = e.started_at`,
    );
  for (const row of recordset) found.set(String(row.execution_id), { percent: Number(row.percent), message: row.message, at: row.at });
  // keyed by the ids as given (canonical spelling: an id is the text of a bigint)
  return new Map(executionIds.flatMap((id) => {
    const progress = found.get(canonicalExecutionId(id) ?? '');
    return progress ? [[id, progress] as const] : [];
  }));
}
