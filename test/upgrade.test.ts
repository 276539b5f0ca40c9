/**
 * An upgraded database has exactly the objects of a fresh one (PostgreSQL).
 *
 * Database A is built as the first releases built it: the migrator of that time applied
 * sql/postgres/0001_core.sql and 0002_batches.sql (all there was before routines/ existed),
 * each in its own transaction, recorded in asyncproc.migrations, and nothing else. Then the
 * current migrator upgrades it. Database B is migrated fresh by the current migrator. The
 * catalogs of schema asyncproc must then be equal: every routine (its whole definition, ACL,
 * SECURITY DEFINER, SET options), every table's columns, constraints, indexes and triggers,
 * views, sequences, types, and every grant. An old overload that an upgrade forgot to drop,
 * a grant only one path gives, a column default that differs: each shows up here.
 * The SQL Server counterpart is test/upgrade.mssql.ts (run when MSSQL_URL is set).
 */
import assert from 'node:assert/strict';
import { cp, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { isTerminal } from '../src/engine.js';
import { createPostgresEngine } from '../src/engines/postgres/index.js';
import { routinesRevision } from '../src/engines/migrationFiles.js';
import { applyRoutines, migrate, POSTGRES_SQL_DIR } from '../src/engines/postgres/migrator.js';
import { startTestCluster, waitFor, type TestCluster } from './support/database.js';

/** The landed scripts the first migrator applied (pinned by test/migrations.test.ts). */
const OLD_SCRIPTS = ['0001_core.sql', '0002_batches.sql'];

/** Named catalog queries on schema asyncproc; each returns rows with a stable order. */
const CATALOG: Record<string, string> = {
  routines: `
    select p.oid::regprocedure::text as signature, p.prokind,
           case when p.prokind in ('f', 'p', 'w') then pg_get_functiondef(p.oid) end as definition,
           p.proacl::text as acl, p.prosecdef, p.proconfig::text as config, p.proowner::regrole::text as owner
      from pg_proc p join pg_namespace n on n.oid = p.pronamespace
     where n.nspname = 'asyncproc'
     order by 1`,
  relations: `
    select c.relname, c.relkind, c.relacl::text as acl, c.relowner::regrole::text as owner, c.relpersistence,
           c.reloptions::text as options
      from pg_class c join pg_namespace n on n.oid = c.relnamespace
     where n.nspname = 'asyncproc'
     order by 1`,
  columns: `
    select c.relname, row_number() over (partition by c.oid order by a.attnum) as position, a.attname,
           format_type(a.atttypid, a.atttypmod) as type, a.attnotnull, pg_get_expr(d.adbin, d.adrelid) as "default",
           a.attidentity, a.attgenerated, a.attacl::text as acl, a.attcollation::regcollation::text as collation
      from pg_attribute a
      join pg_class c on c.oid = a.attrelid
      join pg_namespace n on n.oid = c.relnamespace
      left join pg_attrdef d on d.adrelid = a.attrelid and d.adnum = a.attnum
     where n.nspname = 'asyncproc' and a.attnum > 0 and not a.attisdropped and c.relkind in ('r', 'p', 'v', 'm', 'f')
     order by c.relname, position`,
  constraints: `
    select c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid) as definition, k.condeferrable, k.condeferred
      from pg_constraint k
      join pg_class c on c.oid = k.conrelid
      join pg_namespace n on n.oid = c.relnamespace
     where n.nspname = 'asyncproc'
     order by 1, 2`,
  indexes: `
    select tablename, indexname, indexdef from pg_indexes where schemaname = 'asyncproc' order by 1, 2`,
  triggers: `
    select c.relname, t.tgname, pg_get_triggerdef(t.oid) as definition, t.tgenabled
      from pg_trigger t
      join pg_class c on c.oid = t.tgrelid
      join pg_namespace n on n.oid = c.relnamespace
     where n.nspname = 'asyncproc' and not t.tgisinternal
     order by 1, 2`,
  views: `
    select c.relname, pg_get_viewdef(c.oid) as definition
      from pg_class c join pg_namespace n on n.oid = c.relnamespace
     where n.nspname = 'asyncproc' and c.relkind in ('v', 'm')
     order by 1`,
  sequences: `
    select sequencename, data_type::text, start_value::text, increment_by::text, cycle
      from pg_sequences where schemaname = 'asyncproc' order by 1`,
  types: `
    select t.typname, t.typtype, format_type(t.oid, null) as name,
           (select string_agg(e.enumlabel, ',' order by e.enumsortorder) from pg_enum e where e.enumtypid = t.oid) as labels,
           (select string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod), ', ' order by a.attnum)
              from pg_attribute a where a.attrelid = t.typrelid and a.attnum > 0 and not a.attisdropped) as fields
      from pg_type t join pg_namespace n on n.oid = t.typnamespace
     where n.nspname = 'asyncproc' and t.typtype in ('e', 'c', 'd') and t.typname not like '\\_%'
       and (t.typrelid = 0 or (select relkind from pg_class where oid = t.typrelid) = 'c')
     order by 1`,
  schema: `
    select n.nspname, n.nspacl::text as acl, n.nspowner::regrole::text as owner
      from pg_namespace n where n.nspname = 'asyncproc'`,
  defaultPrivileges: `
    select d.defaclrole::regrole::text as role, d.defaclobjtype, d.defaclacl::text as acl
      from pg_default_acl d join pg_namespace n on n.oid = d.defaclnamespace
     where n.nspname = 'asyncproc'
     order by 1, 2`,
  migrations: `select version, name from asyncproc.migrations order by version`,
  routineFiles: `select name, sha256 from asyncproc.routines order by name`,
};

async function catalog(url: string): Promise<Record<string, unknown[]>> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    const result: Record<string, unknown[]> = {};
    for (const [name, query] of Object.entries(CATALOG)) result[name] = (await client.query(query)).rows;
    return result;
  } finally {
    await client.end();
  }
}

