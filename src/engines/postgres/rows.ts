import { toExecutionResult, type Execution, type ExecutionError, type ExecutionFilter, type ExecutionResult, type ExecutionStatus } from '../../engine.js';

/** The columns every execution read selects, in the shape toExecution() expects. */
export const EXECUTION_COLUMNS = `e.id, e.token, e.procedure, e.arguments, e.queue, e.status, e.submitted_at, e.run_at,
  e.started_at, e.finished_at, e.attempts, e.max_attempts, e.submitted_by, e.error_number, e.error_message,
  e.error_detail, e.error_context, e.result, e.worker, e.backend_pid, e.seq, e.batch_id, e.stage, e.schedule_name`;

export interface ExecutionRow {
  id: string;
  token: string;
  procedure: string;
  arguments: Record<string, unknown>;
  queue: string;
  status: ExecutionStatus;
  submitted_at: Date;
  run_at: Date | null;
  started_at: Date | null;
  finished_at: Date | null;
  attempts: number;
  max_attempts: number;
  submitted_by: string | null;
  error_number: string | null;
  error_message: string | null;
  error_detail: string | null;
  error_context: string | null;
  result: Partial<ExecutionResult> | null;
  worker: string | null;
  backend_pid: number | null;
  seq: string;
  batch_id: string | null;
  stage: number | null;
  schedule_name: string | null;
}

/** PL/pgSQL reports the line of the failing statement in its context ("… line 3 at RAISE"). */
function lineOf(context: string | null): number | null {
  const match = context && /line (\d+)/.exec(context);
  return match ? Number(match[1]) : null;
}

/** The error columns shared by asyncproc.executions and asyncproc.attempts. */
export interface ErrorColumns {
  error_number: string | null;
  error_message: string | null;
  error_detail: string | null;
  error_context?: string | null;
}

export function toExecutionError(row: ErrorColumns): ExecutionError | null {
  if (row.error_message === null) return null;
  // the detail stays in the message too, for clients that show only the message
  const message = [row.error_message, row.error_detail].filter(Boolean).join(': ');
  return {
    number: row.error_number,
    message,
    severity: null,
    state: null,
    line: lineOf(row.error_context ?? null),
    detail: row.error_detail,
    context: row.error_context ?? null,
  };
}

/** A timestamp column as to_jsonb() writes it (ISO 8601 text), as pg's own parser gives it. */
function jsonDate(value: unknown): Date | null {
  return value == null ? null : new Date(value as string);
}

/**
 * A row of asyncproc.executions as to_jsonb() wrote it, in the shape of a read of
 * EXECUTION_COLUMNS: its bigints as text and its timestamps as dates, as pg's parsers give them.
 */
export function rowFromJson(json: Record<string, unknown>): ExecutionRow {
  return {
    ...(json as unknown as ExecutionRow),
    id: String(json.id),
    seq: String(json.seq),
    submitted_at: jsonDate(json.submitted_at)!,
    run_at: jsonDate(json.run_at),
    started_at: jsonDate(json.started_at),
    finished_at: jsonDate(json.finished_at),
  };
}

export function toExecution(row: ExecutionRow): Execution {
  return {
    id: row.id,
    token: row.token,
    procedure: row.procedure,
    arguments: row.arguments,
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
    result: row.result && toExecutionResult(row.result),
    worker: row.worker,
    sessionId: row.backend_pid,
    cursor: row.seq,
    batchId: row.batch_id,
    stage: row.stage,
  };
}

/** WHERE clause (without the keyword) and parameters for an execution filter, numbering from `offset + 1`. */
export function filterSql(filter: ExecutionFilter, offset = 0): { where: string; params: unknown[] } {
  const clauses: string[] = [];
  const params: unknown[] = [];
  if (filter.status?.length) {
    params.push(filter.status);
    clauses.push(`e.status = any($${offset + params.length}::text[])`);
  }
  if (filter.procedure) {
    params.push(filter.procedure);
    clauses.push(`e.procedure = $${offset + params.length}`);
  }
  if (filter.queue) {
    params.push(filter.queue);
    clauses.push(`e.queue = $${offset + params.length}`);
  }
  // != null, not truthiness: an empty subject is a subject, never "everyone's"
  if (filter.submittedBy != null) {
    params.push(filter.submittedBy);
    clauses.push(`e.submitted_by = $${offset + params.length}`);
  }
  if (filter.schedule != null) {
    params.push(filter.schedule);
    clauses.push(`e.schedule_name = $${offset + params.length}`);
  }
  return { where: clauses.length ? clauses.join(' and ') : 'true', params };
}
