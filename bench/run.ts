/**
 * `npm run bench`: asyncproc on an embedded PostgreSQL, with graphile-worker measured
 * side by side on the same server in the same run. Prints numbers; asserts nothing.
 *
 *   invoke rate   GraphQL `invoke` mutations/s from 10 concurrent HTTP clients
 *   drain rate    20,000 queued no-op calls run at concurrency 10
 *   latency       mutation response → executionCompleted at a graphql-ws subscriber, 500 sequential calls
 *   fan-out       N executionEvents subscribers (graphql-ws) while 3,000 no-op calls run (bench/fanout.ts):
 *                 events/s delivered, last delivery after the last completion; BENCH_FANOUT=1,10,50,200
 *                 (sizes, '' to skip), BENCH_FANOUT_CALLS=3000. No peer: graphile-worker has no subscriptions.
 *
 * BENCH_SOAK=<seconds> runs bench/soak.ts instead: a steady load, memory and database size every minute.
 */
import { mkdtemp, rm, chmod } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { createClient } from 'graphql-ws';
import pg from 'pg';
import WebSocket from 'ws';
import { startApp } from '../src/app.js';
import { loadConfig } from '../src/config.js';
import { startEmbeddedPostgres } from '../src/embeddedPostgres.js';
import { createPostgresEngine } from '../src/engines/postgres/index.js';
import { silentLogger } from '../src/logger.js';
import { freePort } from '../test/support/database.js';
import { describeFanout, runFanout } from './fanout.js';
import { clusterCpuMs } from './clusterCpu.js';

const DRAIN = Number(process.env.BENCH_DRAIN ?? 20_000);
const INVOKES = Number(process.env.BENCH_INVOKES ?? 5_000);
const LATENCY = Number(process.env.BENCH_LATENCY ?? 500);
const CONCURRENCY = 10;
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 3);
const FANOUT = (process.env.BENCH_FANOUT ?? '1,10,50,200').split(',').filter(Boolean).map(Number);
const FANOUT_CALLS = Number(process.env.BENCH_FANOUT_CALLS ?? 3000);
/** BENCH_ONLY=drain: the drain rounds alone (no GraphQL service). */
const ONLY = process.env.BENCH_ONLY;

const report = (what: string, ours: string, peer = '') =>
  console.log(`  ${what}: ${ours}${peer ? `\n      graphile-worker: ${peer}` : ''}`);

let postmasterPid = 0;
function nodeCpuMs(): number {
  const { user, system } = process.cpuUsage();
  return (user + system) / 1000;
}
interface Drain {
  rate: number;
  nodeUs: number;
  postgresUs: number;
}

/** Rate and CPU microseconds per call of this process and of the database while `fn` drains `items`. */
async function measureDrain(items: number, fn: () => Promise<void>): Promise<Drain> {
  const [n0, p0, t0] = [nodeCpuMs(), await clusterCpuMs(postmasterPid), performance.now()];
  await fn();
  const [n1, p1, t1] = [nodeCpuMs(), await clusterCpuMs(postmasterPid), performance.now()];
  return { rate: items / ((t1 - t0) / 1000), nodeUs: ((n1 - n0) * 1000) / items, postgresUs: ((p1 - p0) * 1000) / items };
}

function median(drains: Drain[]): Drain {
  const mid = (values: number[]) => values.sort((a, b) => a - b)[Math.floor(values.length / 2)];
  return {
    rate: mid(drains.map((d) => d.rate)),
    nodeUs: mid(drains.map((d) => d.nodeUs)),
    postgresUs: mid(drains.map((d) => d.postgresUs)),
  };
}

const describeDrain = (d: Drain) => `${d.rate.toFixed(0)}/s, CPU per call: node ${d.nodeUs.toFixed(0)} µs + postgres ${d.postgresUs.toFixed(0)} µs`;

function percentile(sorted: number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

async function query(url: string, text: string, values: unknown[] = []) {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    return await client.query(text, values);
  } finally {
    await client.end();
  }
}

/** Seconds between `start` (a database timestamp) and the last finish, once everything finished. */
async function waitDrained(url: string, countSql: string): Promise<void> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    for (;;) {
      const { rows } = await client.query(countSql);
      if (Number(rows[0].n) === 0) return;
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
  } finally {
    await client.end();
  }
}

/** One drain round: queue DRAIN no-op calls, then run them with the worker pool at concurrency 10. */
async function drainAsyncproc(url: string): Promise<Drain> {
  const engine = createPostgresEngine({ connectionString: url });
  await engine.migrate();
  await engine.installDemo();
  await query(url, `select count(asyncproc.invoke('demo.noop')) from generate_series(1, $1)`, [DRAIN]);
  await query(url, 'vacuum analyze');
  const drain = await measureDrain(DRAIN, async () => {
    const activator = await engine.startActivator({ workerId: 'bench' });
    await waitDrained(url, `select count(*) as n from asyncproc.executions where status in ('PENDING', 'RUNNING')`);
    await activator.close();
  });
  const failed = Number((await query(url, `select count(*) as n from asyncproc.executions where status <> 'SUCCEEDED'`)).rows[0].n);
  if (failed) throw new Error(`${failed} calls did not succeed`);
  await engine.close();
  return drain;
}

