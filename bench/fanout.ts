/**
 * The fan-out case of `npm run bench`: N graphql-ws subscribers of `executionEvents` (no filter,
 * one socket each, in a child process) while CALLS no-op calls are submitted (invokeMany, 100 a
 * mutation) and run. Per subscriber: when its last event arrived against the last completion (the
 * largest finishedAt); for the service: events delivered per second.
 *
 * BENCH_FANOUT_WATCHERS=W adds W executionCompleted subscribers, one call each (see runFanout).
 * BENCH_FANOUT_TRANSPORT=sse: the executionEvents subscribers use graphql-sse instead of graphql-ws.
 *
 * Alone, for a profile of the service's side:
 *   BENCH_FANOUT=50 node --cpu-prof --cpu-prof-dir=/tmp/prof --import tsx bench/fanout.ts
 */
import { fork } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { setFlagsFromString, writeHeapSnapshot } from 'node:v8';
import { runInNewContext } from 'node:vm';
import pg from 'pg';
import { startApp } from '../src/app.js';
import { loadConfig } from '../src/config.js';
import { startEmbeddedPostgres } from '../src/embeddedPostgres.js';
import { silentLogger } from '../src/logger.js';
import { freePort } from '../test/support/database.js';

/** BENCH_FANOUT_TRANSPORT=sse: the executionEvents subscribers use graphql-sse (one HTTP stream each) instead of graphql-ws. */
const TRANSPORT = process.env.BENCH_FANOUT_TRANSPORT === 'sse' ? 'sse' : 'ws';

export interface FanoutRun {
  subscribers: number;
  calls: number;
  /** Events all subscribers received. */
  events: number;
  /** Events delivered per second, from the first submit to the last arrival. */
  rate: number;
  /** Last arrival at any subscriber − the last completion (ms). */
  delayMs: number;
  /** Last arrival − the last submit (ms), and the last completion − the last submit. */
  afterSubmitMs: number;
  drainMs: number;
  /** The median subscriber's last arrival − the last completion (ms). */
  medianDelayMs: number;
  /**
   * CPU (ms, user + system) from the last submit to the last arrival: the service's (it runs in the
   * bench's process), and the event subscribers' process's (the load generator shares the machine's cores).
   */
  serviceCpuMs: number;
  clientsCpuMs: number;
  /** Calls some subscriber never heard finish, and finishes heard twice. */
  missing: number;
  repeats: number;
  errors: string[];
  /** With watchers: executionCompleted subscribers, one socket and one call each. */
  watchers?: WatcherRun;
}

export interface WatcherRun {
  count: number;
  /** Arrival at the watcher − the call's finishedAt (ms): median, p99, largest. */
  p50Ms: number;
  p99Ms: number;
  maxMs: number;
  /** Watchers that never heard their call end. */
  missing: number;
  /**
   * The service's resident memory growth while the watchers subscribed, per watcher (bytes; the service runs in
   * the bench's process), each side measured after a full garbage collection.
   */
  bytesPerWatcher: number;
  /** The same growth by part, per watcher (bytes): V8's heap in use, memory outside it held by JS objects, ArrayBuffers of it. */
  breakdown?: { heapUsed: number; external: number; arrayBuffers: number };
  errors: string[];
}

/** One run against a service on `databaseUrl` (migrated by the service itself). */
/**
 * With `watchers` > 0, the first `watchers` calls each have an `executionCompleted` subscriber of
 * their own (another child process, one socket each), and every call is submitted to run at one
 * instant a few seconds on, once all subscribers are in: the watchers' calls end while the
 * `executionEvents` subscribers' stream is at its busiest.
 */
