/**
 * asyncproc as a library: a backend service submits calls inside its own PostgreSQL
 * transaction (graphile-worker's library mode is the model). The service (`asyncproc
 * serve`, `npm start`) runs them; this side only submits, reads and cancels.
 */
import type { Engine } from './engine.js';
import { createPostgresEngine, type PostgresTransaction } from './engines/postgres/index.js';
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
    else await engine.pool.query('select 1');
  } catch (error) {
    await engine.close().catch(() => undefined);
    throw error;
  }
  return engine;
}

export { EngineError } from './engine.js';
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
