/**
 * asyncproc as a library: a backend service submits calls inside its own PostgreSQL
 * transaction (graphile-worker's library mode is the model). The service (`asyncproc
 * serve`, `npm start`) runs them; this side only submits, reads and cancels.
 */
import type { Engine } from './engine.js';
import path from 'node:path';
import { routinesRevision } from './engines/migrationFiles.js';
import { createPostgresEngine, type PostgresEngine, type PostgresTransaction } from './engines/postgres/index.js';
import { POSTGRES_SQL_DIR } from './engines/postgres/migrator.js';
import type { Logger } from './logger.js';

export interface ConnectOptions {
  /** postgres://… — the database the asyncproc service runs on. */
  connectionString: string;
  /** Connections this process may open. @default 10 */
  poolSize?: number;
  /** A pino logger. @default silent */
  logger?: Logger;
  /** Install or upgrade the asyncproc schema first, as the service does at start. @default false */
  migrate?: boolean;
}

/** An engine on PostgreSQL: `invoke(tx, call)` takes the `pg` client of your open transaction. */
export type AsyncProc = Engine<PostgresTransaction>;

/** Connect (and check the connection, so a wrong URL fails here); `close()` it when done. */
export async function connect(options: ConnectOptions): Promise<AsyncProc> {
  const engine = createPostgresEngine({ connectionString: options.connectionString, poolSize: options.poolSize, logger: options.logger });
  try {
    if (options.migrate) await engine.migrate();
    else await checkSchema(engine);
  } catch (error) {
    await engine.close().catch(() => undefined);
    throw error;
  }
  return engine;
}

/**
 * The database holds the asyncproc schema and routines this package calls (the service's
 * migrations, or `migrate: true`, install them): a missing or older schema is refused here, by
 * name, rather than by the first invoke with PostgreSQL's own "does not exist".
 */
async function checkSchema(engine: PostgresEngine): Promise<void> {
  const { applied, expected } = await engine.schemaVersion();
  const fix = 'start the asyncproc service of this release on it (it migrates at start), or connect with migrate: true';
  if (applied === null) throw new Error(`the database has no asyncproc schema: ${fix}`);
  if (applied < expected) throw new Error(`the database's asyncproc schema is at migration ${applied}, this package needs ${expected}: ${fix}`);
  const revision = await routinesRevision(path.join(POSTGRES_SQL_DIR, 'routines'));
  const { rows } = await engine.pool.query<{ revision: number }>('select revision from asyncproc.routines_revision');
  const installed = rows[0]?.revision ?? 0;
  if (installed < revision) throw new Error(`the database's asyncproc routines are revision ${installed}, this package needs ${revision}: ${fix}`);
}

export { EngineError, isReplayed } from './engine.js';
export type { PostgresTransaction } from './engines/postgres/index.js';
export type {
  Batch,
  EngineErrorCode,
  Execution,
  ExecutionError,
  ExecutionResult,
  ExecutionStatus,
  InvokeCall,
  Procedure,
  QueueInfo,
  SubmitBatchOptions,
} from './engine.js';
