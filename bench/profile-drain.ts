/**
 * `npx tsx bench/profile-drain.ts`: what one drained call costs PostgreSQL. Drains
 * BENCH_DRAIN no-op calls at concurrency 10 with pg_stat_statements loaded and prints the
 * statements per call (top level: the worker's round trips; nested: inside the routines),
 * HOT updates, WAL bytes per call and the indexes of asyncproc.executions. Prints numbers;
 * asserts nothing. Not a comparison: pg_stat_statements itself costs CPU.
 */
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { startEmbeddedPostgres } from '../src/embeddedPostgres.js';
import { createPostgresEngine } from '../src/engines/postgres/index.js';
import { freePort } from '../test/support/database.js';
import { clusterCpuMs } from './clusterCpu.js';
import { withClient } from './measure.js';

const DRAIN = Number(process.env.BENCH_DRAIN ?? 10_000);
/** PROFILE_STATEMENTS=0: without pg_stat_statements (cleaner CPU figures). */
const STATEMENTS = process.env.PROFILE_STATEMENTS !== '0';
/** PROFILE_SETUP: SQL run before the drain (an experiment: drop an index, ...). */
const SETUP = process.env.PROFILE_SETUP;
/** PROFILE_PERF=file: `perf record -g` the worker backends into that file while they drain. */
const PERF = process.env.PROFILE_PERF;

async function main() {
  const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-profile-'));
  await chmod(dir, 0o755);
  const server = await startEmbeddedPostgres({ dataDir: path.join(dir, 'data'), port: await freePort() });
  try {
    await withClient(server.url, async (c) => {
      if (STATEMENTS) {
        await c.query(`alter system set shared_preload_libraries = 'pg_stat_statements'`);
        await c.query(`alter system set pg_stat_statements.track = 'all'`);
      }
      await c.query('create database profile');
    });
    await server.stop();
    await server.start();
    const url = server.url.replace(/\/postgres$/, '/profile');
    const engine = createPostgresEngine({ connectionString: url });
    await engine.migrate();
    await engine.installDemo();
    await withClient(url, async (c) => {
      if (STATEMENTS) await c.query('create extension if not exists pg_stat_statements');
      if (SETUP) await c.query(SETUP);
      await c.query(`select count(asyncproc.invoke('demo.noop')) from generate_series(1, $1)`, [DRAIN]);
      await c.query('vacuum analyze');
      await c.query('checkpoint');
      if (STATEMENTS) await c.query('select pg_stat_statements_reset()');
      await c.query('select pg_stat_reset()');
    });
    const { readFile } = await import('node:fs/promises');
    const postmasterPid = Number((await readFile(path.join(server.dataDir, 'postmaster.pid'), 'utf8')).split('\n')[0]);
    const lsn0 = await withClient(url, async (c) => (await c.query('select pg_current_wal_lsn() as l')).rows[0].l);
    const cpu0 = [process.cpuUsage(), await clusterCpuMs(postmasterPid)] as const;
    const t0 = performance.now();
    const activator = await engine.startActivator({ workerId: 'profile' });
    let perf: import('node:child_process').ChildProcess | null = null;
    if (PERF) {
      const { spawn } = await import('node:child_process');
      const pids = await withClient(url, async (c) => {
        for (;;) {
          const { rows } = await c.query(`select pid from pg_stat_activity where application_name like 'asyncproc worker%'`);
          if (rows.length >= 10) return rows.map((r) => String(r.pid));
          await new Promise((r) => setTimeout(r, 5));
        }
      });
      perf = spawn('perf', ['record', '-F', '1999', '-g', '-o', PERF, '-p', pids.join(',')], { stdio: 'ignore' });
    }
    await withClient(url, async (c) => {
      for (;;) {
        const { rows } = await c.query(`select count(*) as n from asyncproc.executions where status in ('PENDING', 'RUNNING')`);
        if (Number(rows[0].n) === 0) break;
        await new Promise((r) => setTimeout(r, 20));
      }
    });
    const seconds = (performance.now() - t0) / 1000;
    if (perf) {
      const exited = new Promise((r) => perf!.once('exit', r));
      perf.kill('SIGINT');
      await exited;
    }
    const nodeUs = (() => { const u = process.cpuUsage(cpu0[0]); return (u.user + u.system) / DRAIN; })();
    const pgUs = ((await clusterCpuMs(postmasterPid)) - cpu0[1]) * 1000 / DRAIN;
    await activator.close();
    await engine.close();
    await withClient(url, async (c) => {
      const wal = (await c.query('select pg_wal_lsn_diff(pg_current_wal_lsn(), $1) as b', [lsn0])).rows[0].b;
      await new Promise((r) => setTimeout(r, 600)); // stats are flushed at most every 500 ms... and at session end
      console.log(`drained ${DRAIN} in ${seconds.toFixed(1)} s (${(DRAIN / seconds).toFixed(0)}/s${STATEMENTS ? ', with pg_stat_statements' : ''}), CPU per call: node ${nodeUs.toFixed(0)} µs + postgres ${pgUs.toFixed(0)} µs`);
      console.log(`WAL bytes per call: ${(Number(wal) / DRAIN).toFixed(0)}`);
      const tables = await c.query(`select relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del,
          round(100.0 * n_tup_hot_upd / nullif(n_tup_upd, 0), 1) as hot_pct
        from pg_stat_user_tables where schemaname = 'asyncproc' and (n_tup_upd + n_tup_ins + n_tup_del) > 0 order by relname`);
      console.table(tables.rows);
      const indexes = await c.query(`select indexrelname, idx_scan from pg_stat_user_indexes where relname = 'executions' order by 1`);
      console.log(`indexes on asyncproc.executions: ${indexes.rows.length}`);
      console.table(indexes.rows);
      if (!STATEMENTS) return;
      const statements = await c.query(`
        select toplevel, round(calls::numeric / $1, 2) as per_call,
               round((total_exec_time * 1000 / $1)::numeric, 1) as us_per_call,
               round((wal_bytes / $1)::numeric, 0) as wal_b,
               left(regexp_replace(query, '\\s+', ' ', 'g'), 110) as query
          from pg_stat_statements
         where calls >= $1 / 20
         order by toplevel desc, total_exec_time desc`, [DRAIN]);
      console.table(statements.rows);
    });
  } finally {
    await server.stop();
    await rm(dir, { recursive: true, force: true });
  }
}

await main();
