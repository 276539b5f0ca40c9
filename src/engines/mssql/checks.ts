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
       LEFT JOIN sys.service_queues AS sq ON sq.name = w.object AND sq.schema_id = SCHEMA_ID(N'asyncexec')`,
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
