import type sql from 'mssql';
import type { Logger } from '../../logger.js';

/** Service Broker must be on in the database, or nothing is ever delivered. */
export async function checkBroker(pool: sql.ConnectionPool): Promise<void> {
  const result = await pool.request().query<{ name: string; is_broker_enabled: boolean }>(
    'SELECT name, is_broker_enabled FROM sys.databases WHERE database_id = DB_ID()',
  );
  const db = result.recordset[0];
  if (db && !db.is_broker_enabled) {
    throw new Error(
      `Service Broker is disabled in database [${db.name}]. Enable it with ` +
        `ALTER DATABASE [${db.name}] SET ENABLE_BROKER WITH ROLLBACK IMMEDIATE; ` +
        `(for a restored copy of a database whose broker is in use elsewhere: SET NEW_BROKER).`,
    );
  }
}

interface QueueRow {
  queue: string;
  object: string;
  found: number | null;
  is_receive_enabled: boolean | null;
  is_enqueue_enabled: boolean | null;
  is_activation_enabled: boolean | null;
  is_poison_message_handling_enabled: boolean | null;
}

/** Every queue of ours exists, receives and enqueues; every request queue has activation on. */
export async function checkQueues(pool: sql.ConnectionPool, logger: Logger): Promise<void> {
  const result = await pool.request().query<QueueRow>(
    `SELECT w.queue, w.object, sq.object_id AS found, sq.is_receive_enabled, sq.is_enqueue_enabled, sq.is_activation_enabled,
            sq.is_poison_message_handling_enabled
       FROM (SELECT name AS queue, queue_object AS object FROM asyncexec.AsyncExecQueues
             UNION ALL SELECT NULL, N'AsyncExecNotifyQueue') AS w
       LEFT JOIN sys.service_queues AS sq ON sq.name COLLATE DATABASE_DEFAULT = w.object AND sq.schema_id = SCHEMA_ID(N'asyncexec')`,
  );
  const problems: string[] = [];
  for (const row of result.recordset) {
    const target = `asyncexec.[${row.object.replace(/]/g, ']]')}]`;
    if (row.found === null) {
      problems.push(`queue ${target} is missing: run the migrations again`);
      continue;
    }
    // STATUS = OFF (set by hand, or by poison-message handling) turns off both receive and enqueue
    if (!row.is_receive_enabled || !row.is_enqueue_enabled) {
      problems.push(`queue ${target} is disabled: ALTER QUEUE ${target} WITH STATUS = ON;`);
    }
    if (row.queue !== null && !row.is_activation_enabled) {
      problems.push(`queue ${target} has activation disabled: ALTER QUEUE ${target} WITH ACTIVATION (STATUS = ON);`);
    }
    if (row.is_poison_message_handling_enabled) {
      logger.warn({ queue: target }, `poison-message handling is on; turn it off with ALTER QUEUE ${target} WITH POISON_MESSAGE_HANDLING (STATUS = OFF);`);
    }
  }
  if (problems.length) throw new Error(`Service Broker queues are not usable: ${problems.join(' ')}`);
}

/** Activation runs EXECUTE AS OWNER: an orphaned database owner makes every reader fail. */
export async function checkOwner(pool: sql.ConnectionPool, logger: Logger): Promise<void> {
  const result = await pool.request().query<{ name: string; owner: string | null }>(
    'SELECT name, SUSER_SNAME(owner_sid) AS owner FROM sys.databases WHERE database_id = DB_ID()',
  );
  const db = result.recordset[0];
  if (db && db.owner === null) {
    logger.warn(
      { database: db.name },
      `the owner of database [${db.name}] is not a known login, so activated procedures (EXECUTE AS OWNER) may fail; ` +
        `fix it with ALTER AUTHORIZATION ON DATABASE::[${db.name}] TO [a_valid_login];`,
    );
  }
}

/**
 * READ_COMMITTED_SNAPSHOT must be on (sys.databases.is_read_committed_snapshot_on). With it,
 * READ COMMITTED reads the last committed version of a row instead of waiting for the
 * transaction that holds it, so the change feed (readChanges), the listings and the
 * subscriptions' re-reads never wait for a running call or for a caller's open transaction.
 * Without it each such read blocks behind them, on top of the delay MIN_ACTIVE_ROWVERSION()
 * already imposes (docs/mssql.md, "How soon an event is read").
 */
export function readCommittedSnapshotProblem(db: { name: string; is_read_committed_snapshot_on: boolean } | undefined): string | null {
  if (!db || db.is_read_committed_snapshot_on) return null;
  return (
    `READ_COMMITTED_SNAPSHOT is off in database [${db.name}]: reads of the results table would wait for every running call. ` +
    `Turn it on (it needs a moment with no other connection in the database): ` +
    `ALTER DATABASE [${db.name.replace(/]/g, ']]')}] SET READ_COMMITTED_SNAPSHOT ON WITH ROLLBACK IMMEDIATE;`
  );
}

