import type pg from 'pg';
import type { QueueInfo } from '../../engine.js';

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
