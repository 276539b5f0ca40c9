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
import { readFile } from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { migrate, POSTGRES_SQL_DIR } from '../src/engines/postgres/migrator.js';
import { startTestCluster, type TestCluster } from './support/database.js';

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
