import sql from 'mssql';
import type { Snapshot } from '../../changeCursor.js';
import {
  EngineError,
  type Execution,
  type ExecutionError,
  type ChangePage,
  type ChangeRead,
  type ExecutionFilter,
  type ExecutionPage,
  type ExecutionStatus,
  type PageRequest,
  type RunningExecution,
} from '../../engine.js';
import { parseExactJson } from '../exactJson.js';
import { cursorFromRowversion, decodeResult, isToken, rowversionOf, rowversionValue } from './types.js';

/** Anything that makes requests: a pool, or a transaction (one request at a time). */
export type Queryable = sql.ConnectionPool | sql.Transaction;

export const EXECUTION_COLUMNS = `e.id, e.token, e.[procedure], e.arguments, e.queue, e.status, e.submitted_at, e.run_at,
  e.started_at, e.finished_at, e.attempts, e.max_attempts, e.submitted_by, e.error_number, e.error_severity,
  e.error_state, e.error_line, e.error_procedure, e.error_message, e.result, e.session_id, e.worker, e.row_version, e.batch_id, e.stage, e.schedule_name`;

export interface ExecutionRow {
  id: string | number;
  token: string;
  procedure: string;
  arguments: string;
  queue: string;
  status: ExecutionStatus;
  submitted_at: Date;
  run_at: Date | null;
  started_at: Date | null;
  finished_at: Date | null;
  attempts: number;
  max_attempts: number;
  submitted_by: string | null;
  error_number: number | null;
  error_severity: number | null;
  error_state: number | null;
  error_line: number | null;
  error_procedure: string | null;
  error_message: string | null;
  result: string | null;
  session_id: number | null;
  worker: string | null;
  row_version: Buffer;
  /** uniqueidentifier: the driver spells it in capitals. */
  batch_id: string | null;
  stage: number | null;
  schedule_name: string | null;
}

/** The error columns shared by AsyncExecResults and AsyncExecAttempts. */
export interface ErrorColumns {
  error_number: number | null;
  error_severity: number | null;
  error_state: number | null;
  error_line: number | null;
  /** ERROR_PROCEDURE(): where the error was raised. */
  error_procedure?: string | null;
  error_message: string | null;
}

export function toExecutionError(row: ErrorColumns): ExecutionError | null {
  if (row.error_message === null && row.error_number === null) return null;
  return {
    number: row.error_number === null ? null : String(row.error_number),
    message: row.error_message ?? '',
    severity: row.error_severity,
    state: row.error_state,
    line: row.error_line,
    detail: null, // SQL Server errors have no separate detail
    context: row.error_procedure ?? null,
  };
}

export function toExecution(row: ExecutionRow): Execution {
  return {
    id: String(row.id), // bigint arrives as text from the driver
    token: row.token.toLowerCase(), // the driver spells GUIDs in capitals; tokens are lower case everywhere
    procedure: row.procedure,
    arguments: parseExactJson(row.arguments) as Record<string, unknown>,
    queue: row.queue,
    status: row.status,
    submittedAt: row.submitted_at,
    runAt: row.run_at,
    startedAt: row.started_at,
    finishedAt: row.finished_at,
    attempts: row.attempts,
    maxAttempts: row.max_attempts,
    submittedBy: row.submitted_by,
    schedule: row.schedule_name,
    error: toExecutionError(row),
    result: row.status === 'SUCCEEDED' ? decodeResult(row.result) : null,
    worker: row.worker,
    sessionId: row.session_id,
    cursor: cursorFromRowversion(row.row_version),
    batchId: row.batch_id === null ? null : row.batch_id.toLowerCase(),
    stage: row.stage,
  };
}

function request(db: Queryable): sql.Request {
  return new sql.Request(db as sql.ConnectionPool);
}

/** WHERE conditions for a filter, with their inputs added to the request. */
function where(req: sql.Request, filter: ExecutionFilter): string[] {
  const conditions: string[] = [];
  if (filter.status?.length) {
    req.input('statuses', sql.NVarChar(sql.MAX), JSON.stringify(filter.status));
    conditions.push('e.status IN (SELECT [value] FROM OPENJSON(@statuses))');
  }
  if (filter.procedure) conditions.push(exactly(req, 'procedure', 'e.[procedure]', filter.procedure, 261));
  if (filter.queue) conditions.push(exactly(req, 'queue', 'e.queue', filter.queue, 100));
  if (filter.submittedBy != null) conditions.push(submittedByIs(req, filter.submittedBy));
  if (filter.schedule != null) conditions.push(exactly(req, 'schedule', 'e.schedule_name', filter.schedule, 128));
  return conditions;
}

/**
 * `column` is exactly `value`, as on PostgreSQL and in the change feed's own filter
 * (completionHub's matches): = under the column's collation finds the rows by its index; a
 * binary collation then makes case count, and equal DATALENGTH trailing blanks, which =
 * ignores (KB 316626). A value longer than the column (nvarchar(maxLength)) matches no row,
 * and is never sent (a parameter sized below it is refused by the driver or the server).
 */
