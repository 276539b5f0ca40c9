import { createHash } from 'node:crypto';
import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import sql from 'mssql';
import { splitBatches } from './batches.js';
import { refuseOlderRevision, routinesRevision } from '../migrationFiles.js';

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

export interface MigrateResult {
  /** Numbered migrations applied now. */
  versions: number[];
  /** Files of sql/mssql/procedures/ applied now (each ALTERed or created its object). */
  procedures: string[];
}

/**
 * Apply sql/mssql/NNNN_*.sql in order, each once and in its own transaction, recorded
 * in asyncexec.AsyncExecSchemaVersions; then every file of sql/mssql/procedures/ whose
 * content changed (see applyChangedProcedures). Both under one migration lock. Creates
 * nothing outside the connected database.
 */
export async function migrate(config: sql.config, dir: string = MSSQL_SQL_DIR): Promise<MigrateResult> {
  return withMigrationLock(config, async (pool) => {
    const versions = await applyVersions(pool, dir);
    const procedures = await applyChangedProcedures(pool, path.join(dir, 'procedures'));
    return { versions, procedures };
  });
}

/** The schema and the table of applied versions, made when missing (also how migrators before 0010 began). */
export const VERSIONS_TABLE = `
    IF SCHEMA_ID(N'asyncexec') IS NULL EXEC (N'CREATE SCHEMA asyncexec AUTHORIZATION dbo');
    IF OBJECT_ID(N'asyncexec.AsyncExecSchemaVersions', N'U') IS NULL
      CREATE TABLE asyncexec.AsyncExecSchemaVersions (
        version    int           NOT NULL CONSTRAINT PK_AsyncExecSchemaVersions PRIMARY KEY,
        name       nvarchar(260) NOT NULL,
        applied_at datetime2(3)  NOT NULL CONSTRAINT DF_AsyncExecSchemaVersions_applied DEFAULT (SYSUTCDATETIME()));`;

async function applyVersions(pool: sql.ConnectionPool, dir: string): Promise<number[]> {
  const files = (await readdir(dir)).filter((f) => /^\d{4}_.+\.sql$/.test(f)).sort();
  await pool.request().batch(VERSIONS_TABLE);
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
}

/** A file of sql/mssql/procedures/ as the migrator sends it. */
export interface ProcedureFile {
  file: string;
  /** The one batch of the file: the text SQL Server stores as the module's definition. */
  text: string;
  /** SHA-256 (hex) of the whole file. */
  sha256: string;
}

/**
 * The files of `dir` in the order its ORDER file declares (one file name a line; blank
 * lines and `#` comments ignored). Refuses a directory whose ORDER and .sql files disagree,
 * and a file that is not exactly one batch (a `GO` inside would cut the definition short,
 * and what followed would run as a separate statement).
 */
export async function readProcedureFiles(dir: string): Promise<ProcedureFile[]> {
  const order = (await readFile(path.join(dir, 'ORDER'), 'utf8'))
    .split(/\r?\n/)
    .map((line) => line.trim())
    .filter((line) => line !== '' && !line.startsWith('#'));
  const present = (await readdir(dir)).filter((f) => f.endsWith('.sql')).sort();
  const listed = [...order].sort();
  if (new Set(order).size !== order.length || listed.join('\n') !== present.join('\n')) {
    const missing = present.filter((f) => !order.includes(f));
    const extra = order.filter((f) => !present.includes(f));
    throw new Error(`${path.join(dir, 'ORDER')} must list every .sql file of its folder once (not listed: ${missing.join(', ') || 'none'}; listed but absent or repeated: ${extra.join(', ') || 'repeats'})`);
  }
  return Promise.all(
    order.map(async (file) => {
      const raw = await readFile(path.join(dir, file), 'utf8');
      const batches = splitBatches(raw);
      if (batches.length !== 1 || batches[0].repeat !== 1) throw new Error(`${file} must hold exactly one batch (no GO), not ${batches.length}`);
      return { file, text: batches[0].text, sha256: createHash('sha256').update(raw).digest('hex') };
    }),
  );
}

