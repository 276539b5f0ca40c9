import { createHash } from 'node:crypto';
import type pg from 'pg';
import { formatSnapshot, parseSnapshot, type Snapshot } from '../../changeCursor.js';
import { isUuid, type ChangePage, type ChangeRead, type Execution, type ExecutionFilter, type ExecutionPage, type PageRequest } from '../../engine.js';
import { EXECUTION_COLUMNS, filterSql, toExecution, type ExecutionRow } from './rows.js';

export async function getExecutions(pool: pg.Pool, tokens: readonly string[]): Promise<Execution[]> {
  const valid = tokens.filter((t) => isUuid(t));
  if (!valid.length) return [];
  // named: every executionCompleted subscription and every look-up by token reads this way
  const { rows } = await pool.query<ExecutionRow>({
    name: 'asyncproc-executions-by-token',
    text: `select ${EXECUTION_COLUMNS} from asyncproc.executions e where e.token = any($1::uuid[])`,
    values: [valid],
  });
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

/**
 * The change feed (see src/changeCursor.ts). The rows `since` does not see are those whose
 * writer is at or past its xmax or in its in-progress list: two index conditions on xid,
 * so a long transaction in progress at `since` costs one lookup, not a scan from its xid.
 * The first page returns the snapshot its own statement read with; later pages of the
 * same read pass it as `upTo`, so a page never holds a change the first one could not see.
 */
const feedStatementNames = new Map<string, string>();
/** One name per text of a feed read (its filter's shape, with or without upTo and after). */
function feedStatementName(text: string): string {
  let name = feedStatementNames.get(text);
  if (name === undefined) feedStatementNames.set(text, (name = `asyncproc-feed-${createHash('sha256').update(text).digest('hex').slice(0, 16)}`));
  return name;
}

export async function readChanges(pool: pg.Pool, since: Snapshot, read: ChangeRead): Promise<ChangePage> {
  const params: unknown[] = [formatSnapshot(since)];
  const clauses: string[] = [];
  if (read.upTo) {
    params.push(formatSnapshot(read.upTo));
    clauses.push(`pg_visible_in_snapshot(e.xid, $${params.length}::pg_snapshot)`);
  }
  if (read.after) {
    params.push(read.after.writer.toString(), read.after.order.toString());
    // the second condition follows from the first; it is the one the index on xid can start from
    clauses.push(`(e.xid, e.seq) > ($${params.length - 1}::xid8, $${params.length}::bigint)`, `e.xid >= $${params.length - 1}::xid8`);
  }
  const filter = filterSql(read.filter ?? {}, params.length);
  params.push(...filter.params, Math.max(1, Math.min(read.limit, 10_000)));
  const limit = `$${params.length}`;
  const where = [...clauses, filter.where].join(' and ');
  // What the snapshot does not see: writers from its xmax on, and those in progress at it. Two
  // parts, each a range or a lookup of the index on xid; one condition with OR is not one the
  // index can start from, and the read walked the whole index (every change ever) each time.
  // The range is closed above by this statement's own snapshot (no writer from its xmax on is
  // visible to it): with both ends unknown when planned, the planner takes it for a narrow range
  // and walks the index, where an open one (a third of the table, by its default guess before
  // the table's statistics exist) had it read the whole table and sort it.
  const part = (unseen: string) =>
    `(select ${EXECUTION_COLUMNS}, e.xid from asyncproc.executions e where ${unseen} and ${where} order by e.xid, e.seq limit ${limit})`;
  const text = `select p.position::text as position, e.*
       from (select pg_current_snapshot() as position) p
       left join lateral (
         select u.*, u.xid::text as writer from (
           ${part('e.xid >= pg_snapshot_xmax($1::pg_snapshot) and e.xid < pg_snapshot_xmax(pg_current_snapshot())')}
           union all
           ${part('e.xid = any(array(select pg_snapshot_xip($1::pg_snapshot)))')}
         ) u order by u.xid, u.seq limit ${limit}) e on true`;
  // named (prepared once per connection, one per shape of the read): parsing and planning cost twice
  // what the read itself does. Its generic plan, the one PostgreSQL may settle on after five runs,
  // walks the index on xid as the custom ones do (test/postgres.test.ts checks both).
  const { rows } = await pool.query<ExecutionRow & { position: string; writer: string | null }>({ name: feedStatementName(text), text, values: params });
  const position = read.upTo ?? parseSnapshot(rows[0].position)!;
  const changes = rows
    .filter((row) => row.writer !== null)
    .map((row) => ({ writer: BigInt(row.writer!), order: BigInt(row.seq), execution: toExecution(row) }));
  return { position, changes };
}

/** The feed's position now: the snapshot of this statement. */
export async function currentPosition(pool: pg.Pool): Promise<Snapshot> {
  const { rows } = await pool.query<{ position: string }>('select pg_current_snapshot()::text as position');
  return parseSnapshot(rows[0].position)!;
}

/** The newest writer of any execution retention deleted (asyncproc.purge_horizon); null: none yet. */
export async function purgeHorizon(pool: pg.Pool): Promise<bigint | null> {
  const { rows } = await pool.query<{ writer: string }>('select writer::text as writer from asyncproc.purge_horizon');
  return rows.length ? BigInt(rows[0].writer) : null;
}
