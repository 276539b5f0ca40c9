import type pg from 'pg';
import { isUuid, type Execution, type ExecutionEvent, type ExecutionFilter, type ExecutionPage, type PageRequest } from '../../engine.js';
import { EXECUTION_COLUMNS, filterSql, toExecution, type ExecutionRow } from './rows.js';

export async function getExecutions(pool: pg.Pool, tokens: readonly string[]): Promise<Execution[]> {
  const valid = tokens.filter((t) => isUuid(t));
  if (!valid.length) return [];
  const { rows } = await pool.query<ExecutionRow>(
    `select ${EXECUTION_COLUMNS} from asyncproc.executions e where e.token = any($1::uuid[])`,
    [valid],
  );
  return rows.map(toExecution);
}

export async function getExecutionsByIds(pool: pg.Pool, ids: readonly string[]): Promise<Execution[]> {
  const { rows } = await pool.query<ExecutionRow>(
    `select ${EXECUTION_COLUMNS} from asyncproc.executions e where e.id = any($1::bigint[])`,
    [ids],
  );
  return rows.map(toExecution);
}

/** Newest first; `after`/`before` are execution ids. */
export async function listExecutions(pool: pg.Pool, filter: ExecutionFilter, page: PageRequest): Promise<ExecutionPage> {
  const { where, params } = filterSql(filter);
  const backward = page.last != null && page.first == null;
  const size = Math.max(0, Math.min(backward ? page.last! : page.first ?? 20, 500));
  const clauses = [where];
  if (page.after != null) {
    params.push(page.after);
    clauses.push(`e.id < $${params.length}::bigint`);
  }
  if (page.before != null) {
    params.push(page.before);
    clauses.push(`e.id > $${params.length}::bigint`);
  }
  params.push(size + 1);
  const { rows } = await pool.query<ExecutionRow>(
    `select ${EXECUTION_COLUMNS} from asyncproc.executions e where ${clauses.join(' and ')}
      order by e.id ${backward ? 'asc' : 'desc'} limit $${params.length}`,
    params,
  );
  const more = rows.length > size;
  const items = rows.slice(0, size).map(toExecution);
  if (backward) items.reverse();
  return {
    items,
    hasNextPage: backward ? page.before != null : more,
    hasPreviousPage: backward ? more : page.after != null,
  };
}

export async function countExecutions(pool: pg.Pool, filter: ExecutionFilter): Promise<number> {
  const { where, params } = filterSql(filter);
  const { rows } = await pool.query<{ n: string }>(`select count(*) as n from asyncproc.executions e where ${where}`, params);
  return Number(rows[0].n);
}

/** The latest state of every execution changed after `cursor`, in change order. */
export async function eventsSince(
  pool: pg.Pool,
  cursor: string | null,
  filter: ExecutionFilter,
  limit: number,
): Promise<ExecutionEvent[]> {
  const { where, params } = filterSql(filter, 2);
  const { rows } = await pool.query<ExecutionRow>(
    `select ${EXECUTION_COLUMNS} from asyncproc.executions e
      where e.seq > $1::bigint and ${where} order by e.seq limit $2`,
    [cursor ?? '0', limit, ...params],
  );
  return rows.map((row) => ({ cursor: row.seq, status: row.status, execution: toExecution(row) }));
}

export async function latestCursor(pool: pg.Pool): Promise<string | null> {
  const { rows } = await pool.query<{ seq: string | null }>('select max(seq)::text as seq from asyncproc.executions');
  return rows[0].seq;
}
