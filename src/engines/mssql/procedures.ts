import sql from 'mssql';
import { checkGroupCommits, checkRegisterRanges, EngineError, NO_GROUP_COMMITS, type GroupCommits, type Procedure, type QueueInfo, type RegisterOptions } from '../../engine.js';
import { checkRoles } from '../identity.js';
import { mapDatabaseError } from './errors.js';
import { parameterMode } from './types.js';

export interface MssqlRegisterOptions extends RegisterOptions {
  /**
   * Parameters (no `@`) that have defaults in the procedure and may be left out.
   * SQL Server does not expose T-SQL defaults in the catalog, so they are declared here.
   */
  optionalParameters?: string[];
}

interface ProcedureRow {
  name: string;
  queue: string;
  max_attempts: number;
  timeout_ms: number | null;
  /** JSON array. */
  roles: string;
  transactional: boolean;
  position: number | null;
  parameter: string | null;
  type_text: string | null;
  is_output: boolean | null;
  has_default: boolean | null;
}

export async function listProcedures(pool: sql.ConnectionPool, only?: string): Promise<Procedure[]> {
  // longer than any registered name (nvarchar(261)): none
  if (only != null && only.length > 261) return [];
  const request = pool.request();
  request.input('only', sql.NVarChar(261), only ?? null);
  const result = await request.query<ProcedureRow>(
    `SELECT r.name, r.queue, r.max_attempts, r.timeout_ms, r.roles, r.transactional,
            p.position, p.name AS parameter, p.type_text, p.is_output, p.has_default
       FROM asyncexec.AsyncExecProcedures AS r
       LEFT JOIN asyncexec.AsyncExecParameters AS p ON p.[procedure] = r.name
      WHERE r.unregistered_at IS NULL AND (@only IS NULL OR r.name = @only)
      ORDER BY r.name, p.position`,
  );
  const byName = new Map<string, Procedure>();
  for (const row of result.recordset) {
    let procedure = byName.get(row.name);
    if (!procedure) {
      procedure = {
        name: row.name,
        parameters: [],
        queue: row.queue,
        maxAttempts: row.max_attempts,
        timeoutMs: row.timeout_ms,
        roles: JSON.parse(row.roles) as string[],
        transactional: Boolean(row.transactional),
      };
      byName.set(row.name, procedure);
    }
    if (row.parameter !== null && row.position !== null) {
      procedure.parameters.push({
        name: row.parameter,
        type: row.type_text ?? '',
        mode: parameterMode(Boolean(row.is_output)),
        hasDefault: Boolean(row.has_default),
        position: row.position,
      });
    }
  }
  return [...byName.values()];
}

/**
 * What SQL Server cannot offer of RegisterOptions, refused before the call (usp_AsyncExecRegister
 * refuses it too, 50005): a timeoutMs, since a running call can only be stopped by KILL, which
 * the activation may not run (docs/mssql.md, "Timeouts"); a transactional that is not a boolean.
 */
export function checkRegisterOptions(options: MssqlRegisterOptions): void {
  if (options.timeoutMs !== undefined && options.timeoutMs !== null) {
    throw new EngineError('BAD_USER_INPUT', 'timeoutMs is not supported on SQL Server: a running call can only be stopped by KILL (docs/mssql.md, "Timeouts")');
  }
  if (options.transactional !== undefined && typeof options.transactional !== 'boolean') {
    throw new EngineError('BAD_USER_INPUT', `transactional must be true or false, not ${String(options.transactional)}`);
  }
}

export async function registerProcedure(pool: sql.ConnectionPool, name: string, options: MssqlRegisterOptions = {}): Promise<Procedure> {
  checkRegisterRanges(options);
  checkRegisterOptions(options);
  const roles = checkRoles(options.roles);
  // sized parameters: a longer name would be refused by the driver, not as what it is
  if (typeof name !== 'string' || name.length > 261) throw new EngineError('UNKNOWN_PROCEDURE', `procedure "${String(name).slice(0, 300)}" does not exist`);
  if (options.queue != null && options.queue.length > 100) throw new EngineError('UNKNOWN_QUEUE', `queue "${options.queue.slice(0, 120)}" does not exist`);
  const request = pool.request();
  request.input('procedure', sql.NVarChar(261), name);
  request.input('queue', sql.NVarChar(100), options.queue ?? 'default');
  request.input('maxAttempts', sql.Int, options.maxAttempts ?? 1);
  request.input('timeoutMs', sql.Int, options.timeoutMs ?? null);
  request.input('optionalParameters', sql.NVarChar(sql.MAX), options.optionalParameters ? JSON.stringify(options.optionalParameters) : null);
  request.input('roles', sql.NVarChar(sql.MAX), JSON.stringify(roles));
  request.input('transactional', sql.Bit, options.transactional ?? true);
  let registered: string;
  try {
    const result = await request.execute<{ name: string }>('asyncexec.usp_AsyncExecRegister');
    registered = result.recordset[0].name;
  } catch (error) {
    throw mapDatabaseError(error);
  }
  const [procedure] = await listProcedures(pool, registered);
  if (!procedure) throw new EngineError('NOT_FOUND', `procedure ${registered} vanished after registration`);
  return procedure;
}

