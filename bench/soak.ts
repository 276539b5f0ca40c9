/**
 * `BENCH_SOAK=<seconds> npm run bench`: a steady load for a long time, to see that nothing
 * grows without bound. The real service on an embedded PostgreSQL, a steady stream of
 * invokes (BENCH_SOAK_RATE calls/s, in invokeMany requests of 20), executionEvents
 * subscribers that read everything, and a retention short enough (BENCH_SOAK_RETENTION_S) that
 * the purge runs all along. Every minute it prints the service's memory, the database's size,
 * dead tuples, rows kept, and the drain rate: after warm-up they must be flat. Asserts nothing.
 */
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { createClient } from 'graphql-ws';
import pg from 'pg';
import WebSocket from 'ws';
import { startApp } from '../src/app.js';
import { loadConfig } from '../src/config.js';
import { silentLogger } from '../src/logger.js';
import { freePort } from '../test/support/database.js';

const SECONDS = Number(process.env.BENCH_SOAK);
const RATE = Number(process.env.BENCH_SOAK_RATE ?? 200);
const SUBSCRIBERS = Number(process.env.BENCH_SOAK_SUBSCRIBERS ?? 10);
const RETENTION_S = Number(process.env.BENCH_SOAK_RETENTION_S ?? 120);
const REPORT_MS = Number(process.env.BENCH_SOAK_REPORT_MS ?? 60_000);
const GROUP = 20;

const mb = (bytes: number) => `${(bytes / 1048576).toFixed(1)} MB`;

export async function soak(): Promise<void> {
  const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-soak-'));
  await chmod(dir, 0o755); // the embedded server runs as `postgres` when this runs as root
  const config = loadConfig({
    PORT: String(await freePort()),
    HOST: '127.0.0.1',
    ASYNCPROC_DATA_DIR: path.join(dir, 'data'),
    ASYNCPROC_EMBEDDED_PORT: String(await freePort()),
    ASYNCPROC_RETENTION_DAYS: String(RETENTION_S / 86_400),
    ASYNCPROC_METRICS: 'false',
    LOG_LEVEL: 'silent',
  });
  const app = await startApp(config, silentLogger);
  const url = app.server!.url;
  const sql = new pg.Client({ connectionString: app.embedded!.url });
  await sql.connect();
  let submitted = 0;
  let events = 0;
  let failures = 0;
  const clients = Array.from({ length: SUBSCRIBERS }, () => createClient({ url: url.replace(/^http/, 'ws'), webSocketImpl: WebSocket, retryAttempts: 5 }));
  for (const client of clients) {
    client.subscribe(
      { query: 'subscription { executionEvents(filter: { status: [SUCCEEDED, FAILED] }) { cursor status } }' },
      { next: () => void events++, error: () => void failures++, complete: () => undefined },
    );
  }
  const calls = JSON.stringify({
    query: `mutation { invokeMany(inputs: [${Array.from({ length: GROUP }, (_, i) => (i % 10 === 9 ? '{ procedure: "demo.fail", arguments: { message: "soak" } }' : '{ procedure: "demo.noop" }')).join(',')}]) { executions { token } } }`,
  });
  let stopping = false;
  const load = (async () => {
    const every = (1000 * GROUP) / RATE;
    for (let next = performance.now(); !stopping; next += every) {
      const response = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: calls }).catch(() => null);
      if (response?.ok) submitted += GROUP;
      else failures++;
      await response?.arrayBuffer().catch(() => undefined);
      const wait = next + every - performance.now();
      if (wait > 0) await new Promise((resolve) => setTimeout(resolve, wait));
    }
  })();

  console.log(`asyncproc soak — ${SECONDS} s, ${RATE} calls/s (1 in 10 fails), ${SUBSCRIBERS} executionEvents subscribers, retention ${RETENTION_S} s`);
  console.log('  min   rss       heap      db size   dead tuples  rows kept  pending  drained/s  events/s  errors');
  const started = Date.now();
  let last = { at: started, finished: 0, events: 0 };
  const finishedSoFar = async () =>
    Number((await sql.query(`select coalesce(sum(n_tup_del), 0) + (select count(*) from asyncproc.executions where finished_at is not null) as n from pg_stat_user_tables where schemaname = 'asyncproc' and relname = 'executions'`)).rows[0].n);
  while (Date.now() - started < SECONDS * 1000) {
    await new Promise((resolve) => setTimeout(resolve, Math.min(REPORT_MS, SECONDS * 1000 - (Date.now() - started))));
    const now = Date.now();
    const memory = process.memoryUsage();
    const size = Number((await sql.query('select pg_database_size(current_database()) as n')).rows[0].n);
    const dead = Number((await sql.query(`select coalesce(sum(n_dead_tup), 0) as n from pg_stat_user_tables where schemaname = 'asyncproc'`)).rows[0].n);
    const kept = Number((await sql.query('select count(*) as n from asyncproc.executions')).rows[0].n);
    const pending = Number((await sql.query(`select count(*) as n from asyncproc.executions where status in ('PENDING', 'RUNNING', 'WAITING')`)).rows[0].n);
    const finished = await finishedSoFar();
    const seconds = (now - last.at) / 1000;
    console.log(
      `  ${String(Math.round((now - started) / 60_000)).padStart(3)}   ${mb(memory.rss).padEnd(9)} ${mb(memory.heapUsed).padEnd(9)} ${mb(size).padEnd(9)} ${String(dead).padEnd(12)} ${String(kept).padEnd(10)} ${String(pending).padEnd(8)} ${((finished - last.finished) / seconds).toFixed(0).padEnd(10)} ${((events - last.events) / seconds).toFixed(0).padEnd(9)} ${failures}`,
    );
    last = { at: now, finished, events };
  }
  stopping = true;
  await load;
  console.log(`  submitted ${submitted} calls; ${events} events heard by ${SUBSCRIBERS} subscribers`);
  for (const client of clients) await client.dispose();
  await sql.end();
  await app.stop();
  await rm(dir, { recursive: true, force: true });
}
