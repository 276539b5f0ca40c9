/**
 * `npx tsx bench/profile-invoke.ts`: what one GraphQL `invoke` costs. Starts the service without its
 * worker pool in a child process (as bench/edge.ts configures it), warms it up, then lets 10 HTTP clients
 * in another process (bench/invokeClients.ts) send BENCH_INVOKES mutations and prints the rate, CPU µs
 * per mutation of the service and of PostgreSQL, transactions per mutation (pg_stat_database), and,
 * with pg_stat_statements, the statements per mutation. PROFILE_CPU=1: the service runs with
 * `--cpu-prof` and the top self times of the profile are printed per mutation (by function and by
 * package). Prints numbers; asserts nothing.
 *
 * PROFILE_STATEMENTS=1: load pg_stat_statements (costs CPU itself: not for rates).
 * PROFILE_ROUNDS=n: measure n times against the same service (after the one warm-up).
 */
import { fork, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { chmod, mkdtemp, readdir, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { startEmbeddedPostgres } from '../src/embeddedPostgres.js';
import { freePort } from '../test/support/database.js';
import { clusterCpuMs } from './clusterCpu.js';
import { startService } from './edge.js';
import { freshDatabase, nodeCpuMs, withClient } from './measure.js';

const INVOKES = Number(process.env.BENCH_INVOKES ?? 5_000);
const WARMUP = Number(process.env.PROFILE_WARMUP ?? 1_000);
const ROUNDS = Number(process.env.PROFILE_ROUNDS ?? 1);
const CPU = process.env.PROFILE_CPU === '1';
const STATEMENTS = process.env.PROFILE_STATEMENTS === '1';
const CALLERS = 10;
const TOP = Number(process.env.PROFILE_TOP ?? 30);

const self = fileURLToPath(import.meta.url);

/** The service side: started by the driver, answers its endpoint, stops when told. */
async function service(url: string): Promise<void> {
  const app = await startService(url, false);
  process.on('message', async (message) => {
    // the profile's clock is the monotonic one process.hrtime reads (µs there)
    if (message === 'mark') return void process.send!({ mark: Number(process.hrtime.bigint() / 1000n) });
    if (message !== 'stop') return;
    await app.stop();
    process.exit(0); // --cpu-prof writes its profile on exit
  });
  process.send!({ endpoint: app.endpoint });
}

/** Invokes/s of the load generator, and its CPU (ms, start-up included: it exits as soon as it has answered). */
async function clients(endpoint: string, invokes: number): Promise<{ rate: number; cpuMs: number }> {
  const child = fork(fileURLToPath(new URL('./invokeClients.ts', import.meta.url)), [
    JSON.stringify({ url: endpoint, invokes, concurrency: CALLERS, warmup: 0 }),
  ], { execArgv: ['--import', 'tsx'] });
  const [message] = (await once(child, 'message')) as [{ rate: number; errors: number }];
  const cpuMs = await nodeCpuMs([child.pid!]).catch(() => NaN);
  if (message.errors) throw new Error(`${message.errors} invokes failed`);
  return { rate: message.rate, cpuMs };
}

interface ProfileNode {
  id: number;
  callFrame: { functionName: string; url: string; lineNumber: number };
  children?: number[];
}
interface Profile {
  nodes: ProfileNode[];
  samples: number[];
  timeDeltas: number[];
  startTime: number;
  endTime: number;
}

/** The package (or our own folder) a frame belongs to. */
function packageOf(url: string, functionName: string): string {
  if (!url) return functionName.startsWith('(') ? functionName : '(native)';
  const modules = url.lastIndexOf('node_modules/');
  if (modules >= 0) {
    const rest = url.slice(modules + 'node_modules/'.length).split('/');
    return rest[0].startsWith('@') ? `${rest[0]}/${rest[1]}` : rest[0];
  }
  if (url.startsWith('node:')) return 'node:' + url.slice(5).split('/')[0];
  const src = url.indexOf('/src/');
  if (src >= 0) return 'asyncproc ' + url.slice(src + 1).split('/').slice(0, 2).join('/');
  return url;
}

/** Self time per function and per package, µs per mutation, over the samples between `from` and `to` (µs, the profile's clock): the measured rounds. */
function summarize(profile: Profile, mutations: number, from: number, to: number): void {
  const byId = new Map(profile.nodes.map((n) => [n.id, n]));
  const selfUs = new Map<number, number>();
  let at = profile.startTime;
  profile.samples.forEach((id, i) => {
    at += profile.timeDeltas[i];
    const us = profile.timeDeltas[i + 1] ?? 0;
    if (at >= from && at < to) selfUs.set(id, (selfUs.get(id) ?? 0) + us);
  });
  const byFunction = new Map<string, number>();
  const byPackage = new Map<string, number>();
  let total = 0;
  for (const [id, us] of selfUs) {
    const { functionName, url, lineNumber } = byId.get(id)!.callFrame;
    if (functionName === '(idle)') continue;
    total += us;
    const pkg = packageOf(url, functionName);
    const key = `${functionName || '(anonymous)'} ${pkg}${url ? `:${lineNumber + 1}` : ''}`;
    byFunction.set(key, (byFunction.get(key) ?? 0) + us);
    byPackage.set(pkg, (byPackage.get(pkg) ?? 0) + us);
  }
  const per = (us: number) => (us / mutations).toFixed(1).padStart(7);
  console.log(`\nservice CPU in the profile (not idle): ${(total / mutations).toFixed(0)} µs per mutation`);
  console.log('\nby package, self µs per mutation:');
  for (const [pkg, us] of [...byPackage].sort((a, b) => b[1] - a[1]).slice(0, TOP)) console.log(`  ${per(us)}  ${pkg}`);
  console.log('\nby function, self µs per mutation:');
  for (const [fn, us] of [...byFunction].sort((a, b) => b[1] - a[1]).slice(0, TOP)) console.log(`  ${per(us)}  ${fn}`);
}

async function driver(): Promise<void> {
  const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-profile-invoke-'));
  await chmod(dir, 0o755);
  const server = await startEmbeddedPostgres({ dataDir: path.join(dir, 'data'), port: await freePort() });
  let child: ChildProcess | undefined;
  try {
    if (STATEMENTS) {
      await withClient(server.url, async (c) => {
        await c.query(`alter system set shared_preload_libraries = 'pg_stat_statements'`);
        await c.query(`alter system set pg_stat_statements.track = 'all'`);
      });
      await server.stop();
      await server.start();
    }
    const url = await freshDatabase(server.url, 'profile_invoke');
    if (STATEMENTS) await withClient(url, (c) => c.query('create extension if not exists pg_stat_statements'));
    const postmasterPid = Number((await readFile(path.join(server.dataDir, 'postmaster.pid'), 'utf8')).split('\n')[0]);
    const profileDir = path.join(dir, 'cpuprofile');
    child = fork(self, ['--service', url], {
      execArgv: ['--import', 'tsx', ...(CPU ? ['--cpu-prof', '--cpu-prof-dir', profileDir] : [])],
    });
    const [{ endpoint }] = (await once(child, 'message')) as [{ endpoint: string }];
    await clients(endpoint, WARMUP);
    const mark = async () => {
      child!.send('mark');
      return ((await once(child!, 'message')) as [{ mark: number }])[0].mark;
    };
    const from = await mark();
    const commits = () =>
      withClient(url, async (c) => Number((await c.query(`select xact_commit + xact_rollback as n from pg_stat_database where datname = current_database()`)).rows[0].n));
    for (let round = 1; round <= ROUNDS; round++) {
      if (STATEMENTS) await withClient(url, (c) => c.query('select pg_stat_statements_reset()'));
      await new Promise((r) => setTimeout(r, 600)); // transaction counts reach pg_stat_database within 500 ms
      const before = { xacts: await commits(), node: await nodeCpuMs([child.pid!]), pg: await clusterCpuMs(postmasterPid) };
      const { rate, cpuMs } = await clients(endpoint, INVOKES);
      const after = { node: await nodeCpuMs([child.pid!]), pg: await clusterCpuMs(postmasterPid) };
      await new Promise((r) => setTimeout(r, 600));
      // each commits() read is itself one transaction
      const xacts = (await commits()) - before.xacts - 1;
      console.log(
        `round ${round}: ${INVOKES} invokes at ${rate.toFixed(0)}/s; CPU per mutation: service ${(((after.node - before.node) * 1000) / INVOKES).toFixed(0)} µs, ` +
          `postgres ${(((after.pg - before.pg) * 1000) / INVOKES).toFixed(0)} µs, clients ${((cpuMs * 1000) / INVOKES).toFixed(0)} µs (their start-up included); transactions per mutation ${(xacts / INVOKES).toFixed(2)}`,
      );
      if (STATEMENTS) {
        const { rows } = await withClient(url, (c) =>
          c.query(
            `select toplevel, round(calls::numeric / $1, 2) as per_mutation, round((total_exec_time * 1000 / $1)::numeric, 1) as us,
                    left(regexp_replace(query, '\\s+', ' ', 'g'), 100) as query
               from pg_stat_statements where calls >= $1 / 20 order by toplevel desc, calls desc`,
            [INVOKES],
          ),
        );
        console.table(rows);
      }
    }
    const to = await mark();
    child.send('stop');
    await once(child, 'exit');
    child = undefined;
    if (CPU) {
      const [file] = await readdir(profileDir);
      summarize(JSON.parse(await readFile(path.join(profileDir, file), 'utf8')) as Profile, INVOKES * ROUNDS, from, to);
      if (process.env.PROFILE_KEEP) {
        const { copyFile } = await import('node:fs/promises');
        await copyFile(path.join(profileDir, file), process.env.PROFILE_KEEP);
        console.log(`\nprofile kept in ${process.env.PROFILE_KEEP}`);
      }
    }
  } finally {
    child?.kill();
    await server.stop();
    await rm(dir, { recursive: true, force: true });
  }
}

if (process.argv[2] === '--service') await service(process.argv[3]);
else await driver();