function exactly(req: sql.Request, name: string, column: string, value: string, maxLength: number): string {
  if (value.length > maxLength) return '1 = 0';
  req.input(name, sql.NVarChar(maxLength), value);
  return `(${column} = @${name} AND ${column} COLLATE Latin1_General_BIN2 = @${name} AND DATALENGTH(${column}) = DATALENGTH(@${name}))`;
}

/** Exactly this subject (an empty one too, never "everyone"); submitted_by is nvarchar(256). */
function submittedByIs(req: sql.Request, submittedBy: string): string {
  return exactly(req, 'submittedBy', 'e.submitted_by', submittedBy, 256);
}

const clause = (conditions: string[]) => (conditions.length ? `WHERE ${conditions.join(' AND ')}` : '');

export async function getExecutions(db: Queryable, tokens: readonly string[]): Promise<Execution[]> {
  const bad = tokens.find((t) => !isToken(t));
  if (bad !== undefined) throw new EngineError('BAD_USER_INPUT', `malformed token "${bad}"`);
  return selectWhereIn(db, 'token', 'uniqueidentifier', tokens);
}

export function getExecutionsById(db: Queryable, ids: readonly string[]): Promise<Execution[]> {
  return selectWhereIn(db, 'id', 'bigint', ids);
}

/** Rows whose key is one of `values`, passed as one JSON parameter (no list spliced into the text). */
async function selectWhereIn(db: Queryable, column: 'token' | 'id', type: 'uniqueidentifier' | 'bigint', values: readonly string[]): Promise<Execution[]> {
  if (!values.length) return [];
  const req = request(db);
  req.input('keys', sql.NVarChar(sql.MAX), JSON.stringify(values));
  const result = await req.query<ExecutionRow>(
    `SELECT ${EXECUTION_COLUMNS} FROM asyncexec.AsyncExecResults AS e
      WHERE e.${column} IN (SELECT CONVERT(${type}, [value]) FROM OPENJSON(@keys))`,
  );
  return result.recordset.map(toExecution);
}

const MAX_PAGE = 1000;

function pageSize(value: number | null | undefined, fallback: number): number {
  if (value === null || value === undefined) return fallback;
  if (!Number.isInteger(value) || value < 0) throw new EngineError('BAD_USER_INPUT', 'page sizes are non-negative integers');
  return Math.min(value, MAX_PAGE);
}

function idCursor(value: string): string {
  if (!/^\d{1,19}$/.test(value)) throw new EngineError('BAD_USER_INPUT', `malformed page cursor "${value}"`);
  return value;
}

/** Newest first, keyset-paged on id. */
export async function listExecutions(db: Queryable, filter: ExecutionFilter, page: PageRequest): Promise<ExecutionPage> {
  const backward = (page.last ?? null) !== null && (page.first ?? null) === null;
  const size = backward ? pageSize(page.last, 50) : pageSize(page.first, 50);
  const req = request(db);
  const conditions = where(req, filter);
  if (!backward && page.after) {
    req.input('after', sql.BigInt, idCursor(page.after));
    conditions.push('e.id < @after');
  }
  if (backward && page.before) {
    req.input('before', sql.BigInt, idCursor(page.before));
    conditions.push('e.id > @before');
  }
  req.input('take', sql.Int, size + 1);
  const result = await req.query<ExecutionRow>(
    `SELECT TOP (@take) ${EXECUTION_COLUMNS} FROM asyncexec.AsyncExecResults AS e ${clause(conditions)}
      ORDER BY e.id ${backward ? 'ASC' : 'DESC'}`,
  );
  const rows = result.recordset.map(toExecution);
  const more = rows.length > size;
  const items = rows.slice(0, size);
  if (backward) {
    items.reverse();
    return { items, hasNextPage: Boolean(page.before), hasPreviousPage: more };
  }
  return { items, hasNextPage: more, hasPreviousPage: Boolean(page.after) };
}

export async function countExecutions(db: Queryable, filter: ExecutionFilter): Promise<number> {
  const req = request(db);
  const result = await req.query<{ n: string | number }>(
    `SELECT COUNT_BIG(*) AS n FROM asyncexec.AsyncExecResults AS e ${clause(where(req, filter))}`,
  );
  return Number(result.recordset[0].n);
}

/**
 * The change feed (see src/changeCursor.ts), by rowversion. A transaction still open may
 * yet commit a rowversion below one already committed, so a read sees only rowversions
 * below MIN_ACTIVE_ROWVERSION(), taken before the read: every one of those has committed.
 * The position is then a snapshot with no in-progress list (xmin = xmax = that value).
 * Positions this engine hands out never list writers in progress; for one that does (a
 * client's cursor may), the read starts at its xmin and leaves out, in the query itself so
 * that TOP still fills a page, what that position saw: rowversions below its xmax but
 * listed. CONVERT style 1 reads the `0x…` text OPENJSON yields as binary.
 */
