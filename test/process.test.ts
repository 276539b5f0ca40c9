/**
 * The processes `npm start` and `npm run worker` create stop on SIGTERM or SIGINT sent to
 * that one pid, as a process manager, a container runtime or a test harness sends it:
 * nothing is left behind, the embedded PostgreSQL included.
 */
import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { chmod, mkdtemp, readdir, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, before, describe, it } from 'node:test';
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

function npm(args: string[], env: Record<string, string>): Started {
  const { DATABASE_URL: _ignored, ...inherited } = process.env;
  const child = spawn('npm', args, { cwd: ROOT, env: { ...inherited, LOG_LEVEL: 'info', ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  let output = '';
  child.stdout!.on('data', (chunk) => (output += chunk));
  child.stderr!.on('data', (chunk) => (output += chunk));
  const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)));
  return { npm: child, output: () => output, exited };
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
