import { createHash } from 'node:crypto';
import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import type pg from 'pg';
import type { SchemaVersion } from '../../engine.js';
import { highestMigration, refuseOlderRevision, routinesRevision } from '../migrationFiles.js';

export const POSTGRES_SQL_DIR = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../../sql/postgres');

/** Serialises migrations (and demo installs) across processes starting at once. */
const MIGRATION_LOCK = 0x41535959;

/**
 * PostgreSQL grants EXECUTE on every new function to PUBLIC, and a per-schema ALTER DEFAULT
 * PRIVILEGES cannot take that back; so whatever creates routines revokes it in the same
 * transaction: callers get in only through what 0005_permissions.sql describes.
 */
const CLOSE_ROUTINES = 'revoke execute on all routines in schema asyncproc from public';

async function withMigrationLock<T>(pool: pg.Pool, fn: (client: pg.PoolClient) => Promise<T>): Promise<T> {
  const client = await pool.connect();
  try {
    await client.query('select pg_advisory_lock($1)', [MIGRATION_LOCK]);
    try {
      return await fn(client);
    } finally {
      await client.query('select pg_advisory_unlock($1)', [MIGRATION_LOCK]);
    }
  } finally {
    client.release();
  }
}

/** `fn` in one transaction on `client`: committed when it resolves, rolled back when it throws. */
async function inTransaction<T>(client: pg.PoolClient, fn: () => Promise<T>): Promise<T> {
  await client.query('begin');
  try {
    const result = await fn();
    await client.query('commit');
    return result;
  } catch (error) {
    await client.query('rollback');
    throw error;
  }
}

/**
 * Apply sql/postgres/NNNN_*.sql in order, each once, recorded in asyncproc.migrations;
 * then every routine of sql/postgres/routines/ whose content changed. All of it in ONE
 * transaction: a migration that moves work from the schema to the routines (0011 drops the
 * stamp trigger that the new routines replace by stamping themselves) must never commit
 * without them, or a worker running in between would write a change the feed cannot see.
 * Workers block on the tables' locks meanwhile and carry on with the new definitions.
 * Returns the versions applied now.
 */
export async function migrate(pool: pg.Pool, dir: string = POSTGRES_SQL_DIR): Promise<number[]> {
  return withMigrationLock(pool, (client) =>
    inTransaction(client, async () => {
      const applied = await applyVersions(client, dir);
      await applyChangedRoutines(client, path.join(dir, 'routines'));
      return applied;
    }),
  );
}

/**
 * Functions and views live one to a file (`CREATE OR REPLACE`), so the definition that
 * counts is always in one place. A file is applied when its SHA-256 differs from the one
 * recorded in asyncproc.routines; all changed files go in one transaction, in name order,
 * with function bodies checked at call time (a routine may call one later in the order).
 * A file that changes a routine's signature drops the old one first.
 */
export function applyRoutines(pool: pg.Pool, dir: string): Promise<string[]> {
  return withMigrationLock(pool, (client) => inTransaction(client, () => applyChangedRoutines(client, dir)));
}

/**
 * The changed routine files, inside the caller's transaction; never over the routines of a
 * newer release (asyncproc.routines_revision, 0016_routines_revision.sql): a downgrade is
 * refused, and the database's routines stay as the newer release left them.
 */