/** Withdraw a registration by its registered name (usp_AsyncExecUnregister); returns it as it was. NOT_FOUND when not registered. */
export async function unregisterProcedure(pool: sql.ConnectionPool, name: string): Promise<Procedure> {
  // sized parameter, and trailing blanks compare equal in T-SQL: such a name is registered nowhere
  const [procedure] = typeof name === 'string' && name.length <= 261 && name === name.trim() ? await listProcedures(pool, name) : [];
  if (!procedure) throw new EngineError('NOT_FOUND', `procedure "${String(name)}" is not registered`);
  try {
    await pool.request().input('procedure', sql.NVarChar(261), procedure.name).execute('asyncexec.usp_AsyncExecUnregister');
  } catch (error) {
    throw mapDatabaseError(error);
  }
  return procedure;
}

export interface QueueRow {
  name: string;
  concurrency: number;
  paused: boolean;
  waiting: number;
  pending: number;
  running: number;
  recent_succeeded: number;
  recent_failed: number;
  recent_cancelled: number;
}

/** The default window of QueueInfo.recent. */
export const RECENT_SECONDS = 3600;

/** recentSeconds as listQueues uses it: a whole number of seconds that DATEADD takes (int). */
export function checkRecentSeconds(recentSeconds: number): number {
  if (typeof recentSeconds !== 'number' || !Number.isFinite(recentSeconds) || recentSeconds < 0) {
    throw new EngineError('BAD_USER_INPUT', `recentSeconds must be a non-negative number, not ${recentSeconds}`);
  }
  return Math.min(Math.floor(recentSeconds), 2_147_483_647);
}

/**
 * Every queue (or one) with the counts of its open executions, and of those that ended
 * within the last `recentSeconds` by outcome (IX_AsyncExecResults_finished covers it).
 */
export async function listQueues(pool: sql.ConnectionPool, recentSeconds: number = RECENT_SECONDS, only?: string): Promise<QueueInfo[]> {
  const seconds = checkRecentSeconds(recentSeconds);
  // longer than any queue's name (nvarchar(100)): none
  if (only != null && only.length > 100) return [];
  const request = pool.request();
  request.input('only', sql.NVarChar(100), only ?? null);
  request.input('recentSeconds', sql.Int, seconds);
  const result = await request.query<QueueRow>(
    `DECLARE @since datetime2(3) = DATEADD(second, -@recentSeconds, SYSUTCDATETIME());
     SELECT q.name, q.concurrency, q.paused,
            COALESCE(o.waiting, 0) AS waiting, COALESCE(o.pending, 0) AS pending, COALESCE(o.running, 0) AS running,
            COALESCE(r.succeeded, 0) AS recent_succeeded, COALESCE(r.failed, 0) AS recent_failed,
            COALESCE(r.cancelled, 0) AS recent_cancelled
       FROM asyncexec.AsyncExecQueues AS q
       LEFT JOIN (SELECT e.queue,
                         COUNT(CASE WHEN e.status = 'WAITING' THEN 1 END) AS waiting,
                         COUNT(CASE WHEN e.status = 'PENDING' THEN 1 END) AS pending,
                         COUNT(CASE WHEN e.status = 'RUNNING' THEN 1 END) AS running
                    FROM asyncexec.AsyncExecResults AS e
                   WHERE e.status IN ('WAITING', 'PENDING', 'RUNNING')
                   GROUP BY e.queue) AS o ON o.queue = q.name
       LEFT JOIN (SELECT e.queue,
                         COUNT(CASE WHEN e.status = 'SUCCEEDED' THEN 1 END) AS succeeded,
                         COUNT(CASE WHEN e.status = 'FAILED' THEN 1 END) AS failed,
                         COUNT(CASE WHEN e.status = 'CANCELLED' THEN 1 END) AS cancelled
                    FROM asyncexec.AsyncExecResults AS e
                   WHERE e.finished_at >= @since AND e.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
                   GROUP BY e.queue) AS r ON r.queue = q.name
      WHERE @only IS NULL OR q.name = @only
      ORDER BY q.name;`,
  );
  return result.recordset.map((row) => toQueueInfo(row, seconds));
}

