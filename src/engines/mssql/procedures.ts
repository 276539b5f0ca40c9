import sql from 'mssql';
import { EngineError, type Procedure, type QueueInfo, type RegisterOptions } from '../../engine.js';
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
  position: number | null;
  parameter: string | null;
  type_text: string | null;
  is_output: boolean | null;
  has_default: boolean | null;
}

export async function listProcedures(pool: sql.ConnectionPool, only?: string): Promise<Procedure[]> {
  const request = pool.request();
  request.input('only', sql.NVarChar(261), only ?? null);
  const result = await request.query<ProcedureRow>(
    `SELECT r.name, r.queue, r.max_attempts, r.timeout_ms,
            p.position, p.name AS parameter, p.type_text, p.is_output, p.has_default
       FROM asyncexec.AsyncExecProcedures AS r
       LEFT JOIN asyncexec.AsyncExecParameters AS p ON p.[procedure] = r.name
      WHERE @only IS NULL OR r.name = @only
      ORDER BY r.name, p.position`,
  );
  const byName = new Map<string, Procedure>();
  for (const row of result.recordset) {
    let procedure = byName.get(row.name);
    if (!procedure) {
      procedure = { name: row.name, parameters: [], queue: row.queue, maxAttempts: row.max_attempts, timeoutMs: row.timeout_ms };
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

export async function registerProcedure(pool: sql.ConnectionPool, name: string, options: MssqlRegisterOptions = {}): Promise<Procedure> {
  const request = pool.request();
  request.input('procedure', sql.NVarChar(261), name);
  request.input('queue', sql.NVarChar(100), options.queue ?? 'default');
  request.input('maxAttempts', sql.Int, options.maxAttempts ?? 1);
  request.input('timeoutMs', sql.Int, options.timeoutMs ?? null);
  request.input('optionalParameters', sql.NVarChar(sql.MAX), options.optionalParameters ? JSON.stringify(options.optionalParameters) : null);
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

export async function listQueues(pool: sql.ConnectionPool): Promise<QueueInfo[]> {
  const result = await pool.request().query<QueueInfo>(
    `SELECT q.name, q.concurrency,
            COUNT(CASE WHEN e.status = 'WAITING' THEN 1 END) AS waiting,
            COUNT(CASE WHEN e.status = 'PENDING' THEN 1 END) AS pending,
            COUNT(CASE WHEN e.status = 'RUNNING' THEN 1 END) AS running
       FROM asyncexec.AsyncExecQueues AS q
       LEFT JOIN asyncexec.AsyncExecResults AS e ON e.queue = q.name AND e.status IN ('WAITING', 'PENDING', 'RUNNING')
      GROUP BY q.name, q.concurrency
      ORDER BY q.name`,
  );
  return result.recordset;
}

/** Create a queue (its own Service Broker queue, service and reader) or change its concurrency. */
export async function createQueue(pool: sql.ConnectionPool, name: string, concurrency = 10): Promise<void> {
  const request = pool.request();
  request.input('name', sql.NVarChar(100), name);
  request.input('concurrency', sql.Int, concurrency);
  try {
    await request.execute('asyncexec.usp_AsyncExecCreateQueue');
  } catch (error) {
    throw mapDatabaseError(error);
  }
}