/** What the migrator of the first releases did, with the scripts it had. */
async function migrateAsTheFirstReleases(url: string): Promise<void> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    await client.query(`create schema if not exists asyncproc;
      create table if not exists asyncproc.migrations (
        version integer primary key, name text not null, applied_at timestamptz not null default now())`);
    for (const file of OLD_SCRIPTS) {
      const text = await readFile(path.join(POSTGRES_SQL_DIR, file), 'utf8');
      await client.query('begin');
      await client.query(text);
      await client.query('insert into asyncproc.migrations (version, name) values ($1, $2)', [Number(file.slice(0, 4)), file]);
      await client.query('commit');
    }
  } finally {
    await client.end();
  }
}

/** A copy of sql/postgres with `routines` as its routines folder. */
async function sqlDirWith(routines: string): Promise<string> {
  const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-sql-'));
  await cp(POSTGRES_SQL_DIR, dir, { recursive: true });
  await rm(path.join(dir, 'routines'), { recursive: true, force: true });
  await cp(routines, path.join(dir, 'routines'), { recursive: true });
  return dir;
}

async function migrateNow(url: string): Promise<number[]> {
  const pool = new pg.Pool({ connectionString: url, max: 2 });
  try {
    return await migrate(pool);
  } finally {
    await pool.end();
  }
}

let cluster: TestCluster;
before(async () => {
  cluster = await startTestCluster();
});
after(async () => {
  await cluster?.stop();
});

describe('upgrade (PostgreSQL)', () => {
  it('gives a database built by the first releases exactly the objects of a fresh one', async () => {
    const upgraded = await cluster.createDatabase();
    await migrateAsTheFirstReleases(upgraded);
    const old = new pg.Client({ connectionString: upgraded });
    await old.connect();
    const { rows } = await old.query(`select count(*)::int as n from pg_proc p join pg_namespace n on n.oid = p.pronamespace where n.nspname = 'asyncproc'`);
    await old.end();
    assert.ok(rows[0].n > 0, 'the old scripts created routines');
    const applied = await migrateNow(upgraded);
    assert.ok(applied.length > 0 && !applied.includes(1) && !applied.includes(2), `applied ${applied.join(', ')} on top of 0001-0002`);

    const fresh = await cluster.createDatabase();
    await migrateNow(fresh);

    const [a, b] = await Promise.all([catalog(upgraded), catalog(fresh)]);
    assert.ok(b.routines.length >= 30 && b.columns.length > 0 && b.indexes.length > 0, 'the comparison sees the objects');
    for (const part of Object.keys(CATALOG)) {
      assert.deepEqual(a[part], b[part], `${part}: upgraded (left) and fresh (right) differ`);
    }
  });
});