export function toQueueInfo(row: QueueRow, recentSeconds: number): QueueInfo {
  return {
    name: row.name,
    concurrency: row.concurrency,
    paused: row.paused === true,
    groupCommits: NO_GROUP_COMMITS,
    waiting: row.waiting,
    pending: row.pending,
    running: row.running,
    recent: { succeeded: row.recent_succeeded, failed: row.recent_failed, cancelled: row.recent_cancelled },
    recentSeconds,
  };
}

/** Queue names: 1–100 characters of A-Z a-z 0-9 _ . : - (as usp_AsyncExecCreateQueue and CK_AsyncExecQueues_name check). */
const QUEUE_NAME = /^[A-Za-z0-9_.:-]{1,100}$/;
export const MAX_CONCURRENCY = 1000;

/**
 * Refuse a bad name or limit before the call: a longer name would be cut to the
 * procedure's nvarchar(100) silently, and a fractional limit rounded by the driver.
 * The procedure checks both again (50005).
 */
export function checkQueueSettings(name: string, concurrency: number): void {
  if (typeof name !== 'string' || !QUEUE_NAME.test(name)) {
    throw new EngineError('BAD_USER_INPUT', `queue name "${name}" must be 1 to 100 characters of A-Z a-z 0-9 _ . : -`);
  }
  if (!Number.isInteger(concurrency) || concurrency < 1 || concurrency > MAX_CONCURRENCY) {
    throw new EngineError('BAD_USER_INPUT', `queue concurrency must be an integer between 1 and ${MAX_CONCURRENCY}, not ${concurrency}`);
  }
}

/** Create a queue (its own Service Broker queue, service and reader) or change its concurrency. */
export async function createQueue(pool: sql.ConnectionPool, name: string, concurrency = 10): Promise<void> {
  checkQueueSettings(name, concurrency);
  const request = pool.request();
  request.input('name', sql.NVarChar(100), name);
  request.input('concurrency', sql.Int, concurrency);
  try {
    await request.execute('asyncexec.usp_AsyncExecCreateQueue');
  } catch (error) {
    throw mapDatabaseError(error);
  }
}

/**
 * Pause a queue or resume it (usp_AsyncExecPauseQueue: a resume wakes its waiting calls at once);
 * returns the queue as listQueues reports it. NOT_FOUND for an unknown queue.
 */
export async function pauseQueue(pool: sql.ConnectionPool, name: string, paused: boolean): Promise<QueueInfo> {
  // longer than any queue's name (nvarchar(100)), or not one: none (the driver would cut it to another name)
  if (typeof name !== 'string' || !QUEUE_NAME.test(name)) throw new EngineError('NOT_FOUND', `no queue named ${JSON.stringify(String(name).slice(0, 200))}`);
  const request = pool.request();
  request.input('name', sql.NVarChar(100), name);
  request.input('paused', sql.Bit, paused);
  try {
    await request.execute('asyncexec.usp_AsyncExecPauseQueue');
  } catch (error) {
    throw mapDatabaseError(error);
  }
  const [queue] = await listQueues(pool, RECENT_SECONDS, name);
  if (!queue) throw new EngineError('NOT_FOUND', `no queue named ${JSON.stringify(name)}`);
  return queue;
}

/**
 * Create a queue or change its concurrency (MAX_QUEUE_READERS and the registry row, in
 * one transaction); returns the queue as listQueues reports it.
 */
export async function configureQueue(
  pool: sql.ConnectionPool,
  name: string,
  concurrency: number,
  groupCommits: Partial<GroupCommits> = {},
): Promise<QueueInfo> {
  checkQueueSettings(name, concurrency);
  checkGroupCommits(groupCommits);
  // the activated procedure commits each call by itself (RECEIVE, run, outcome, SEND): see docs/mssql.md
  if ((groupCommits.size ?? 1) > 1) {
    throw new EngineError('NOT_SUPPORTED', 'grouped commits (groupCommits.size > 1) are not supported on SQL Server; each call commits alone');
  }
  await createQueue(pool, name, concurrency);
  const [queue] = await listQueues(pool, RECENT_SECONDS, name);
  if (!queue) throw new EngineError('NOT_FOUND', `queue ${name} vanished after it was configured`);
  return queue;
}
