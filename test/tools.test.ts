/**
 * The newcomer's tools beside the service: `npm run db-url` prints the database's URL
 * (DATABASE_URL, or the embedded server's), `npm run sql` runs a SQL file on it without
 * psql. Run as a user runs them, against a real PostgreSQL.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdir, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, before, describe, it } from 'node:test';
import { embeddedUrl } from '../src/embeddedPostgres.js';
import { startDemoDatabase, type DemoDatabase } from './support/database.js';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
let db: DemoDatabase;
let dir: string;

before(async () => {
  db = await startDemoDatabase();
  dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-tools-'));
});
after(async () => {
  await db?.sql.end();
  await db?.engine.close();
  await db?.cluster.stop();
  if (dir) await rm(dir, { recursive: true, force: true });
});

function npm(args: string[], env: Record<string, string | undefined>, input?: string) {
  const childEnv = { ...process.env, ...env };
  for (const [key, value] of Object.entries(env)) if (value === undefined) delete childEnv[key];
  return spawnSync('npm', ['run', '-s', ...args], { cwd: ROOT, env: childEnv, encoding: 'utf8', input, timeout: 60_000 });
}

describe('npm run db-url', () => {
  it('prints DATABASE_URL when set, else the embedded server\'s URL on ASYNCPROC_EMBEDDED_PORT', () => {
    const given = npm(['db-url'], { DATABASE_URL: db.url });
    assert.equal(given.status, 0, given.stderr);
    assert.equal(given.stdout.trim(), db.url);
    const embedded = npm(['db-url'], { DATABASE_URL: undefined, ASYNCPROC_EMBEDDED_PORT: '54555' });
    assert.equal(embedded.status, 0, embedded.stderr);
    assert.equal(embedded.stdout.trim(), embeddedUrl(54555));
  });
});

describe('npm run sql', () => {
  it('runs a SQL file on the database and prints what it returns', async () => {
    const file = path.join(dir, 'hello.sql');
    await writeFile(file, `select asyncproc.invoke('demo.add', '{"a": 20, "b": 22}') is not null as submitted;\nselect 6 * 7 as answer;\n`);
    const run = npm(['sql', '--', file], { DATABASE_URL: db.url });
    assert.equal(run.status, 0, run.stderr);
    assert.match(run.stdout, /submitted[\s\S]*\bt(rue)?\b/);
    assert.match(run.stdout, /answer[\s\S]*\b42\b/);
    const { rows } = await db.sql.query(`select count(*)::int as n from asyncproc.executions where procedure = 'demo.add'`);
    assert.equal(rows[0].n, 1, 'the file ran, and committed');
  });

  it('reads SQL from standard input; a failing statement is one line with its line number and SQLSTATE, exit 1', () => {
    const run = npm(['sql'], { DATABASE_URL: db.url }, 'select 1;\nselect * from no_such_table;\n');
    assert.equal(run.status, 1);
    const lines = run.stderr.trim().split('\n');
    assert.equal(lines.length, 1, run.stderr);
    assert.match(lines[0], /no_such_table.*line 2.*SQLSTATE 42P01/);
  });
});

describe('npm run psql', () => {
  it("hands psql the password in its environment, not on its command line (which ps shows every local user)", async () => {
    const bin = path.join(dir, 'bin');
    const out = path.join(dir, 'psql-saw');
    await mkdir(bin, { recursive: true });
    await writeFile(path.join(bin, 'psql'), `#!/bin/sh\nprintf '%s\\n' "$*" > "${out}"\nprintf '%s\\n' "$PGPASSWORD" >> "${out}"\n`, { mode: 0o755 });
    const url = new URL(db.url);
    assert.ok(url.password, 'the test database has a password');
    const run = npm(['psql'], { DATABASE_URL: db.url, PATH: `${bin}:${process.env.PATH}` });
    assert.equal(run.status, 0, run.stderr);
    const [argv, password] = (await readFile(out, 'utf8')).split('\n');
    assert.ok(!argv.includes(url.password), `psql's command line: ${argv}`);
    assert.match(argv, new RegExp(`${url.hostname}:${url.port}`));
    assert.equal(password, decodeURIComponent(url.password));
  });
});

describe('print-schema', () => {
  it('refuses --write with --check (it would write, and pass)', () => {
    const run = spawnSync(process.execPath, ['--import', 'tsx', 'src/cli.ts', 'print-schema', '--write', '--check'], { cwd: ROOT, encoding: 'utf8', timeout: 60_000 });
    assert.equal(run.status, 1);
    assert.match(run.stderr, /--write or --check, not both/);
  });
});