export async function runFanout(databaseUrl: string, subscribers: number, calls: number, watchers = 0): Promise<FanoutRun> {
  calls = Math.max(calls, watchers);
  const config = loadConfig({ DATABASE_URL: databaseUrl, PORT: String(await freePort()), HOST: '127.0.0.1', LOG_LEVEL: 'silent', ASYNCPROC_AUTH: 'none', ASYNCPROC_DEMO: 'true' });
  const app = await startApp(config, silentLogger);
  const endpoint = app.server!.url;
  const gql = async (query: string, variables?: Record<string, unknown>) => {
    const response = await fetch(endpoint, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ query, variables }) });
    const body = (await response.json()) as { data?: any; errors?: unknown[] };
    if (body.errors) throw new Error(JSON.stringify(body.errors));
    return body.data;
  };
  try {
    const after = (await gql('{ changeCursor }')).changeCursor as string;
    const child = fork(fileURLToPath(new URL('./fanoutClients.mjs', import.meta.url)), [JSON.stringify({ url: endpoint, subscribers, after, timeoutMs: 120_000, transport: TRANSPORT })], {
      execArgv: [],
    });
    const messages: any[] = [];
    let wake: (() => void) | null = null;
    child.on('message', (message) => {
      messages.push(message);
      wake?.();
    });
    const next = () => new Promise<any>((resolve) => {
      const take = () => (messages.length ? resolve(messages.shift()) : (wake = take));
      take();
    });
    await next(); // ready: the sockets are opening
    await waitForSubscribers(app.hub!, subscribers);
    const tokens: string[] = [];
    // with watchers, every call waits until the watchers are in, then all are made due at one instant
    const runAt = watchers > 0 ? Date.now() + 3_600_000 : null;
    const t0 = Date.now();
    for (let n = 0; n < calls; n += 100) {
      const inputs = Array.from({ length: Math.min(100, calls - n) }, () => ({ procedure: 'demo.noop', ...(runAt ? { runAt: new Date(runAt).toISOString() } : {}) }));
      const data = await gql('mutation($i: [InvokeInput!]!) { invokeMany(inputs: $i) { executions { token } } }', { i: inputs });
      tokens.push(...data.invokeMany.executions.map((e: { token: string }) => e.token));
    }
    const before = await settledMemory();
    const watching = runAt ? watch(endpoint, tokens.slice(0, watchers)) : null;
    let bytesPerWatcher = NaN;
    let breakdown: WatcherRun['breakdown'];
    if (watching) {
      await waitForSubscribers(app.hub!, subscribers + watchers, 120_000);
      // the service runs in this process: what its memory grew by while the watchers came in (alone only:
      // event subscribers' traffic makes the difference noise)
      if (subscribers === 0) {
        // the last sockets' connection_ack and subscribe have been answered: let their garbage go too
        await new Promise((resolve) => setTimeout(resolve, 500));
        const after = await settledMemory();
        bytesPerWatcher = (after.rss - before.rss) / watchers;
        breakdown = {
          heapUsed: (after.heapUsed - before.heapUsed) / watchers,
          external: (after.external - before.external) / watchers,
          arrayBuffers: (after.arrayBuffers - before.arrayBuffers) / watchers,
        };
        if (process.env.BENCH_HEAP_SNAPSHOT) console.log(`heap snapshot: ${writeHeapSnapshot(process.env.BENCH_HEAP_SNAPSHOT)}`);
      }
      const release = new pg.Client({ connectionString: databaseUrl });
      await release.connect();
      await release.query(`update asyncproc.executions set run_at = clock_timestamp() where token = any($1::uuid[])`, [tokens]);
      await release.end();
    }
    const lastSubmit = Date.now();
    const cpuBefore = process.cpuUsage();
    child.send({ expect: tokens });
    const { results, cpuMs } = (await next()) as { results: { events: number; last: number; missing: number; repeats: number; errors: string[] }[]; cpuMs: number };
    const watched = await watching;
    const cpu = process.cpuUsage(cpuBefore);
    const client = new pg.Client({ connectionString: databaseUrl });
    await client.connect();
    const { rows } = await client.query<{ token: string; at: number }>(
      `select token::text, (extract(epoch from finished_at) * 1000)::float8 as at from asyncproc.executions where token = any($1::uuid[])`,
      [tokens],
    );
    await client.end();
    const finishedAt = new Map(rows.map((r) => [r.token, Number(r.at)]));
    const lastFinish = Math.max(...finishedAt.values());
    const lasts = results.map((r) => r.last).sort((a, b) => a - b);
    const events = results.reduce((sum, r) => sum + r.events, 0);
    return {
      subscribers,
      calls,
      events,
      rate: events / ((lasts.at(-1)! - t0) / 1000),
      delayMs: lasts.at(-1)! - lastFinish,
      afterSubmitMs: lasts.at(-1)! - lastSubmit,
      drainMs: lastFinish - lastSubmit,
      medianDelayMs: lasts[Math.floor(lasts.length / 2)] - lastFinish,
      clientsCpuMs: cpuMs,
      serviceCpuMs: (cpu.user + cpu.system) / 1000,
      missing: results.reduce((sum, r) => sum + r.missing, 0),
      repeats: results.reduce((sum, r) => sum + r.repeats, 0),
      errors: results.flatMap((r) => r.errors).slice(0, 5),
      ...(watched ? { watchers: { ...watcherRun(watched, finishedAt), bytesPerWatcher, breakdown } } : {}),
    };
  } finally {
    await app.stop();
  }
}

/** The watchers' child: subscribes one socket per token, answers with each arrival. */
async function watch(endpoint: string, tokens: string[]): Promise<{ arrivals: Record<string, number>; errors: string[]; count: number }> {
  // the tokens go over IPC: 10,000 of them are too long for a command line
  const child = fork(fileURLToPath(new URL('./fanoutWatchers.mjs', import.meta.url)), [], { execArgv: [] });
  child.send({ url: endpoint, tokens, timeoutMs: 180_000 });
  return new Promise((resolve, reject) => {
    child.on('message', (message: any) => message.arrivals && resolve({ ...message, count: tokens.length }));
    child.on('exit', (code) => reject(new Error(`the watchers exited (${code}) before answering`)));
  });
}

