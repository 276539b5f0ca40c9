import type pg from 'pg';
import { EngineError, type QueueInfo } from '../../engine.js';

export async function listQueues(pool: pg.Pool): Promise<QueueInfo[]> {
  const { rows } = await pool.query<{ name: string; concurrency: number; waiting: string; pending: string; running: string }>(
    `select q.name, q.concurrency,
            (select count(*) from asyncproc.executions e where e.queue = q.name and e.status = 'WAITING') as waiting,
            (select count(*) from asyncproc.ready r where r.queue = q.name) as pending,
            (select count(*) from asyncproc.executions e where e.queue = q.name and e.status = 'RUNNING') as running
       from asyncproc.queues q order by q.name`,
  );
  return rows.map((r) => ({
    name: r.name,
    concurrency: r.concurrency,
    waiting: Number(r.waiting),
    pending: Number(r.pending),
    running: Number(r.running),
  }));
}

/** Create a queue or change its limit; the database's checks refuse a bad name or limit. */
export async function configureQueue(pool: pg.Pool, name: string, concurrency: number): Promise<QueueInfo> {
  if (!Number.isInteger(concurrency) || concurrency < 1 || concurrency > 1000) {
    throw new EngineError('BAD_USER_INPUT', `concurrency must be a whole number from 1 to 1000, not ${concurrency}`);
  }
  try {
    await pool.query('select asyncproc.configure_queue($1, $2)', [name, concurrency]);
  } catch (error) {
    if ((error as { code?: string }).code === '23514') {
      throw new EngineError('BAD_USER_INPUT', `bad queue name "${name}": 1–128 characters of A-Z a-z 0-9 _ . : -`, { cause: error });
    }
    throw error;
  }
  return (await listQueues(pool)).find((q) => q.name === name)!;
}
