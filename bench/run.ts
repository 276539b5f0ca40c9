/**
 * `npm run bench`: asyncproc on an embedded PostgreSQL, with graphile-worker measured
 * side by side on the same server in the same run. Prints numbers; asserts nothing.
 *
 *   invoke rate   GraphQL `invoke` mutations/s from 10 concurrent HTTP clients
 *   drain rate    20,000 queued no-op calls run at concurrency 10
 *   latency       mutation response → executionCompleted at a graphql-ws subscriber, 500 sequential calls
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

const DRAIN = Number(process.env.BENCH_DRAIN ?? 20_000);
const INVOKES = Number(process.env.BENCH_INVOKES ?? 5_000);
const LATENCY = Number(process.env.BENCH_LATENCY ?? 500);
const CONCURRENCY = 10;

const results: [string, string, string][] = [];

/** CPU time (ms) used so far by the PostgreSQL cluster: the postmaster and its children. */
let postmasterPid = 0;
async function clusterCpuMs(): Promise<number> {
  const { readdir, readFile } = await import('node:fs/promises');
  let ticks = 0;
  for (const entry of await readdir('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    const stat = await readFile(`/proc/${entry}/stat`, 'utf8').catch(() => '');
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    if (Number(fields[1]) === postmasterPid) ticks += Number(fields[11]) + Number(fields[12]);
    // the postmaster's own time, and that of its children that have exited (cutime, cstime)
    if (Number(entry) === postmasterPid) ticks += Number(fields[11]) + Number(fields[12]) + Number(fields[13]) + Number(fields[14]);
  }
  return ticks * 10; // USER_HZ = 100
}
function nodeCpuMs(): number {
  const { user, system } = process.cpuUsage();
  return (user + system) / 1000;
}
/** CPU microseconds per item spent by this process and by the database while `fn` ran. */
async function measured<T>(items: number, fn: () => Promise<T>): Promise<T & { cpu: string }> {
  const [n0, p0] = [nodeCpuMs(), await clusterCpuMs()];
  const result = await fn();
  const [n1, p1] = [nodeCpuMs(), await clusterCpuMs()];
  const per = (ms: number) => ((ms * 1000) / items).toFixed(0);
  return { ...result, cpu: `CPU/call: node ${per(n1 - n0)} µs + postgres ${per(p1 - p0)} µs` };
}
const report = (what: string, ours: string, peer = '') => {
  results.push([what, ours, peer]);
  console.log(`  ${what}: ${ours}${peer ? `   (graphile-worker: ${peer})` : ''}`);
};

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

async function benchAsyncproc(serverUrl: string) {
  await query(serverUrl, 'create database bench_asyncproc');
  const url = serverUrl.replace(/\/postgres$/, '/bench_asyncproc');

  // drain: queue everything first, then start the worker pool
  const engine = createPostgresEngine({ connectionString: url });
  await engine.migrate();
  await engine.installDemo();
  await query(url, `select count(asyncproc.invoke('demo.noop')) from generate_series(1, $1)`, [DRAIN]);
  await query(url, 'vacuum analyze asyncproc.executions');
  const drain = await measured(DRAIN, async () => {
    const t0 = performance.now();
    const activator = await engine.startActivator({ workerId: 'bench' });
    await waitDrained(url, `select count(*) as n from asyncproc.executions where status in ('PENDING', 'RUNNING')`);
    const seconds = (performance.now() - t0) / 1000;
    await activator.close();
    return { seconds };
  });
  const failed = Number((await query(url, `select count(*) as n from asyncproc.executions where status <> 'SUCCEEDED'`)).rows[0].n);
  if (failed) throw new Error(`${failed} calls did not succeed`);
  await engine.close();

  // the service as deployed: GraphQL server, listener and worker pool in one process
  const config = loadConfig({ DATABASE_URL: url, PORT: String(await freePort()), HOST: '127.0.0.1', LOG_LEVEL: 'silent' });
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
  return { drainRate: DRAIN / drain.seconds, drainCpu: drain.cpu, invokeRate, latencies };
}

async function benchGraphileWorker(serverUrl: string) {
  const { run, runMigrations } = await import('graphile-worker');
  await query(serverUrl, 'create database bench_graphile');
  const url = serverUrl.replace(/\/postgres$/, '/bench_graphile');
  const logFactory = () => () => undefined;
  const { Logger } = await import('graphile-worker');
  const logger = new Logger(logFactory);
  await runMigrations({ connectionString: url, logger });
  await query(url, `select count(graphile_worker.add_job('noop')) from generate_series(1, $1)`, [DRAIN]);
  await query(url, 'vacuum analyze');
  const drain = await measured(DRAIN, async () => {
    const t0 = performance.now();
    const runner = await run({ connectionString: url, concurrency: CONCURRENCY, noHandleSignals: true, pollInterval: 1000, logger, taskList: { noop: async () => undefined } });
    await waitDrained(url, 'select count(*) as n from graphile_worker.jobs');
    const seconds = (performance.now() - t0) / 1000;
    await runner.stop();
    return { seconds };
  });
  return { drainRate: DRAIN / drain.seconds, drainCpu: drain.cpu };
}

async function main() {
  const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-bench-'));
  await chmod(dir, 0o755);
  const server = await startEmbeddedPostgres({ dataDir: path.join(dir, 'data'), port: await freePort() });
  const { readFile } = await import('node:fs/promises');
  postmasterPid = Number((await readFile(path.join(server.dataDir, 'postmaster.pid'), 'utf8')).split('\n')[0]);
  try {
    const version = (await query(server.url, 'show server_version')).rows[0].server_version;
    console.log(`asyncproc benchmark — embedded PostgreSQL ${version}, default settings, Node ${process.version}, ${(await import('node:os')).cpus().length} cores`);
    const ours = await benchAsyncproc(server.url);
    const peer = await benchGraphileWorker(server.url);
    console.log('');
    report(`drain ${DRAIN} no-op calls, concurrency ${CONCURRENCY}`, `${ours.drainRate.toFixed(0)} calls/s`, `${peer.drainRate.toFixed(0)} jobs/s`);
    report('  drain cost', ours.drainCpu, peer.drainCpu);
    report(`GraphQL invoke, ${CONCURRENCY} concurrent HTTP clients`, `${ours.invokeRate.toFixed(0)} mutations/s`);
    report(
      `mutation response → executionCompleted (graphql-ws), ${LATENCY} sequential`,
      `p50 ${percentile(ours.latencies, 50).toFixed(1)} ms, p95 ${percentile(ours.latencies, 95).toFixed(1)} ms, p99 ${percentile(ours.latencies, 99).toFixed(1)} ms`,
    );
  } finally {
    await server.stop();
    await rm(dir, { recursive: true, force: true });
  }
}

await main();
