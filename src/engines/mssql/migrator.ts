import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import sql from 'mssql';
import { splitBatches } from './batches.js';

export const MSSQL_SQL_DIR = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../../sql/mssql');

/** Serialises migrations and demo installs across processes starting at once. */
const LOCK = 'asyncexec/migrate';

/**
 * Run `fn` on a connection of its own holding the migration lock. The connection is
 * closed afterwards, so the SET options used here never leak into the query pool.
 */
async function withMigrationLock<T>(config: sql.config, fn: (pool: sql.ConnectionPool) => Promise<T>): Promise<T> {
  // DDL of a big script may take a while; a lock wait of two minutes is the lock's own limit
  const pool = new sql.ConnectionPool({ ...config, requestTimeout: 0, pool: { min: 0, max: 1 } });
  await pool.connect();
  try {
    await pool.request().batch(`SET XACT_ABORT ON;
      DECLARE @r int;
      EXEC @r = sys.sp_getapplock @Resource = N'${LOCK}', @LockMode = 'Exclusive', @LockOwner = 'Session', @LockTimeout = 120000;
      IF @r < 0 THROW 50020, N'could not take the asyncexec migration lock within two minutes', 1;`);
    try {
      return await fn(pool);
    } finally {
      await pool
        .request()
        .batch(`EXEC sys.sp_releaseapplock @Resource = N'${LOCK}', @LockOwner = 'Session';`)
        .catch(() => undefined); // closing the connection releases it anyway
    }
  } finally {
    await pool.close();
  }
}

/** Run a script's batches in one transaction; the error names the file and line. */
async function runScript(pool: sql.ConnectionPool, file: string, text: string, after?: (tx: sql.Transaction) => Promise<void>): Promise<void> {
  const tx = new sql.Transaction(pool);
  await tx.begin();
  try {
    for (const batch of splitBatches(text)) {
      for (let i = 0; i < batch.repeat; i++) {
        try {
          await new sql.Request(tx).batch(batch.text);
        } catch (error) {
          throw new Error(`${file}, batch at line ${batch.line}: ${(error as Error).message}`, { cause: error });
        }
      }
    }
    await after?.(tx);
    await tx.commit();
  } catch (error) {
    // XACT_ABORT may already have rolled the transaction back
    await tx.rollback().catch(() => undefined);
    throw error;
  }
}

/**
 * Apply sql/mssql/NNNN_*.sql in order, each once and in its own transaction, recorded
 * in asyncexec.AsyncExecSchemaVersions. Creates nothing outside the connected database.
 * Returns the versions applied now.
 */
export async function migrate(config: sql.config, dir: string = MSSQL_SQL_DIR): Promise<number[]> {
  const files = (await readdir(dir)).filter((f) => /^\d{4}_.+\.sql$/.test(f)).sort();
  return withMigrationLock(config, async (pool) => {
    await pool.request().batch(`
      IF SCHEMA_ID(N'asyncexec') IS NULL EXEC (N'CREATE SCHEMA asyncexec AUTHORIZATION dbo');
      IF OBJECT_ID(N'asyncexec.AsyncExecSchemaVersions', N'U') IS NULL
        CREATE TABLE asyncexec.AsyncExecSchemaVersions (
          version    int           NOT NULL CONSTRAINT PK_AsyncExecSchemaVersions PRIMARY KEY,
          name       nvarchar(260) NOT NULL,
          applied_at datetime2(3)  NOT NULL CONSTRAINT DF_AsyncExecSchemaVersions_applied DEFAULT (SYSUTCDATETIME()));`);
    const done = new Set(
      (await pool.request().query<{ version: number }>('SELECT version FROM asyncexec.AsyncExecSchemaVersions')).recordset.map((r) => r.version),
    );
    const applied: number[] = [];
    for (const file of files) {
      const version = Number(file.slice(0, 4));
      if (done.has(version)) continue;
      const text = await readFile(path.join(dir, file), 'utf8');
      await runScript(pool, file, text, async (tx) => {
        await new sql.Request(tx)
          .input('version', sql.Int, version)
          .input('name', sql.NVarChar(260), file)
          .query('INSERT asyncexec.AsyncExecSchemaVersions (version, name) VALUES (@version, @name)');
      });
      applied.push(version);
    }
    return applied;
  });
}

/** Install (or refresh) the demo procedures of sql/mssql/demo.sql and register them. */
export async function installDemo(config: sql.config, dir: string = MSSQL_SQL_DIR): Promise<void> {
  const text = await readFile(path.join(dir, 'demo.sql'), 'utf8');
  await withMigrationLock(config, (pool) => runScript(pool, 'demo.sql', text));
}