export async function readChanges(db: Queryable, since: Snapshot, read: ChangeRead): Promise<ChangePage> {
  const req = request(db);
  const conditions = where(req, read.filter ?? {});
  if (since.xip.length) {
    req.input('from', sql.VarBinary(8), rowversionOf(since.xmin));
    req.input('xmax', sql.VarBinary(8), rowversionOf(since.xmax));
    req.input('xip', sql.NVarChar(sql.MAX), JSON.stringify(since.xip.map((x) => cursorFromRowversion(rowversionOf(x)))));
    conditions.push(
      'e.row_version >= @from',
      '(e.row_version >= @xmax OR e.row_version IN (SELECT CONVERT(binary(8), [value], 1) FROM OPENJSON(@xip)))',
    );
  } else {
    req.input('from', sql.VarBinary(8), rowversionOf(since.xmax));
    conditions.push('e.row_version >= @from');
  }
  conditions.push('e.row_version < @upto');
  if (read.after) {
    req.input('after', sql.VarBinary(8), rowversionOf(read.after.writer));
    conditions.push('e.row_version > @after');
  }
  req.input('take', sql.Int, Math.max(1, Math.min(Math.trunc(read.limit), 10_000)));
  req.input('given', sql.VarBinary(8), read.upTo ? rowversionOf(read.upTo.xmax) : null);
  const result = await req.query<ExecutionRow>(
    `DECLARE @upto binary(8) = COALESCE(@given, CONVERT(binary(8), MIN_ACTIVE_ROWVERSION()));
     SELECT TOP (@take) ${EXECUTION_COLUMNS} FROM asyncexec.AsyncExecResults AS e ${clause(conditions)}
      ORDER BY e.row_version;
     SELECT @upto AS upto;`,
  );
  const recordsets = result.recordsets as unknown as [ExecutionRow[], { upto: Buffer }[]];
  const upto = rowversionValue(recordsets[1][0].upto);
  const position = read.upTo ?? { xmin: upto, xmax: upto, xip: [] };
  const changes = recordsets[0].map((row) => {
    const writer = rowversionValue(row.row_version);
    return { writer, order: writer, execution: toExecution(row) };
  });
  return { position, changes };
}

/** Every rowversion below MIN_ACTIVE_ROWVERSION() has committed. */
export async function currentPosition(db: Queryable): Promise<Snapshot> {
  const result = await request(db).query<{ v: Buffer }>('SELECT CONVERT(binary(8), MIN_ACTIVE_ROWVERSION()) AS v');
  const value = rowversionValue(result.recordset[0].v);
  return { xmin: value, xmax: value, xip: [] };
}

/** The newest rowversion of any call retention deleted (asyncexec.AsyncExecPurgeHorizon); null: none yet. */
export async function purgeHorizon(db: Queryable): Promise<bigint | null> {
  const result = await request(db).query<{ v: Buffer }>('SELECT row_version AS v FROM asyncexec.AsyncExecPurgeHorizon WHERE only_row = 1');
  const value = result.recordset.length ? rowversionValue(result.recordset[0].v) : 0n;
  return value === 0n ? null : value;
}

/** How many rows a listing returns at most. */
function listSize(limit: number): number {
  if (!Number.isInteger(limit) || limit < 0) throw new EngineError('BAD_USER_INPUT', 'limit must be a non-negative integer');
  return Math.min(limit, MAX_PAGE);
}

/**
 * RUNNING executions (of one queue, or all), longest-running first. The elapsed time is
 * the database's: started_at is set from SYSUTCDATETIME() by the claim, and so is "now" here.
 */
export async function listRunning(
  db: Queryable,
  queue: string | null,
  limit: number,
  submittedBy: string | null = null,
): Promise<RunningExecution[]> {
  const take = listSize(limit);
  const req = request(db);
  req.input('take', sql.Int, take);
  const ofQueue = queue == null ? '' : `AND ${exactly(req, 'queue', 'e.queue', queue, 100)}`;
  const mine = submittedBy == null ? '' : `AND ${submittedByIs(req, submittedBy)}`;
  const result = await req.query<ExecutionRow & { elapsed_ms: string | number | null }>(
    `SELECT TOP (@take) ${EXECUTION_COLUMNS}, DATEDIFF_BIG(millisecond, e.started_at, SYSUTCDATETIME()) AS elapsed_ms
       FROM asyncexec.AsyncExecResults AS e
      WHERE e.status = 'RUNNING' ${ofQueue} ${mine}
      ORDER BY e.started_at, e.id`,
  );
  // bigint arrives as text from the driver
  return result.recordset.map((row) => ({ execution: toExecution(row), elapsedMs: Math.max(0, Number(row.elapsed_ms ?? 0)) }));
}