describe('upgrade (PostgreSQL): the values of calls and schedules stored before it', () => {
  it('json domains and json arrays of calls still to run and of schedules run with the values revision 4 of the routines gave them (0017)', async () => {
    const url = await cluster.createDatabase();
    // the database as the release before 0017 left it
    const before0017 = await mkdtemp(path.join(tmpdir(), 'asyncproc-sql-'));
    await cp(POSTGRES_SQL_DIR, before0017, { recursive: true });
    await rm(path.join(before0017, '0017_json_arguments_as_sent.sql'));
    const engine = createPostgresEngine({ connectionString: url });
    const sql = new pg.Client({ connectionString: url });
    await sql.connect();
    let activator: { close(): Promise<void> } | undefined;
    try {
      await migrate(engine.pool, before0017);
      await sql.query(`create schema up4;
        create domain up4.anyjson as jsonb;
        create domain up4.object as jsonb check (jsonb_typeof(value) = 'object');
        create function up4.echo(d up4.anyjson, o up4.object, a jsonb[], n integer default 0) returns jsonb language sql
          as $$ select jsonb_build_object('d', d, 'o', o, 'a', to_jsonb(a), 'n', n) $$;
        select asyncproc.register('up4.echo(up4.anyjson,up4.object,jsonb[],integer)');`);
      const valid = { d: 0, o: {}, a: [] };
      // what revision 4 took: JSON text in a string for a domain over jsonb (an object only so), and array elements read as JSON text
      const asRevision4Took = { d: '1', o: '{"a": 1}', a: [1, '2', '"x"', null, true], n: 5 };
      const asRevision4Ran = { d: 1, o: { a: 1 }, a: [1, 2, 'x', null, true], n: 5 };
      const [waiting, ended] = await engine.submit([{ procedure: 'up4.echo', arguments: valid }, { procedure: 'up4.echo', arguments: valid }]);
      await engine.cancelExecution(ended.token);
      await engine.createSchedule({ name: 'up4-echo', procedure: 'up4.echo', arguments: valid, cron: '0 0 1 1 *' });
      await sql.query('update asyncproc.executions set arguments = $1 where token in ($2, $3)', [asRevision4Took, waiting.token, ended.token]);
      await sql.query(`update asyncproc.schedules set arguments = $1 where name = 'up4-echo'`, [asRevision4Took]);

      assert.deepEqual(await migrate(engine.pool), [17]);
      const argumentsOf = async (token: string) => (await sql.query('select arguments from asyncproc.executions where token = $1', [token])).rows[0].arguments;
      assert.deepEqual(await argumentsOf(waiting.token), asRevision4Ran, 'the call still to run');
      assert.deepEqual(await argumentsOf(ended.token), asRevision4Took, 'an ended call keeps what it was sent');
      assert.deepEqual((await engine.getSchedule('up4-echo'))!.arguments, asRevision4Ran, 'the schedule');

      activator = await engine.startActivator({ workerId: 'upgrade-0017' });
      const ran = await waitFor(async () => {
        const execution = await engine.getExecution(waiting.token);
        return execution && isTerminal(execution.status) ? execution : null;
      }, 15_000, 'the call to end');
      assert.equal(ran.status, 'SUCCEEDED', JSON.stringify(ran.error));
      assert.deepEqual(ran.result?.returnValue, asRevision4Ran);
    } finally {
      await activator?.close();
      await sql.end();
      await engine.close();
      await rm(before0017, { recursive: true, force: true });
    }
  });
});

