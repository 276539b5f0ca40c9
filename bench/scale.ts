/**
 * Scale-out and growth: drain with N `worker` processes (the CLI's `worker` command, children of
 * the bench, on the bench's cluster; no service activator), and drain and claim latency with a
 * large finished history or many queues holding pending work.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { fileURLToPath } from 'node:url';
import { active, CONCURRENCY, drainAsyncproc, openEngine } from './drains.js';
import { cpuMark, drainBetween, DRAIN, query, waitDrained, withClient, type Drain } from './measure.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));

/** A `worker` process; what it writes to stderr is kept for the error that says it failed. */
function startWorker(url: string): ChildProcess & { stderrText: string } {
  const child = spawn(process.execPath, ['--import', 'tsx', 'src/cli.ts', 'worker'], {
    cwd: ROOT,
    // a small pool: each process opens one connection per slot of the queue besides it
    env: { ...process.env, DATABASE_URL: url, LOG_LEVEL: 'warn', ASYNCPROC_AUTH: 'none', ASYNCPROC_POOL_SIZE: '2' },
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  const worker = Object.assign(child, { stderrText: '' });
  child.stderr!.on('data', (chunk: Buffer) => (worker.stderrText += chunk.toString()));
  return worker;
}

/**
 * DRAIN no-op calls run by `processes` worker processes sharing the default queue's limit of 10.
 * The calls wait (a runAt an hour ahead) until every process listens and the slots are held, then one
 * transaction releases them all; the rate is the database's own: first start to last finish.
 */
export async function drainWorkers(url: string, processes: number): Promise<Drain> {
  await (await openEngine(url, CONCURRENCY)).close();
  await query(url, `select count(asyncproc.invoke('demo.noop', '{}', null, now() + interval '1 hour')) from generate_series(1, $1)`, [DRAIN]);
  await query(url, 'vacuum analyze');
  const children = Array.from({ length: processes }, () => startWorker(url));
  try {
    const pids = children.map((c) => c.pid!);
    await withClient(url, async (client) => {
      const deadline = Date.now() + 120_000;
      for (;;) {
        // every process listens for work, and the queue's slots are held (a loop without one holds no connection)
        const { rows } = await client.query(`select count(*) filter (where application_name like 'asyncproc activator %') as listening,
                                                    count(*) filter (where application_name like 'asyncproc worker %') as slots
                                               from pg_stat_activity`);
        if (Number(rows[0].listening) >= processes && Number(rows[0].slots) >= CONCURRENCY) break;
        if (Date.now() > deadline || children.some((c) => c.exitCode !== null)) {
          throw new Error(`the worker processes did not connect: ${children.map((c) => c.stderrText).join('\n')}`);
        }
        await new Promise((resolve) => setTimeout(resolve, 50));
      }
      await client.query('begin');
      await client.query(`update asyncproc.executions set run_at = now() where status = 'WAITING'`);
      await client.query('select asyncproc.release_due()');
      await client.query('commit');
    });
    const a = await cpuMark(pids);
    await waitDrained(url, active());
    const b = await cpuMark(pids);
    const { rows } = await query(url, `select extract(epoch from max(finished_at) - min(started_at)) as s,
        count(*) filter (where status <> 'SUCCEEDED') as failed from asyncproc.executions`);
    if (Number(rows[0].failed)) throw new Error(`${rows[0].failed} calls did not succeed`);
    return drainBetween(DRAIN, a, b, Number(rows[0].s));
  } finally {
    await Promise.all(
      children.map(async (child) => {
        if (child.exitCode !== null) return;
        const exited = once(child, 'exit');
        child.kill('SIGTERM');
        await exited;
      }),
    );
  }
}

/**
 * `rows` finished executions in the shape the engine writes them: copies of a real finished
 * no-op call (one INSERT … SELECT), submitted half a second apart, all within the retention.
 */
export async function seedHistory(url: string, rows: number): Promise<void> {
  await drainAsyncproc(url, CONCURRENCY, 1); // the model row
  await query(
    url,
    `insert into asyncproc.executions (procedure, arguments, queue, status, submitted_at, started_at, finished_at, attempts,
                                       max_attempts, worker, backend_pid, result, transactional)
     select e.procedure, e.arguments, e.queue, e.status, t, t + (e.started_at - e.submitted_at), t + (e.finished_at - e.submitted_at),
            e.attempts, e.max_attempts, e.worker, e.backend_pid, e.result, e.transactional
       from (select * from asyncproc.executions where status = 'SUCCEEDED' limit 1) e,
            generate_series(1, $1) i,
            lateral (select now() - i * interval '0.5 s' as t) s`,
    [rows],
  );
  await query(url, 'vacuum analyze');
}

/** `queues` queues (concurrency 1) holding `perQueue` pending no-op calls each, which no worker serves. */
export async function seedQueues(url: string, queues: number, perQueue: number): Promise<void> {
  await (await openEngine(url)).close();
  await query(url, `select count(asyncproc.configure_queue('bench_' || i, 1)) from generate_series(1, $1) i`, [queues]);
  await query(url, `select count(asyncproc.invoke('demo.noop', '{}', 'bench_' || (i % $1 + 1))) from generate_series(1, $2) i`, [queues, queues * perQueue]);
  await query(url, 'vacuum analyze');
}
