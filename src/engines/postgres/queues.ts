import type pg from 'pg';
import { checkGroupCommits, EngineError, type GroupCommits, type QueueInfo, type RunningExecution } from '../../engine.js';
import { EXECUTION_COLUMNS, toExecution, type ExecutionRow } from './rows.js';

export const DEFAULT_RECENT_SECONDS = 3600;

interface QueueRow {
  name: string;
  concurrency: number;
  group_size: number;
  group_ms: number;
  paused: boolean;
  waiting: string;
  pending: string;
  running: string;
  succeeded: string;
  failed: string;
  cancelled: string;
}

/** Every queue (or only the one named) with its counts; `recent` covers the last `recentSeconds`. */
export async function listQueues(pool: pg.Pool, recentSeconds = DEFAULT_RECENT_SECONDS, only: string | null = null): Promise<QueueInfo[]> {
  const { rows } = await pool.query<QueueRow>(
    `with recent as (
       select e.queue,
              count(*) filter (where e.status = 'SUCCEEDED') as succeeded,
              count(*) filter (where e.status = 'FAILED') as failed,
              count(*) filter (where e.status = 'CANCELLED') as cancelled
         from asyncproc.executions e
        where e.finished_at > clock_timestamp() - $1 * interval '1 second' and ($2::text is null or e.queue = $2)
        group by e.queue)
     select q.name, q.concurrency, q.group_size, q.group_ms, q.paused,
            (select count(*) from asyncproc.executions e where e.queue = q.name and e.status = 'WAITING') as waiting,
            (select count(*) from asyncproc.ready r where r.queue = q.name) as pending,
            (select count(*) from asyncproc.executions e where e.queue = q.name and e.status = 'RUNNING') as running,
            coalesce(r.succeeded, 0) as succeeded, coalesce(r.failed, 0) as failed, coalesce(r.cancelled, 0) as cancelled
       from asyncproc.queues q left join recent r on r.queue = q.name
      where $2::text is null or q.name = $2
      order by q.name`,
    [recentSeconds, only],
  );
  return rows.map((r) => ({
    name: r.name,
    concurrency: r.concurrency,
    paused: r.paused,
    groupCommits: { size: r.group_size, maxMs: r.group_ms },
    waiting: Number(r.waiting),
    pending: Number(r.pending),
    running: Number(r.running),
    recent: { succeeded: Number(r.succeeded), failed: Number(r.failed), cancelled: Number(r.cancelled) },
    recentSeconds,
  }));
}

/** Create a queue or change its limit and grouping; the database's checks refuse a bad name. */
export async function configureQueue(pool: pg.Pool, name: string, concurrency: number, groupCommits: Partial<GroupCommits> = {}): Promise<QueueInfo> {
  if (!Number.isInteger(concurrency) || concurrency < 1 || concurrency > 1000) {
    throw new EngineError('BAD_USER_INPUT', `concurrency must be a whole number from 1 to 1000, not ${concurrency}`);
  }
  checkGroupCommits(groupCommits);
  try {
    await pool.query('select asyncproc.configure_queue($1, $2, $3, $4)', [name, concurrency, groupCommits.size ?? null, groupCommits.maxMs ?? null]);
  } catch (error) {
    if ((error as { code?: string }).code === '23514') {
      throw new EngineError('BAD_USER_INPUT', `bad queue name "${name}": 1–128 characters of A-Z a-z 0-9 _ . : -`, { cause: error });
    }
    throw error;
  }
  return (await listQueues(pool, DEFAULT_RECENT_SECONDS, name))[0];
}

/** Pause or resume a queue (asyncproc.pause_queue); NOT_FOUND when there is none of that name. */
export async function pauseQueue(pool: pg.Pool, name: string, paused: boolean): Promise<QueueInfo> {
  const { rows } = await pool.query<{ found: boolean }>('select (asyncproc.pause_queue($1, $2)).name is not null as found', [name, paused]);
  if (!rows[0].found) throw new EngineError('NOT_FOUND', `no queue named ${JSON.stringify(name)}`);
  return (await listQueues(pool, DEFAULT_RECENT_SECONDS, name))[0];
}

/** What runs now, longest first; elapsed by the database's clock (the one started_at was taken from). */
export async function listRunning(
  pool: pg.Pool,
  queue: string | null,
  limit: number,
  submittedBy: string | null = null,
): Promise<RunningExecution[]> {
  const { rows } = await pool.query<ExecutionRow & { elapsed_ms: string }>(
    `select ${EXECUTION_COLUMNS}, (extract(epoch from clock_timestamp() - e.started_at) * 1000)::bigint as elapsed_ms
       from asyncproc.executions e
      where e.status = 'RUNNING' and ($1::text is null or e.queue = $1) and ($3::text is null or e.submitted_by = $3)
      order by e.started_at, e.id
      limit $2`,
    [queue, limit, submittedBy],
  );
  return rows.map((row) => ({ execution: toExecution(row), elapsedMs: Number(row.elapsed_ms) }));
}