describe('a rolling upgrade (PostgreSQL): processes of two releases share the database for a while', () => {
  it('applying the routine files again keeps every function (its OID): a call running in run() meanwhile ends SUCCEEDED', async () => {
    const url = await cluster.createDatabase();
    const engine = createPostgresEngine({ connectionString: url });
    const sql = new pg.Client({ connectionString: url });
    await sql.connect();
    try {
      await engine.migrate();
      await engine.installDemo();
      const oids = async () =>
        (await sql.query(`select p.oid::regprocedure::text as signature, p.oid::int as oid from pg_proc p join pg_namespace n on n.oid = p.pronamespace
                            where n.nspname = 'asyncproc' order by 1`)).rows;
      const before = await oids();
      const activator = await engine.startActivator({ workerId: 'upgrade' });
      try {
        const [call] = await engine.submit([{ procedure: 'demo.sleep', arguments: { seconds: 1.5 } }]);
        await waitFor(async () => (await engine.getExecution(call.token))?.status === 'RUNNING', 10_000, 'the call to run');
        // another release's migrator finds every file changed (its own files)
        await sql.query(`begin; select set_config('asyncproc.routines_revision', '1000', true); update asyncproc.routines set sha256 = 'another release'; commit`);
        assert.ok((await applyRoutines(engine.pool, path.join(POSTGRES_SQL_DIR, 'routines'))).length >= 40);
        const ended = await waitFor(async () => {
          const e = await engine.getExecution(call.token);
          return e && isTerminal(e.status) ? e : null;
        }, 10_000, 'the call to end');
        assert.equal(ended.status, 'SUCCEEDED', JSON.stringify(ended.error));
        assert.equal(ended.attempts, 1);
      } finally {
        await activator.close();
      }
      assert.deepEqual(await oids(), before, 'no function was dropped and made again');
    } finally {
      await sql.end();
      await engine.close();
    }
  });

  it('a process of an older release started after the upgrade refuses to start, and replaces no routine', async () => {
    const url = await cluster.createDatabase();
    await migrateNow(url);
    const sql = new pg.Client({ connectionString: url });
    await sql.connect();
    const definition = async () => (await sql.query(`select pg_get_functiondef('asyncproc.pass_cancel_gate(bigint)'::regprocedure) as d`)).rows[0].d;
    const before = await definition();
    const older = await mkdtemp(path.join(tmpdir(), 'asyncproc-older-'));
    try {
      // the previous release's migrator: no revision said, its older file applied and recorded
      await sql.query('begin');
      await sql.query(`create or replace function asyncproc.pass_cancel_gate(execution_id bigint) returns boolean language sql as 'select true'`);
      await assert.rejects(
        sql.query(`insert into asyncproc.routines (name, sha256) values ('lock_key.sql', 'older') on conflict (name) do update set sha256 = excluded.sha256`),
        (e: any) => e.code === 'AP020' && /newer asyncproc/.test(e.message),
      );
      await sql.query('rollback');
      assert.equal(await definition(), before, 'the newer definition stays');
      // one that knows revisions, older than the database's (a newer release installed revision + 1): refused before anything is applied
      await cp(path.join(POSTGRES_SQL_DIR, 'routines'), older, { recursive: true });
      const revision = await routinesRevision(older);
      await sql.query(`update asyncproc.routines_revision set revision = $1`, [revision + 1]);
      await writeFile(path.join(older, 'lock_key.sql'), `${await readFile(path.join(older, 'lock_key.sql'), 'utf8')}\n-- older\n`);
      const pool = new pg.Pool({ connectionString: url, max: 1 });
      const sqlDir = await sqlDirWith(older);
      try {
        await assert.rejects(migrate(pool, sqlDir), /revision \d+, installed by a newer asyncproc.*downgrade is not supported/);
      } finally {
        await pool.end();
        await rm(sqlDir, { recursive: true, force: true });
      }
      assert.equal(await definition(), before);
      assert.equal((await sql.query(`select sha256 from asyncproc.routines where name = 'lock_key.sql'`)).rows[0].sha256.length, 64, 'nothing recorded');
    } finally {
      await sql.end();
      await rm(older, { recursive: true, force: true });
    }
  });
});