/** Refuses to start on a database without READ_COMMITTED_SNAPSHOT (see readCommittedSnapshotProblem). */
export async function checkReadCommittedSnapshot(pool: sql.ConnectionPool): Promise<void> {
  const result = await pool.request().query<{ name: string; is_read_committed_snapshot_on: boolean }>(
    'SELECT name, is_read_committed_snapshot_on FROM sys.databases WHERE database_id = DB_ID()',
  );
  const problem = readCommittedSnapshotProblem(result.recordset[0]);
  if (problem) throw new Error(problem);
}

/** What checkDatabase reads of the database, in one round trip (DATABASE_PROBE). */
export interface DatabaseProbe {
  name: string;
  compatibility_level: number;
  collation_name: string | null;
  /** Whether the ranges of our name rules (`[A-Za-z0-9_.:-]`) hold every ASCII letter and digit under the database's collation. */
  ranges_ok: boolean;
  /** The error EXECUTE AS USER = N'dbo' raised (null: none, or not tried). */
  impersonation_error: number | null;
  /** The login that dbo's SID names on this server (null: none). */
  dbo_login: string | null;
}

/** Every letter and digit our name rules accept, and the four marks. */
const NAME_CHARACTERS = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-';

/**
 * The database's facts checkDatabase judges. `impersonate`: also try EXECUTE AS USER = N'dbo'
 * (what activation and the EXECUTE AS OWNER procedures do), which only a login allowed to
 * impersonate dbo (db_owner, as migrations require) may try without a permission error.
 * String literals take the database's default collation (Collation Precedence: a literal is
 * coercible-default), so the LIKE below is judged as the CHECK constraints and procedures that
 * use the same pattern judge it.
 */
export function databaseProbe(impersonate: boolean): string {
  return `SET NOCOUNT ON;
DECLARE @impersonation int = NULL;
${
  impersonate
    ? `BEGIN TRY
    EXECUTE AS USER = N'dbo';
    REVERT;
END TRY
BEGIN CATCH
    SET @impersonation = ERROR_NUMBER();
END CATCH;
`
    : ''
}SELECT d.name, d.compatibility_level, d.collation_name,
       CAST(CASE WHEN N'${NAME_CHARACTERS}' NOT LIKE N'%[^A-Za-z0-9_.:-]%' THEN 1 ELSE 0 END AS bit) AS ranges_ok,
       @impersonation AS impersonation_error,
       SUSER_SNAME((SELECT p.sid FROM sys.database_principals AS p WHERE p.name = N'dbo')) AS dbo_login
  FROM sys.databases AS d WHERE d.database_id = DB_ID();`;
}

/**
 * What keeps the service from working on this database, each with its fix:
 *  * compatibility level below 130: OPENJSON, which migrations, invoke and run use, "is
 *    available only under compatibility level 130 or higher" (OPENJSON); below it a fresh
 *    database fails mid-migration, and one lowered later fails every invoke, and every queued
 *    call is retried until it fails as lost;
 *  * a collation whose letter ranges skip letters (Estonian sorts Z between S and T, so
 *    [a-z] stops at Z): the queue and procedure name rules (CHECK constraints, procedures)
 *    refuse names like "default", and the first migration that creates the default queue fails;
 *  * an orphaned dbo (a database restored from another server whose owner's login is not here):
 *    EXECUTE AS OWNER fails with 15517 in invoke, in every activation and in the listener, so
 *    the service would start and run nothing. Judged only from the impersonation's own error
 *    together with a dbo SID that names no login.
 */
export function databaseProblems(db: DatabaseProbe | undefined): string[] {
  if (!db) return [];
  const name = `[${db.name.replace(/]/g, ']]')}]`;
  const problems: string[] = [];
  if (db.compatibility_level < 130) {
    problems.push(
      `database ${name} is at compatibility level ${db.compatibility_level}; the service needs 130 or higher (OPENJSON): ` +
        `ALTER DATABASE ${name} SET COMPATIBILITY_LEVEL = 150;`,
    );
  }
  if (!db.ranges_ok) {
    problems.push(
      `the collation of database ${name} (${db.collation_name ?? 'unknown'}) does not keep the ASCII letters within [A-Za-z], ` +
        `which the service's name rules rely on; create the database with a Latin1_General collation (for instance ` +
        `CREATE DATABASE ... COLLATE Latin1_General_100_CI_AS_SC_UTF8)`,
    );
  }
  // 15517; 15404 for a Windows owner the server cannot resolve (MSSQLSERVER_15404)
  if ((db.impersonation_error === 15517 || db.impersonation_error === 15404) && db.dbo_login === null) {
    problems.push(
      `the owner of database ${name} is not a login of this server (a database restored from another server?), so EXECUTE AS OWNER ` +
        `fails (${db.impersonation_error}) in invoke, activation and the listener: ALTER AUTHORIZATION ON DATABASE::${name} TO [a_valid_login];`,
    );
  }
  return problems;
}

/** Refuses to start (or to migrate) on a database the service cannot work in (databaseProblems). */
export async function checkDatabase(pool: sql.ConnectionPool, options: { impersonate: boolean }): Promise<void> {
  const result = await pool.request().batch<DatabaseProbe>(databaseProbe(options.impersonate));
  const problems = databaseProblems(result.recordset[0]);
  if (problems.length) throw new Error(`This database cannot run asyncproc: ${problems.join(' ')}`);
}
