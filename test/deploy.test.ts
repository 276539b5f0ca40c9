/**
 * Deployment facts users hit on PostgreSQL: a caller role with only USAGE + EXECUTE
 * (sql/postgres/0006_permissions.sql). Real roles, no mocks.
 */
import assert from 'node:assert/strict';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import type { Closeable } from '../src/engine.js';
import type { PostgresEngine } from '../src/engines/postgres/index.js';
import { applyRoutines } from '../src/engines/postgres/migrator.js';
import { startDemoDatabase, waitFor, type TestCluster } from './support/database.js';

const withUser = (url: string, user: string, password: string) => {
  const u = new URL(url);
  u.username = user;
  u.password = password;
  return u.toString();
};

describe('a caller with only USAGE on the schema and EXECUTE on invoke (0006_permissions.sql)', () => {
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
      `select p.oid::regprocedure::text as routine, p.prokind, p.prosecdef, p.proconfig,
              has_function_privilege('app_caller', p.oid, 'execute') as allowed,
              (select string_agg(format('null::%s', format_type(t, null)), ', ' order by i)
                 from unnest(p.proargtypes::oid[]) with ordinality a (t, i)) as nulls
         from pg_proc p where p.pronamespace = 'asyncproc'::regnamespace order by 1`,
    );
    const allowed = rows.filter((r) => r.allowed);
    assert.deepEqual(allowed.map((r) => r.routine.replace(/\(.*/, '')).sort(), ['asyncproc.invoke', 'asyncproc.invoke_batch']);
    for (const r of allowed) {
      assert.equal(r.prosecdef, true, `${r.routine} is SECURITY DEFINER`);
      assert.deepEqual(r.proconfig, ['search_path=pg_catalog, asyncproc, pg_temp'], r.routine);
    }
    const internal = rows.filter((r) => !r.allowed && r.prokind !== 'a');
    for (const name of ['claim', 'run', 'finish', 'register', 'configure_queue', 'submit', 'submit_batch', 'cancel', 'recover']) {
      assert.ok(internal.some((r) => r.routine.startsWith(`asyncproc.${name}(`)), `asyncproc.${name} exists and is closed`);
    }
    // refused before any argument is looked at: typed nulls fit every signature
    for (const r of internal) {
      const name = r.routine.replace(/\(.*/, '');
      const statement = r.prokind === 'p' ? `call ${name}(${r.nulls ?? ''})` : `select ${name}(${r.nulls ?? ''})`;
      await assert.rejects(caller.query(statement), (e: any) => e.code === '42501' && /permission denied for (function|procedure)/.test(e.message), statement);
    }
  });

  it('cannot execute a routine a later release adds (the migrator closes each one it creates)', async () => {
    const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-routines-'));
    try {
      await writeFile(path.join(dir, 'zz_added_later.sql'), `create or replace function asyncproc.added_later() returns int language sql as 'select 1';`);
      await applyRoutines(engine.pool, dir);
      const { rows } = await sql.query(`select has_function_privilege('app_caller', 'asyncproc.added_later()', 'execute') as allowed`);
      assert.equal(rows[0].allowed, false);
    } finally {
      await sql.query('drop function if exists asyncproc.added_later()');
      await rm(dir, { recursive: true, force: true });
    }
  });
});