async function applyChangedRoutines(client: pg.PoolClient, dir: string): Promise<string[]> {
  const files = (await readdir(dir)).filter((f) => f.endsWith('.sql')).sort();
  const texts = await Promise.all(files.map((f) => readFile(path.join(dir, f), 'utf8')));
  const revision = await routinesRevision(dir);
  await client.query(`create table if not exists asyncproc.routines (
      name text primary key, sha256 text not null, applied_at timestamptz not null default now())`);
  const installed = (await client.query<{ revision: number }>('select revision from asyncproc.routines_revision')).rows[0]?.revision;
  refuseOlderRevision('routines', installed, revision);
  // what the guard on asyncproc.routines lets through: this revision, for this transaction
  await client.query(`select set_config('asyncproc.routines_revision', $1, true)`, [String(revision)]);
  await client.query(
    `insert into asyncproc.routines_revision as r (revision) values ($1)
     on conflict (only_row) do update set revision = greatest(r.revision, excluded.revision)`,
    [revision],
  );
  const known = new Map(
    (await client.query<{ name: string; sha256: string }>('select name, sha256 from asyncproc.routines')).rows.map((r) => [r.name, r.sha256]),
  );
  const changed = files
    .map((file, i) => ({ file, text: texts[i], sha256: createHash('sha256').update(texts[i]).digest('hex') }))
    .filter((r) => known.get(r.file) !== r.sha256);
  if (!changed.length) return [];
  await client.query('set local check_function_bodies = off');
  for (const routine of changed) {
    try {
      await client.query(routine.text);
    } catch (error) {
      throw new Error(`routine ${routine.file} failed: ${(error as Error).message}`, { cause: error });
    }
    await client.query(
      `insert into asyncproc.routines (name, sha256) values ($1, $2)
       on conflict (name) do update set sha256 = excluded.sha256, applied_at = now()`,
      [routine.file, routine.sha256],
    );
  }
  await client.query(CLOSE_ROUTINES);
  return changed.map((r) => r.file);
}

/** The pending numbered migrations, inside the caller's transaction. */
async function applyVersions(client: pg.PoolClient, dir: string): Promise<number[]> {
  const files = (await readdir(dir)).filter((f) => /^\d{4}_.+\.sql$/.test(f)).sort();
  await client.query(`create schema if not exists asyncproc;
    create table if not exists asyncproc.migrations (
      version integer primary key, name text not null, applied_at timestamptz not null default now())`);
  const done = new Set((await client.query<{ version: number }>('select version from asyncproc.migrations')).rows.map((r) => r.version));
  const applied: number[] = [];
  for (const file of files) {
    const version = Number(file.slice(0, 4));
    if (done.has(version)) continue;
    const text = await readFile(path.join(dir, file), 'utf8');
    try {
      await client.query(text);
      await client.query('insert into asyncproc.migrations (version, name) values ($1, $2)', [version, file]);
      await client.query(CLOSE_ROUTINES);
    } catch (error) {
      throw new Error(`migration ${file} failed: ${(error as Error).message}`, { cause: error });
    }
    applied.push(version);
  }
  return applied;
}

/** Install (or refresh) the demo procedures and register them. */
export async function installDemo(pool: pg.Pool, dir: string = POSTGRES_SQL_DIR): Promise<void> {
  const text = await readFile(path.join(dir, 'demo.sql'), 'utf8');
  await withMigrationLock(pool, (client) => inTransaction(client, () => client.query(text)));
}

/**
 * The tables every call goes through: readiness names their absence as a schema not there (a
 * table renamed or dropped by hand, a half-restored database), though asyncproc.migrations says
 * all is applied. Read with `where false`: no row, no lock beyond what any reader takes.
 */
const CORE_TABLES = ['executions', 'ready', 'queues', 'procedures'];

/**
 * The highest migration recorded in asyncproc.migrations (null: no such table, or a core table
 * missing) and the highest of the files in `dir`.
 */
export async function schemaVersion(pool: pg.Pool, dir: string = POSTGRES_SQL_DIR): Promise<SchemaVersion> {
  const expected = highestMigration(dir);
  try {
    const { rows } = await pool.query<{ version: number | null }>(
      `select max(version) as version from asyncproc.migrations
        where not exists (select from ${CORE_TABLES.map((t) => `asyncproc.${t}`).join(', ')} where false)`,
    );
    return { applied: rows[0]?.version ?? null, expected: await expected };
  } catch (error) {
    // undefined_table, invalid_schema_name: reachable, but the schema is not there
    if (['42P01', '3F000'].includes((error as { code?: string }).code ?? '')) return { applied: null, expected: await expected };
    throw error;
  }
}
