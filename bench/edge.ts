/**
 * The GraphQL edge: `invoke` mutations/s from 10 HTTP clients in a separate process
 * (bench/invokeClients.ts) against pg-boss's single-call `send` from 10 concurrent callers, and
 * mutation response → `executionCompleted` at a graphql-ws subscriber.
 */
import { fork } from 'node:child_process';
import { once } from 'node:events';
import { fileURLToPath } from 'node:url';
import { startApp, type App } from '../src/app.js';
import { loadConfig } from '../src/config.js';
import { silentLogger } from '../src/logger.js';
import { freePort } from '../test/support/database.js';
import { measureLatencies } from './latencyClient.js';
import { concurrently, QUICK } from './measure.js';

export const INVOKES = Number(process.env.BENCH_INVOKES ?? (QUICK ? 1_000 : 5_000));
export const CALLERS = 10;

/** The service as deployed: GraphQL server, listener and (unless `activator` is false) the worker pool in one process. */
export async function startService(url: string, activator = true): Promise<App & { endpoint: string }> {
  const config = loadConfig({
    DATABASE_URL: url, PORT: String(await freePort()), HOST: '127.0.0.1', LOG_LEVEL: 'silent', ASYNCPROC_AUTH: 'none',
    ASYNCPROC_DEMO: 'true', ASYNCPROC_ACTIVATOR: String(activator),
  });
  const app = await startApp(config, silentLogger);
  return Object.assign(app, { endpoint: app.server!.url });
}

/** `invoke` mutations/s from CALLERS clients in a child process. */
export async function invokeRate(endpoint: string): Promise<number> {
  const child = fork(fileURLToPath(new URL('./invokeClients.ts', import.meta.url)), [
    JSON.stringify({ url: endpoint, invokes: INVOKES, concurrency: CALLERS, warmup: 200 }),
  ], { execArgv: ['--import', 'tsx'] });
  const [message] = (await once(child, 'message')) as [{ rate: number; errors: number }];
  if (message.errors) throw new Error(`${message.errors} invokes failed`);
  return message.rate;
}

/** pg-boss `send` calls/s from CALLERS concurrent callers (its client is this process). */
export async function pgBossSendRate(url: string): Promise<number> {
  const { default: PgBoss } = await import('pg-boss');
  const boss = new PgBoss({ connectionString: url, max: CALLERS, schedule: false, supervise: false });
  boss.on('error', () => undefined);
  await boss.start();
  await boss.createQueue('bench').catch(() => undefined); // the queue stays from an earlier round
  const send = () => boss.send('bench', {});
  for (let i = 0; i < 200; i++) await send(); // warm up
  const rate = await concurrently(CALLERS, INVOKES, async () => {
    if (!(await send())) throw new Error('pg-boss send returned no id');
  });
  await boss.stop({ graceful: false, wait: true });
  return rate;
}

/**
 * Mutation response → executionCompleted at a graphql-ws subscriber, `n` sequential calls (ms,
 * sorted). The client runs in this process, as the peer's addJob does beside its runner.
 */
export async function completionLatencies(endpoint: string, n: number): Promise<number[]> {
  return (await measureLatencies(endpoint, n, 20)).sort((a, b) => a - b);
}