/**
 * Procedures, functions and views live one to a file (`CREATE OR ALTER`), so the definition
 * that counts is always in one place. A file is applied when its SHA-256 differs from the one
 * recorded in asyncexec.AsyncExecRoutines (0010_routines.sql); all changed files go in ONE
 * transaction, in the order of procedures/ORDER, so an upgrade never leaves half of them new.
 * Rules relied on (SQL Server docs):
 *  - "Rules for Using Batches" / CREATE PROCEDURE: CREATE PROCEDURE, FUNCTION and VIEW must
 *    start their batch, and everything after them in the batch is part of the definition;
 *    so each file is sent as one batch of its own (comments may precede the CREATE, and are
 *    stored with the definition). DDL like this may run inside a user transaction.
 *  - CREATE OR ALTER (SQL Server 2016 SP1, KB3190548): creates the object if it is missing,
 *    else alters it, so a file applies alike to a fresh database and to an upgraded one.
 *  - ALTER PROCEDURE (Transact-SQL): an alter "does not change permissions and does not affect
 *    any dependent stored procedures"; the object keeps its object_id, so a queue's ACTIVATION
 *    (PROCEDURE_NAME = …), which names the procedure, keeps calling it: our queues activate
 *    the per-queue wrappers usp_AsyncExecActivated_<queue> (made by usp_AsyncExecCreateQueue,
 *    never in these files), which EXEC usp_AsyncExecActivated by name at each activation.
 *    Nothing forbids an ALTER while the queue is active: it takes a schema-modification lock
 *    on the object until this transaction commits, so a reader that reaches the object
 *    meanwhile waits for the commit. ALTER QUEUE documents that a change of PROCEDURE_NAME
 *    "does not affect instances of the activation stored procedure that are currently
 *    running"; for a new definition under the same name the docs say nothing, and what is
 *    observed is the same: a module already executing finishes the text it started with,
 *    while every EXEC it makes after the commit runs the callee's new version. So a running
 *    reader may mix versions for one loop (docs/mssql.md, "Upgrades": keep procedure
 *    interfaces compatible across one release, or turn activation off for the upgrade).
 *    An alter drops a module signature (ADD SIGNATURE): sign the applied ones again.
 *  - It also stores the session's ANSI_NULLS and QUOTED_IDENTIFIER with the module: both are
 *    ON on this connection (the driver's defaults), as when the migrations created them.
 *  - Deferred name resolution: a procedure may name a procedure or table that does not
 *    exist yet (only a warning); a view may not, so ORDER puts views after what they read.
 */
export async function applyProcedures(config: sql.config, dir: string = path.join(MSSQL_SQL_DIR, 'procedures')): Promise<string[]> {
  return withMigrationLock(config, (pool) => applyChangedProcedures(pool, dir));
}

/** The files whose SHA-256 differs from the one recorded (or that have none), in the files' order. */
export function changedProcedures(files: readonly ProcedureFile[], recorded: ReadonlyMap<string, string>): ProcedureFile[] {
  return files.filter((f) => recorded.get(f.file) !== f.sha256);
}

/**
 * The changed procedure files, in one transaction; never over the procedures of a newer
 * release (asyncexec.AsyncExecRoutinesRevision, 0016_routines_revision.sql): a downgrade is
 * refused, and the database's procedures stay as the newer release left them.
 */
async function applyChangedProcedures(pool: sql.ConnectionPool, dir: string): Promise<string[]> {
  const files = await readProcedureFiles(dir);
  const revision = await routinesRevision(dir);
  const installed = (await pool.request().query<{ revision: number }>('SELECT revision FROM asyncexec.AsyncExecRoutinesRevision WHERE only_row = 1'))
    .recordset[0]?.revision;
  refuseOlderRevision('procedures', installed, revision);
  const known = new Map(
    (await pool.request().query<{ name: string; sha256: string }>('SELECT name, sha256 FROM asyncexec.AsyncExecRoutines')).recordset.map((r) => [
      r.name,
      r.sha256,
    ]),
  );
  const changed = changedProcedures(files, known);
  if (!changed.length && installed !== undefined && installed >= revision) return [];
  const tx = new sql.Transaction(pool);
  await tx.begin();
  try {
    // what the guard on AsyncExecRoutines lets through: this revision, on this connection
    await new sql.Request(tx).input('revision', sql.Int, revision).query(
      `EXEC sys.sp_set_session_context @key = N'asyncexec.routines_revision', @value = @revision;
       UPDATE asyncexec.AsyncExecRoutinesRevision SET revision = @revision WHERE only_row = 1 AND revision < @revision;
       IF NOT EXISTS (SELECT 1 FROM asyncexec.AsyncExecRoutinesRevision) INSERT asyncexec.AsyncExecRoutinesRevision (only_row, revision) VALUES (1, @revision);`,
    );
    for (const procedure of changed) {
      try {
        await new sql.Request(tx).batch(procedure.text);
      } catch (error) {
        throw new Error(`procedures/${procedure.file}: ${(error as Error).message}`, { cause: error });
      }
      await new sql.Request(tx)
        .input('name', sql.NVarChar(260), procedure.file)
        .input('sha256', sql.Char(64), procedure.sha256)
        // EXISTS, not @@ROWCOUNT after the UPDATE: what that count is once the table's trigger ran is
        // not documented (the migration lock serialises every writer of the table)
        .query(`IF EXISTS (SELECT 1 FROM asyncexec.AsyncExecRoutines WHERE name = @name)
                  UPDATE asyncexec.AsyncExecRoutines SET sha256 = @sha256, applied_at = SYSUTCDATETIME() WHERE name = @name;
                ELSE INSERT asyncexec.AsyncExecRoutines (name, sha256) VALUES (@name, @sha256);`);
    }
    await tx.commit();
  } catch (error) {
    await tx.rollback().catch(() => undefined); // XACT_ABORT may already have rolled it back
    throw error;
  }
  return changed.map((f) => f.file);
}

/** Install (or refresh) the demo procedures of sql/mssql/demo.sql and register them. */
export async function installDemo(config: sql.config, dir: string = MSSQL_SQL_DIR): Promise<void> {
  const text = await readFile(path.join(dir, 'demo.sql'), 'utf8');
  await withMigrationLock(config, (pool) => runScript(pool, 'demo.sql', text));
}
