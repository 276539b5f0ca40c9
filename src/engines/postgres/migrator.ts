import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import type pg from 'pg';

export const POSTGRES_SQL_DIR = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../../sql/postgres');

/** Serialises migrations (and demo installs) across processes starting at once. */
const MIGRATION_LOCK = 0x41535959;

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

/**
 * Apply sql/postgres/NNNN_*.sql in order, each once, each in its own transaction,
 * recorded in asyncproc.migrations. Returns the versions applied now.
 */
export async function migrate(pool: pg.Pool, dir: string = POSTGRES_SQL_DIR): Promise<number[]> {
  const files = (await readdir(dir)).filter((f) => /^\d{4}_.+\.sql$/.test(f)).sort();
  return withMigrationLock(pool, async (client) => {
    await client.query(`create schema if not exists asyncproc;
      create table if not exists asyncproc.migrations (
        version integer primary key, name text not null, applied_at timestamptz not null default now())`);
    const done = new Set((await client.query<{ version: number }>('select version from asyncproc.migrations')).rows.map((r) => r.version));
    const applied: number[] = [];
    for (const file of files) {
      const version = Number(file.slice(0, 4));
      if (done.has(version)) continue;
      const text = await readFile(path.join(dir, file), 'utf8');
      await client.query('begin');
      try {
        await client.query(text);
        await client.query('insert into asyncproc.migrations (version, name) values ($1, $2)', [version, file]);
        await client.query('commit');
      } catch (error) {
        await client.query('rollback');
        throw new Error(`migration ${file} failed: ${(error as Error).message}`, { cause: error });
      }
      applied.push(version);
    }
    return applied;
  });
}

/** Install (or refresh) the demo procedures and register them. */
export async function installDemo(pool: pg.Pool, dir: string = POSTGRES_SQL_DIR): Promise<void> {
  const text = await readFile(path.join(dir, 'demo.sql'), 'utf8');
  await withMigrationLock(pool, async (client) => {
    await client.query('begin');
    try {
      await client.query(text);
      await client.query('commit');
    } catch (error) {
      await client.query('rollback');
      throw error;
    }
  });
}
