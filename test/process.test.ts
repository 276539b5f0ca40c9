/**
 * The processes `npm start` and `npm run worker` create stop on SIGTERM or SIGINT sent to
 * that one pid, as a process manager, a container runtime or a test harness sends it:
 * nothing is left behind, the embedded PostgreSQL included.
 */
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { chmod, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { embeddedUrl } from '../src/embeddedPostgres.js';
import { freePort, startTestCluster, waitFor, type TestCluster } from './support/database.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));

const alive = (pid: number) => {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === 'EPERM';
  }
};

/** Every process below `pid` now (from /proc), deepest last. */
async function descendants(pid: number): Promise<number[]> {
  const parents = new Map<number, number>();
  for (const entry of await readdir('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    const stat = await readFile(`/proc/${entry}/stat`, 'utf8').catch(() => '');
    // pid (comm) state ppid …; comm may hold spaces and parentheses
    const ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
    if (ppid) parents.set(Number(entry), ppid);
  }
  const found: number[] = [];
  const walk = (parent: number) => {
    for (const [child, ppid] of parents) if (ppid === parent) found.push(child), walk(child);
  };
  walk(pid);
  return found;
}

/** Whatever a failed test left running: SIGTERM first (the service stops its database), then SIGKILL. */
async function reap(pids: number[], postmaster?: number): Promise<void> {
  for (const pid of pids) if (alive(pid)) process.kill(pid, 'SIGTERM');
  await waitFor(async () => pids.every((pid) => !alive(pid)), 15_000, 'leftover processes to stop').catch(() => {
    for (const pid of pids) if (alive(pid)) process.kill(pid, 'SIGKILL');
  });
  if (postmaster && alive(postmaster)) {
    process.kill(postmaster, 'SIGINT'); // PostgreSQL's fast shutdown
    await waitFor(async () => !alive(postmaster), 15_000, 'the leftover postmaster to stop').catch(() => process.kill(postmaster, 'SIGKILL'));
  }
}

interface Started {
  npm: ChildProcess;
  output: () => string;
  exited: Promise<number | null>;
}

/** A child's output so far (stdout and stderr as they came), and its exit code once it exits. */
function watched(child: ChildProcess): Omit<Started, 'npm'> {
  let output = '';
  child.stdout!.on('data', (chunk) => (output += chunk));
  child.stderr!.on('data', (chunk) => (output += chunk));
  const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)));
  return { output: () => output, exited };
}