function watcherRun(watched: { arrivals: Record<string, number>; errors: string[]; count: number }, finishedAt: Map<string, number>): WatcherRun {
  // arrivals − finishedAt: the watchers' process and the database share this machine's clock
  const delays = Object.entries(watched.arrivals)
    .map(([token, at]) => at - finishedAt.get(token)!)
    .sort((a, b) => a - b);
  const at = (q: number) => delays[Math.min(delays.length - 1, Math.floor(q * delays.length))] ?? NaN;
  return { count: watched.count, p50Ms: at(0.5), p99Ms: at(0.99), maxMs: delays.at(-1) ?? NaN, missing: watched.count - delays.length, errors: watched.errors, bytesPerWatcher: NaN };
}

/** Garbage collection, whether or not node runs with --expose-gc. */
const collect: () => void = (() => {
  setFlagsFromString('--expose-gc');
  return runInNewContext('gc') as () => void;
})();

/** process.memoryUsage() after full collections, so what is counted is what is held, not garbage not yet collected. */
async function settledMemory(): Promise<NodeJS.MemoryUsage> {
  for (let i = 0; i < 3; i++) {
    collect();
    await new Promise((resolve) => setImmediate(resolve));
  }
  return process.memoryUsage();
}

async function waitForSubscribers(hub: { size: number }, n: number, timeoutMs = 60_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (hub.size < n) {
    if (Date.now() > deadline) throw new Error(`only ${hub.size} of ${n} subscribers joined`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

const kb = (bytes: number) => `${(bytes / 1024).toFixed(1)} KB`;

export const describeFanout = (r: FanoutRun) =>
  `${r.subscribers} subscribers: ${r.events} events, ${r.rate.toFixed(0)} events/s, last delivery ${(r.delayMs / 1000).toFixed(2)} s after the last completion (median subscriber ${(r.medianDelayMs / 1000).toFixed(2)} s); ` +
  `last completion ${(r.drainMs / 1000).toFixed(2)} s and last delivery ${(r.afterSubmitMs / 1000).toFixed(2)} s after the last submit` +
  (r.events ? `, service CPU ${((r.serviceCpuMs * 1000) / (r.events + (r.watchers?.count ?? 0))).toFixed(1)} µs an event (${(r.serviceCpuMs / 1000).toFixed(1)} s; the subscribers' process ${(r.clientsCpuMs / 1000).toFixed(1)} s)` : '') +
  (r.missing || r.repeats || r.errors.length ? ` — MISSING ${r.missing}, REPEATED ${r.repeats}, errors ${JSON.stringify(r.errors)}` : '') +
  (r.watchers
    ? `; ${r.watchers.count} executionCompleted watchers: heard their call end p50 ${r.watchers.p50Ms.toFixed(0)} ms, p99 ${r.watchers.p99Ms.toFixed(0)} ms, max ${r.watchers.maxMs.toFixed(0)} ms after it` +
      (Number.isNaN(r.watchers.bytesPerWatcher) ? '' : `, service memory ${(r.watchers.bytesPerWatcher / 1024).toFixed(1)} KB a watcher`) +
      (r.watchers.breakdown
        ? ` (heap ${kb(r.watchers.breakdown.heapUsed)}, external ${kb(r.watchers.breakdown.external)} of which ArrayBuffers ${kb(r.watchers.breakdown.arrayBuffers)})`
        : '') +
      (r.watchers.missing || r.watchers.errors.length ? ` — MISSING ${r.watchers.missing}, errors ${JSON.stringify(r.watchers.errors)}` : '')
    : '');

if (process.argv[1] && fileURLToPath(import.meta.url) === path.resolve(process.argv[1])) {
  const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-fanout-'));
  await chmod(dir, 0o755);
  const server = await startEmbeddedPostgres({ dataDir: path.join(dir, 'data'), port: await freePort() });
  try {
    const sizes = (process.env.BENCH_FANOUT ?? '50').split(',').map(Number);
    const calls = Number(process.env.BENCH_FANOUT_CALLS ?? 3000);
    const watchers = Number(process.env.BENCH_FANOUT_WATCHERS ?? 0);
    for (const [i, n] of sizes.entries()) {
      const admin = new pg.Client({ connectionString: server.url });
      await admin.connect();
      await admin.query(`create database fanout_${i}`);
      await admin.end();
      console.log(describeFanout(await runFanout(server.url.replace(/\/postgres$/, `/fanout_${i}`), n, calls, watchers)));
    }
  } finally {
    await server.stop();
    await rm(dir, { recursive: true, force: true });
  }
}