/** The same for graphile-worker: DRAIN jobs of a no-op task at concurrency 10. */
async function drainGraphileWorker(url: string): Promise<Drain> {
  const { run, runMigrations, Logger } = await import('graphile-worker');
  const logger = new Logger(() => () => undefined);
  await runMigrations({ connectionString: url, logger });
  await query(url, `select count(graphile_worker.add_job('noop')) from generate_series(1, $1)`, [DRAIN]);
  await query(url, 'vacuum analyze');
  return measureDrain(DRAIN, async () => {
    const runner = await run({ connectionString: url, concurrency: CONCURRENCY, noHandleSignals: true, pollInterval: 1000, logger, taskList: { noop: async () => undefined } });
    await waitDrained(url, 'select count(*) as n from graphile_worker.jobs');
    await runner.stop();
  });
}

async function benchService(url: string) {
  // the service as deployed: GraphQL server, listener and worker pool in one process
  const config = loadConfig({ DATABASE_URL: url, PORT: String(await freePort()), HOST: '127.0.0.1', LOG_LEVEL: 'silent', ASYNCPROC_AUTH: 'none' });
  const app = await startApp(config, silentLogger);
  const endpoint = app.server!.url;
  const invoke = async () => {
    const response = await fetch(endpoint, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ query: `mutation { invoke(input: { procedure: "demo.noop" }) { execution { token } } }` }),
    });
    const body = (await response.json()) as { data: { invoke: { execution: { token: string } } } };
    return body.data.invoke.execution.token;
  };
  for (let i = 0; i < 200; i++) await invoke(); // warm up
  let sent = 0;
  const i0 = performance.now();
  await Promise.all(
    Array.from({ length: CONCURRENCY }, async () => {
      while (sent < INVOKES) {
        sent++;
        await invoke();
      }
    }),
  );
  const invokeRate = INVOKES / ((performance.now() - i0) / 1000);

  const ws = createClient({ url: endpoint.replace(/^http/, 'ws'), webSocketImpl: WebSocket });
  const latencies: number[] = [];
  for (let i = 0; i < LATENCY + 20; i++) {
    const token = await invoke();
    const start = performance.now();
    for await (const _event of ws.iterate({ query: `subscription($t: ID!) { executionCompleted(token: $t) { status } }`, variables: { t: token } })) {
      break;
    }
    if (i >= 20) latencies.push(performance.now() - start);
  }
  await ws.dispose();
  await app.stop();
  latencies.sort((a, b) => a - b);
  return { invokeRate, latencies };
}

async function main() {
  if (process.env.BENCH_SOAK) {
    // a long steady load instead of the rates (bench/soak.ts): not part of the usual run
    const { soak } = await import('./soak.js');
    return soak();
  }
  const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-bench-'));
  await chmod(dir, 0o755);
  const server = await startEmbeddedPostgres({ dataDir: path.join(dir, 'data'), port: await freePort() });
  const { readFile } = await import('node:fs/promises');
  postmasterPid = Number((await readFile(path.join(server.dataDir, 'postmaster.pid'), 'utf8')).split('\n')[0]);
  try {
    const version = (await query(server.url, 'show server_version')).rows[0].server_version;
    console.log(`asyncproc benchmark — embedded PostgreSQL ${version}, default settings, Node ${process.version}, ${(await import('node:os')).cpus().length} cores`);
    await query(server.url, 'create database bench_asyncproc');
    await query(server.url, 'create database bench_graphile');
    const ourUrl = server.url.replace(/\/postgres$/, '/bench_asyncproc');
    const peerUrl = server.url.replace(/\/postgres$/, '/bench_graphile');
    // rounds alternate, so a noisy moment of the machine hits both; medians are reported
    const ourDrains: Drain[] = [];
    const peerDrains: Drain[] = [];
    for (let round = 1; round <= ROUNDS; round++) {
      ourDrains.push(await drainAsyncproc(ourUrl));
      peerDrains.push(await drainGraphileWorker(peerUrl));
      const ratio = ourDrains.at(-1)!.rate / peerDrains.at(-1)!.rate;
      console.log(`  round ${round}: asyncproc ${describeDrain(ourDrains.at(-1)!)} | graphile-worker ${describeDrain(peerDrains.at(-1)!)} | ${ratio.toFixed(2)}×`);
    }
    const ratios = ourDrains.map((d, i) => d.rate / peerDrains[i].rate);
    const drainLine = () => {
      report(`drain ${DRAIN} no-op calls, concurrency ${CONCURRENCY} (median of ${ROUNDS})`, describeDrain(median(ourDrains)), describeDrain(median(peerDrains)));
      console.log(`      ratio (median of same-round ratios): ${ratios.sort((a, b) => a - b)[Math.floor(ratios.length / 2)].toFixed(2)}×`);
    };
    if (ONLY === 'drain') {
      console.log('');
      drainLine();
      return;
    }
    const ours = await benchService(ourUrl);
    console.log('');
    drainLine();
    report(`GraphQL invoke, ${CONCURRENCY} concurrent HTTP clients`, `${ours.invokeRate.toFixed(0)} mutations/s`);
    report(
      `mutation response → executionCompleted (graphql-ws), ${LATENCY} sequential`,
      `p50 ${percentile(ours.latencies, 50).toFixed(1)} ms, p95 ${percentile(ours.latencies, 95).toFixed(1)} ms, p99 ${percentile(ours.latencies, 99).toFixed(1)} ms`,
    );
    if (FANOUT.length) {
      console.log(`  executionEvents fan-out, ${FANOUT_CALLS} no-op calls (no peer: graphile-worker has no subscriptions):`);
      for (const [i, n] of FANOUT.entries()) {
        await query(server.url, `create database bench_fanout_${i}`);
        console.log(`    ${describeFanout(await runFanout(server.url.replace(/\/postgres$/, `/bench_fanout_${i}`), n, FANOUT_CALLS))}`);
      }
    }
  } finally {
    await server.stop();
    await rm(dir, { recursive: true, force: true });
  }
}

await main();