function npm(args: string[], env: Record<string, string>): Started {
  const { DATABASE_URL: _ignored, ...inherited } = process.env;
  const child = spawn('npm', args, { cwd: ROOT, env: { ...inherited, LOG_LEVEL: 'info', ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  return { npm: child, ...watched(child) };
}

const health = (port: number) =>
  fetch(`http://127.0.0.1:${port}/health`, { signal: AbortSignal.timeout(1000) }).then(
    (response) => response.ok,
    () => false,
  );

describe('npm start', () => {
  let dir: string;
  before(async () => {
    dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-process-'));
    await chmod(dir, 0o755); // the embedded server runs as `postgres` when tests run as root
  });
  after(() => rm(dir, { recursive: true, force: true }));

  for (const signal of ['SIGTERM', 'SIGINT'] as const) {
    it(`stops the service and its embedded PostgreSQL within seconds on ${signal} to the pid npm start made`, async () => {
      const port = await freePort();
      const dataDir = path.join(dir, `data-${signal}`);
      const embeddedPort = await freePort();
      const started = npm(['start'], { PORT: String(port), ASYNCPROC_EMBEDDED_PORT: String(embeddedPort), ASYNCPROC_DATA_DIR: dataDir });
      let tree: number[] = [];
      let postmaster: number | undefined;
      try {
        await waitFor(async () => started.npm.exitCode === null && (await health(port)), 60_000, `/health to answer:\n${started.output()}`);
        postmaster = Number((await readFile(path.join(dataDir, 'postmaster.pid'), 'utf8')).split('\n')[0]);
        assert.ok(alive(postmaster), 'the embedded postmaster runs');
        assert.ok(started.output().includes(embeddedUrl(embeddedPort)), 'the start-up log gives the embedded database\'s URL');
        tree = await descendants(started.npm.pid!);

        process.kill(started.npm.pid!, signal);
        const t0 = Date.now();
        await waitFor(async () => !(await health(port)), 10_000, '/health to stop answering');
        await waitFor(async () => !alive(postmaster!), 10_000 - (Date.now() - t0), `the embedded postmaster (pid ${postmaster}) to stop`);
        await waitFor(async () => tree.every((pid) => !alive(pid)), 10_000, `every process npm start made to end: ${tree.filter(alive).join(', ')}`);
        assert.equal(await started.exited, 0, started.output());
        assert.match(started.output(), new RegExp(`${signal}, stopping`));
      } finally {
        await reap([started.npm.pid!, ...tree], postmaster);
      }
    });
  }
});

describe('a signal while the embedded PostgreSQL starts', () => {
  let dir: string;
  before(async () => {
    dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-early-'));
    await chmod(dir, 0o755); // the embedded server runs as `postgres` when tests run as root
  });
  after(() => rm(dir, { recursive: true, force: true }));

  /** Processes whose command line names `dataDir` (a postmaster of it, its children). */
  async function serversOf(dataDir: string): Promise<number[]> {
    const found: number[] = [];
    for (const entry of await readdir('/proc')) {
      if (!/^\d+$/.test(entry)) continue;
      const words = (await readFile(`/proc/${entry}/cmdline`, 'utf8').catch(() => '')).split('\0');
      if (words.includes(dataDir) && !words.includes('asyncproc-watchdog')) found.push(Number(entry));
    }
    return found;
  }

  for (const restart of [false, true]) {
    it(`SIGTERM ${restart ? 'on a restart' : 'on a first start'}, as PostgreSQL is starting, leaves no server behind`, async () => {
      const dataDir = path.join(dir, `data-${restart}`);
      const run = async (signalAtStart: boolean) => {
        const child = spawn(process.execPath, ['--import', 'tsx', 'src/cli.ts', 'serve'], {
          cwd: ROOT,
          env: { ...process.env, DATABASE_URL: '', LOG_LEVEL: 'debug', PORT: String(await freePort()), ASYNCPROC_EMBEDDED_PORT: String(await freePort()), ASYNCPROC_DATA_DIR: dataDir },
          stdio: ['ignore', 'pipe', 'pipe'],
        });
        const { output, exited } = watched(child);
        try {
          // PostgreSQL's own first line of a start (the service logs it at debug)
          await waitFor(async () => (signalAtStart ? /starting PostgreSQL/ : /asyncproc listening|listening on/).test(output()), 60_000, `the start to come that far:\n${output()}`);
          child.kill('SIGTERM');
          await exited;
        } finally {
          if (child.exitCode === null) child.kill('SIGKILL');
        }
      };
      if (restart) await run(false); // initialised and stopped once
      // a few times: the signal must land before the server is ready, a moment of some 100 ms
      for (let round = 0; round < 3; round++) {
        await run(true);
        await waitFor(async () => (await serversOf(dataDir)).length === 0, 15_000, `no server of ${dataDir} left running: ${(await serversOf(dataDir)).join(', ')}`);
      }
    });
  }
});

describe('npm run worker', () => {
  let cluster: TestCluster;
  before(async () => {
    cluster = await startTestCluster();
  });
  after(() => cluster?.stop());

  for (const signal of ['SIGTERM', 'SIGINT'] as const) {
    it(`ends on ${signal} to the pid npm run worker made`, async () => {
      const url = await cluster.createDatabase();
      const started = npm(['run', 'worker'], { DATABASE_URL: url });
      let tree: number[] = [];
      try {
        await waitFor(async () => started.npm.exitCode === null && /asyncproc worker running/.test(started.output()), 60_000, `the worker to run:\n${started.output()}`);
        tree = await descendants(started.npm.pid!);
        process.kill(started.npm.pid!, signal);
        await waitFor(async () => tree.every((pid) => !alive(pid)), 10_000, `every process npm run worker made to end: ${tree.filter(alive).join(', ')}`);
        assert.equal(await started.exited, 0, started.output());
      } finally {
        await reap([started.npm.pid!, ...tree]);
      }
    });
  }
});

describe('a crashed service', () => {
  let dir: string;
  before(async () => {
    dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-crash-'));
    await chmod(dir, 0o755); // the embedded server runs as `postgres` when tests run as root
  });
  after(() => rm(dir, { recursive: true, force: true }));

  /** `npm start` on `dataDir`, ready; with the pids of its node process and its postmaster. */
  async function start(dataDir: string, ports: { http: number; embedded: number }) {
    const started = npm(['start'], { PORT: String(ports.http), ASYNCPROC_EMBEDDED_PORT: String(ports.embedded), ASYNCPROC_DATA_DIR: dataDir });
    await waitFor(async () => started.npm.exitCode === null && (await health(ports.http)), 60_000, `/health to answer:\n${started.output()}`);
    const postmaster = Number((await readFile(path.join(dataDir, 'postmaster.pid'), 'utf8')).split('\n')[0]);
    const tree = await descendants(started.npm.pid!);
    const words = await Promise.all(tree.map(async (pid) => ({ pid, cmd: (await readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => '')).split('\0') })));
    const node = words.find((w) => w.cmd.some((word) => word.endsWith('src/cli.ts')))!.pid;
    const watchdog = words.find((w) => w.cmd.includes('asyncproc-watchdog'))?.pid;
    return { started, postmaster, node, watchdog, tree };
  }
  const gql = (port: number, query: string) =>
    fetch(`http://127.0.0.1:${port}/graphql`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ query }) }).then((r) => r.json() as Promise<any>);

  it('SIGKILL of the node process alone: its PostgreSQL stops too; the next npm start is ready without a manual step and every call ends exactly once', async () => {
    const dataDir = path.join(dir, 'data-kill');
    const ports = { http: await freePort(), embedded: await freePort() };
    const first = await start(dataDir, ports);
    let second: Awaited<ReturnType<typeof start>> | undefined;
    try {
      assert.ok(first.watchdog, 'a watchdog ties the database to the service');
      const tag = `crash-${Date.now()}`;
      const calls = [
        ...Array.from({ length: 30 }, () => `{ procedure: "demo.record", arguments: { tag: "${tag}" } }`),
        ...Array.from({ length: 4 }, () => `{ procedure: "demo.sleep", arguments: { seconds: 3 } }`),
      ];
      const submitted = await gql(ports.http, `mutation { invokeMany(inputs: [${calls.join(',')}]) { executions { token } } }`);
      const tokens: string[] = submitted.data.invokeMany.executions.map((e: { token: string }) => e.token);
      await waitFor(async () => (await gql(ports.http, '{ running { execution { token } } }')).data?.running.length > 0, 10_000, 'a call to run');

      process.kill(first.node, 'SIGKILL');
      await waitFor(async () => !alive(first.postmaster), 10_000, `the orphaned postmaster ${first.postmaster} to be stopped by the watchdog`);
      await waitFor(async () => first.tree.every((pid) => !alive(pid)), 10_000, 'every process of the crashed service to end');

      const t0 = Date.now();
      second = await start(dataDir, ports);
      assert.ok(Date.now() - t0 < 30_000, 'ready again within seconds');
      const ended = await waitFor(async () => {
        const { data } = await gql(ports.http, `{ executions(first: 100, filter: { status: [SUCCEEDED, FAILED, CANCELLED] }) { totalCount } }`);
        return data.executions.totalCount === tokens.length ? data : null;
      }, 60_000, 'every submitted call to end');
      assert.ok(ended);
      const ledger = await gql(ports.http, `{ executions(first: 100, filter: { procedure: "demo.record", status: [SUCCEEDED] }) { totalCount } }`);
      assert.equal(ledger.data.executions.totalCount, 30);
      const sql = new pg.Client({ connectionString: embeddedUrl(ports.embedded) });
      await sql.connect();
      try {
        const { rows } = await sql.query(`select count(*)::int as n from demo.ledger where tag = $1`, [tag]);
        assert.equal(rows[0].n, 30, 'each recorded exactly once');
      } finally {
        await sql.end();
      }
    } finally {
      await reap([first.started.npm.pid!, ...first.tree], first.postmaster);
      if (second) {
        process.kill(second.started.npm.pid!, 'SIGTERM');
        await second.started.exited;
        await reap([second.started.npm.pid!, ...second.tree], second.postmaster);
      }
    }
  });

  it('a PostgreSQL left running without its watchdog is stopped at the next start; a stale postmaster.pid naming a live stranger is set aside', async () => {
    const dataDir = path.join(dir, 'data-orphan');
    const ports = { http: await freePort(), embedded: await freePort() };
    const first = await start(dataDir, ports);
    let next: Awaited<ReturnType<typeof start>> | undefined;
    try {
      // the watchdog dies with the service: the postmaster is left behind, re-parented
      process.kill(first.watchdog!, 'SIGKILL');
      process.kill(first.node, 'SIGKILL');
      await waitFor(async () => !alive(first.node), 5_000, 'the node process to die');
      assert.ok(alive(first.postmaster), 'the postmaster outlived its service');
      next = await start(dataDir, ports);
      assert.ok(!alive(first.postmaster), 'the leftover postmaster was stopped');
      assert.match(next.started.output(), /left running on .* by a service that is gone/);
      process.kill(next.started.npm.pid!, 'SIGTERM');
      assert.equal(await next.started.exited, 0);

      // a lock file naming a live process that is not a postmaster of this folder (this test's own pid)
      const lock = await readFile(path.join(dataDir, 'postmaster.pid'), 'utf8').catch(() => null);
      assert.equal(lock, null, 'a clean stop leaves no lock file');
      const fake = `${process.pid}\n${dataDir}\n${Math.floor(Date.now() / 1000)}\n${ports.embedded}\n/tmp\n127.0.0.1\n  1234567   7654321\nready   \n`;
      await writeFile(path.join(dataDir, 'postmaster.pid'), fake);
      next = await start(dataDir, ports);
      assert.match(next.started.output(), /removed a stale .*postmaster\.pid: process \d+ is alive but is not a PostgreSQL of this data folder/);
    } finally {
      await reap([first.started.npm.pid!, ...first.tree], first.postmaster);
      if (next) {
        if (next.started.npm.exitCode === null) process.kill(next.started.npm.pid!, 'SIGTERM');
        await next.started.exited;
        await reap([next.started.npm.pid!, ...next.tree], next.postmaster);
      }
    }
  });
});
