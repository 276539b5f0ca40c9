/**
 * A service that cannot start says why in one line on stderr — the cause, the variable to
 * change, the fix — and exits 1, without a stack trace. Each failure is provoked for real.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { chmod, chown, mkdir, mkdtemp, rm, stat, writeFile } from 'node:fs/promises';
import { createServer, type Server } from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { startEmbeddedPostgres } from '../src/embeddedPostgres.js';
import { freePort, startTestCluster, type TestCluster } from './support/database.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));

/** Run the CLI as `npm start` does, to its end (it must fail fast). */
function runCli(command: string, env: Record<string, string>): Promise<{ code: number | null; stderr: string; stdout: string }> {
  const { DATABASE_URL: _unset, ...inherited } = process.env;
  const child = spawn(process.execPath, ['--import', 'tsx', 'src/cli.ts', command], {
    cwd: ROOT,
    env: { ...inherited, LOG_LEVEL: 'warn', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (chunk) => (stdout += chunk));
  child.stderr.on('data', (chunk) => (stderr += chunk));
  const timer = setTimeout(() => child.kill('SIGTERM'), 60_000);
  return new Promise((resolve) =>
    child.once('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stderr, stdout });
    }),
  );
}

async function assertOneLine(command: string, env: Record<string, string>, expected: RegExp): Promise<void> {
  const { code, stderr, stdout } = await runCli(command, env);
  assert.equal(code, 1, `exit code (stderr: ${stderr}, stdout: ${stdout})`);
  const lines = stderr.trimEnd().split('\n');
  assert.equal(lines.length, 1, `one line on stderr, got:\n${stderr}`);
  assert.match(lines[0], /^asyncproc: /);
  assert.match(lines[0], expected);
  assert.doesNotMatch(stderr, /^\s+at /m, 'no stack trace');
}

const listening = (port: number) =>
  new Promise<Server>((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(port, () => resolve(server));
  });

describe('start-up failures are one line naming the variable', () => {
  let dir: string;
  let cluster: TestCluster;
  let busy: Server;
  let busyPort: number;
  before(async () => {
    dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-startup-'));
    await chmod(dir, 0o755); // the embedded server runs as `postgres` when tests run as root
    cluster = await startTestCluster();
    busyPort = await freePort();
    busy = await listening(busyPort);
  });
  after(async () => {
    busy?.close();
    await cluster?.stop();
    await rm(dir, { recursive: true, force: true });
  });

  const embedded = async (name: string) => ({ ASYNCPROC_DATA_DIR: path.join(dir, name), ASYNCPROC_EMBEDDED_PORT: String(await freePort()) });

  it('a busy PORT', async () => {
    const re = new RegExp(`port ${busyPort} is in use \\(PORT=${busyPort}\\): stop the other process or set PORT=`);
    await assertOneLine('serve', { ...(await embedded('busy-port')), PORT: String(busyPort) }, re);
  });

  it('a busy ASYNCPROC_EMBEDDED_PORT', async () => {
    await assertOneLine(
      'serve',
      { ...(await embedded('busy-embedded')), ASYNCPROC_EMBEDDED_PORT: String(busyPort), PORT: String(await freePort()) },
      new RegExp(`port ${busyPort} is in use \\(ASYNCPROC_EMBEDDED_PORT=${busyPort}\\)`),
    );
  });

  it('an ASYNCPROC_DATA_DIR that is a file', async () => {
    const file = path.join(dir, 'a-file');
    await writeFile(file, 'not a folder');
    await assertOneLine('serve', { ...(await embedded('x')), ASYNCPROC_DATA_DIR: file, PORT: String(await freePort()) }, /ASYNCPROC_DATA_DIR=.*a-file/);
  });

  it('an ASYNCPROC_DATA_DIR where no folder can be made (under /proc): an error, not a start that spins forever', async () => {
    await assertOneLine('serve', { ...(await embedded('x')), ASYNCPROC_DATA_DIR: '/proc/asyncproc-test/data', PORT: String(await freePort()) }, /cannot be used: ENOENT.*ASYNCPROC_DATA_DIR=\/proc\/asyncproc-test\/data/);
  });

  it('an ASYNCPROC_DATA_DIR that holds something else', async () => {
    const folder = path.join(dir, 'photos');
    await mkdir(folder);
    await writeFile(path.join(folder, 'cat.jpg'), '');
    await assertOneLine('serve', { ...(await embedded('x')), ASYNCPROC_DATA_DIR: folder, PORT: String(await freePort()) }, /not empty.*ASYNCPROC_DATA_DIR=.*photos/);
  });

  it("a data folder of another PostgreSQL (it refuses the service's login) names ASYNCPROC_DATA_DIR", async () => {
    const settings = await embedded('foreign');
    // a cluster whose superuser's password is not the service's
    const server = await startEmbeddedPostgres({ dataDir: settings.ASYNCPROC_DATA_DIR, port: Number(settings.ASYNCPROC_EMBEDDED_PORT) });
    const client = new pg.Client({ connectionString: server.url });
    await client.connect();
    await client.query(`alter user postgres password 'not-the-service-password'`);
    await client.end();
    await server.stop();
    await assertOneLine('serve', { ...settings, PORT: String(await freePort()) }, /data folder .*foreign belongs to another PostgreSQL .*ASYNCPROC_DATA_DIR=.*foreign.*: set ASYNCPROC_DATA_DIR/);
  });

  it("as root, another user's folder is refused and left as it is, empty or not (it was given to postgres and set to mode 700)", { skip: process.getuid?.() !== 0 && 'only root gives the data folder to the postgres account' }, async () => {
    for (const files of [[], ['notes.txt']]) {
      const folder = path.join(dir, `someone-elses-${files.length}`);
      await mkdir(folder);
      for (const file of files) await writeFile(path.join(folder, file), 'mine');
      await chmod(folder, 0o755);
      await chown(folder, 1234, 1234);
      await assertOneLine('serve', { ...(await embedded('x')), ASYNCPROC_DATA_DIR: folder, PORT: String(await freePort()) }, /belongs to another user \(uid 1234\).*ASYNCPROC_DATA_DIR=.*someone-elses/);
      const after = await stat(folder);
      assert.deepEqual({ uid: after.uid, mode: after.mode & 0o777 }, { uid: 1234, mode: 0o755 }, 'left as it was');
    }
  });

  const withDatabase = (url: string) => ({ DATABASE_URL: url, ASYNCPROC_AUTH: 'none', PORT: '0' });

  it('a DATABASE_URL nothing answers on (password masked)', async () => {
    const port = await freePort();
    await assertOneLine('serve', withDatabase(`postgres://app:s3cret@127.0.0.1:${port}/app`), new RegExp(`no database answers at 127\\.0\\.0\\.1:${port} \\(DATABASE_URL=postgres://app:\\*\\*\\*@`));
  });

  it('a DATABASE_URL whose server takes the connection and never answers (connect_timeout, 30 s by default)', async () => {
    const sockets: import('node:net').Socket[] = [];
    const silent = createServer((socket) => void sockets.push(socket));
    await new Promise<void>((resolve) => silent.listen(0, '127.0.0.1', resolve));
    const { port } = silent.address() as import('node:net').AddressInfo;
    try {
      const started = Date.now();
      await assertOneLine('serve', withDatabase(`postgres://app:s3cret@127.0.0.1:${port}/app?connect_timeout=2`), new RegExp(`database at 127\\.0\\.0\\.1:${port} did not answer \\(DATABASE_URL=postgres://app:\\*\\*\\*@`));
      assert.ok(Date.now() - started < 30_000, 'given up after its connect_timeout, not held for ever');
    } finally {
      for (const socket of sockets) socket.destroy();
      silent.close();
    }
  });

  it('a DATABASE_URL whose host does not resolve', async () => {
    await assertOneLine('serve', withDatabase('postgres://app:s3cret@no-such-host.invalid/app'), /cannot be resolved \(DATABASE_URL=postgres:\/\/app:\*\*\*@no-such-host\.invalid/);
  });

  it('a wrong password', async () => {
    const url = new URL(cluster.server.url);
    url.password = 'wrong';
    await assertOneLine('serve', withDatabase(url.toString()), /password authentication failed.*DATABASE_URL=postgres:\/\/postgres:\*\*\*@.*fix the user and password/);
  });

  it('a database that does not exist', async () => {
    await assertOneLine('serve', withDatabase(cluster.server.url.replace(/\/postgres$/, '/nowhere')), /"nowhere" does not exist.*DATABASE_URL=/);
  });

  it('bad configuration, several problems at once', async () => {
    await assertOneLine('serve', { PORT: 'eighty', LOG_LEVEL: 'loud' }, /invalid configuration: PORT="eighty": .*; LOG_LEVEL="loud"/);
  });

  it('`worker` with no DATABASE_URL and no `npm start` running', async () => {
    const port = await freePort();
    await assertOneLine('worker', { ASYNCPROC_EMBEDDED_PORT: String(port) }, new RegExp(`no database: set DATABASE_URL, or start the service \\(npm start\\).*ASYNCPROC_EMBEDDED_PORT=${port}`));
  });
});
