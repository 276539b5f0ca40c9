/**
 * Drain rounds: asyncproc's worker pool (in this process) against graphile-worker, unbatched and
 * in its batch-job mode, on databases of the bench's cluster; and the enqueue → start latency of
 * single calls on an idle pool.
 */
import { createPostgresEngine, type PostgresEngine } from '../src/engines/postgres/index.js';
import { DRAIN, measureDrain, percentile, query, waitDrained, withClient, type Drain } from './measure.js';

export const CONCURRENCY = 10;
/** Items per graphile-worker batch job (its payload is an array; the task settles each item). */
export const GRAPHILE_BATCH = Number(process.env.BENCH_GRAPHILE_BATCH ?? 20);
/** Calls at most per transaction in the grouped asyncproc drain (the queue's groupCommits.size); as many as a graphile-worker batch by default. */
export const GROUP_SIZE = Number(process.env.BENCH_GROUP_SIZE ?? GRAPHILE_BATCH);
/** The grouped drain's concurrency: the peer's by default (like for like); fewer slots cost the database less a call (docs/scaling.md). */
export const GROUP_CONCURRENCY = Number(process.env.BENCH_GROUP_CONCURRENCY ?? CONCURRENCY);

/** Calls of a queue not yet finished, read through the ready table and the index of running calls (no scan of the history). */
export const active = (queue = 'default') =>
  `select (select count(*) from asyncproc.ready where queue = '${queue}')
        + (select count(*) from asyncproc.executions where queue = '${queue}' and status = 'RUNNING') as n`;

/** The engine on `url`, its default queue at `concurrency` with `groupSize` calls at most per transaction (1: one each). */
export async function openEngine(url: string, concurrency = CONCURRENCY, groupSize = 1): Promise<PostgresEngine> {
  const engine = createPostgresEngine({ connectionString: url });
  await engine.migrate();
  await engine.installDemo();
  await query(url, `select asyncproc.configure_queue('default', $1, $2)`, [concurrency, groupSize]);
  return engine;
}

/**
 * One round: queue `calls` no-op calls, then run them with the worker pool at `concurrency`, serving the default
 * queue only; `groupSize` > 1: with grouped commits of that size (and the default groupCommits.maxMs).
 */
export async function drainAsyncproc(url: string, concurrency = CONCURRENCY, calls = DRAIN, groupSize = 1): Promise<Drain> {
  const engine = await openEngine(url, concurrency, groupSize);
  await query(url, `select count(asyncproc.invoke('demo.noop')) from generate_series(1, $1)`, [calls]);
  await query(url, 'vacuum analyze');
  try {
    return await measureDrain(calls, async () => {
      const activator = await engine.startActivator({ workerId: 'bench', queues: ['default'] });
      await waitDrained(url, active());
      await activator.close();
    });
  } finally {
    const failed = Number((await query(url, `select count(*) as n from asyncproc.executions where queue = 'default' and status <> 'SUCCEEDED'`)).rows[0].n);
    await engine.close();
    if (failed) throw new Error(`${failed} calls did not succeed`);
  }
}

/**
 * Submit → start of `n` single calls, one at a time, on an idle pool of the default queue (the
 * database's own timestamps: started_at − submitted_at, ms, sorted). The claim's latency as a
 * caller sees it: wake-up, claim and the round trips before the call starts.
 */
export async function claimLatencies(url: string, n: number): Promise<number[]> {
  const engine = await openEngine(url);
  const activator = await engine.startActivator({ workerId: 'bench-latency', queues: ['default'] });
  try {
    return await withClient(url, async (client) => {
      const latencies: number[] = [];
      for (let i = 0; i < n + 10; i++) {
        const { token } = (await client.query(`select asyncproc.invoke('demo.noop') as token`)).rows[0];
        for (;;) {
          const { rows } = await client.query(
            `select status, extract(epoch from started_at - submitted_at) * 1000 as ms from asyncproc.executions where token = $1`,
            [token],
          );
          if (rows[0].status === 'SUCCEEDED') {
            if (i >= 10) latencies.push(Number(rows[0].ms));
            break;
          }
          await new Promise((resolve) => setTimeout(resolve, 2));
        }
      }
      return latencies.sort((a, b) => a - b);
    });
  } finally {
    await activator.close();
    await engine.close();
  }
}
export const describeLatencies = (sorted: number[]) =>
  `p50 ${percentile(sorted, 50).toFixed(2)} ms, p99 ${percentile(sorted, 99).toFixed(2)} ms`;

async function graphile(url: string) {
  const { run, runMigrations, Logger } = await import('graphile-worker');
  const logger = new Logger(() => () => undefined);
  await runMigrations({ connectionString: url, logger });
  return { run, logger };
}

/** graphile-worker: DRAIN jobs of a no-op task at concurrency 10, one job per call. */
export async function drainGraphileWorker(url: string): Promise<Drain> {
  const { run, logger } = await graphile(url);
  await query(url, `select count(graphile_worker.add_job('noop')) from generate_series(1, $1)`, [DRAIN]);
  await query(url, 'vacuum analyze');
  return measureDrain(DRAIN, async () => {
    const runner = await run({ connectionString: url, concurrency: CONCURRENCY, noHandleSignals: true, pollInterval: 1000, logger, taskList: { noop: async () => undefined } });
    await waitDrained(url, 'select count(*) as n from graphile_worker.jobs');
    await runner.stop();
  });
}

/**
 * graphile-worker's batched mode (batch jobs, since 0.14): DRAIN items in jobs of GRAPHILE_BATCH
 * items each, the task settling every item on its own (a failed item alone is retried). The rate
 * counts items, the CPU is per item.
 */
export async function drainGraphileBatched(url: string): Promise<Drain> {
  const { run, logger } = await graphile(url);
  const jobs = Math.ceil(DRAIN / GRAPHILE_BATCH);
  await query(
    url,
    `select count(graphile_worker.add_job('noop_batch', (select json_agg(json_build_object('n', i)) from generate_series(1, $2) i)))
       from generate_series(1, $1)`,
    [jobs, GRAPHILE_BATCH],
  );
  await query(url, 'vacuum analyze');
  return measureDrain(jobs * GRAPHILE_BATCH, async () => {
    const runner = await run({
      connectionString: url, concurrency: CONCURRENCY, noHandleSignals: true, pollInterval: 1000, logger,
      taskList: { noop_batch: async (payload) => (payload as unknown[]).map(async () => undefined) },
    });
    await waitDrained(url, 'select count(*) as n from graphile_worker.jobs');
    await runner.stop();
  });
}

/** graphile-worker: addJob called → the handler starts, `n` sequential jobs on an idle runner (ms, sorted). */
export async function graphileLatencies(url: string, n: number): Promise<number[]> {
  const { run, logger } = await graphile(url);
  let started: ((at: number) => void) | null = null;
  const runner = await run({
    connectionString: url, concurrency: CONCURRENCY, noHandleSignals: true, pollInterval: 1000, logger,
    taskList: { ping: async () => void started?.(performance.now()) },
  });
  try {
    const latencies: number[] = [];
    for (let i = 0; i < n + 10; i++) {
      const handled = new Promise<number>((resolve) => (started = resolve));
      const t0 = performance.now();
      await runner.addJob('ping', {});
      const at = await handled;
      if (i >= 10) latencies.push(at - t0);
    }
    return latencies.sort((a, b) => a - b);
  } finally {
    await runner.stop();
  }
}
