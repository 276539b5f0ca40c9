import sql from 'mssql';
import type {
  ActivatorOptions,
  Attempt,
  Closeable,
  Engine,
  Execution,
  ExecutionEvent,
  ExecutionFilter,
  ExecutionPage,
  InvokeCall,
  ListenerSink,
  PageRequest,
  Procedure,
  QueueInfo,
} from '../../engine.js';
import type { Logger } from '../../logger.js';
import { Closeables } from '../closeables.js';
import { silentLogger } from '../../logger.js';
import { checkBroker, checkOwner, checkQueues } from './checks.js';
import { countExecutions, eventsSince, getExecutions, latestCursor, listExecutions } from './executions.js';
import { getHistory } from './history.js';
import { invoke } from './invoke.js';
import { MssqlListener } from './listener.js';
import { installDemo, migrate, MSSQL_SQL_DIR } from './migrator.js';
import {
  configureQueue,
  createQueue,
  listProcedures,
  listQueues,
  registerProcedure,
  type MssqlRegisterOptions,
} from './procedures.js';
import { parseMssqlUrl } from './url.js';

export interface MssqlEngineOptions {
  /** mssql://user:password@host:1433/database?… (see url.ts). */
  url: string;
  logger?: Logger;
  /** Size of the query pool. @default 10 */
  poolSize?: number;
  /** Where the T-SQL scripts live. @default sql/mssql */
  sqlDir?: string;
  /** WAITFOR timeout of the listener, and its catch-up period. @default 1000 */
  listenerWaitMs?: number;
}

/** The SQL Server engine: activation runs in the database, the service invokes, reads and listens. */
export class MssqlEngine implements Engine<sql.Transaction> {
  readonly kind = 'mssql' as const;
  readonly pool: sql.ConnectionPool;
  readonly config: sql.config;
  readonly database: string;
  private readonly logger: Logger;
  private readonly closeables = new Closeables();

  constructor(readonly options: MssqlEngineOptions) {
    const { config, database } = parseMssqlUrl(options.url);
    this.config = config;
    this.database = database;
    this.logger = options.logger ?? silentLogger;
    this.pool = new sql.ConnectionPool({ ...config, pool: { max: options.poolSize ?? 10, ...config.pool } });
    this.pool.on('error', (error: unknown) => this.logger.warn({ err: error }, 'query pool connection failed'));
  }

  async connect(): Promise<this> {
    await this.pool.connect();
    return this;
  }

  async migrate(): Promise<void> {
    await checkBroker(this.pool);
    const applied = await migrate(this.config, this.options.sqlDir ?? MSSQL_SQL_DIR);
    if (applied.length) this.logger.info({ applied }, 'applied SQL Server migrations');
    await this.check();
  }

  /** Start-up checks; each failure names its fix. */
  async check(): Promise<void> {
    await checkBroker(this.pool);
    await checkQueues(this.pool, this.logger);
    await checkOwner(this.pool, this.logger);
  }

  installDemo(): Promise<void> {
    return installDemo(this.config, this.options.sqlDir ?? MSSQL_SQL_DIR);
  }

  async withTransaction<T>(fn: (tx: sql.Transaction) => Promise<T>): Promise<T> {
    const tx = new sql.Transaction(this.pool);
    await tx.begin();
    let result: T;
    try {
      result = await fn(tx);
    } catch (error) {
      // the server may have rolled it back already (XACT_ABORT, deadlock victim)
      await tx.rollback().catch(() => undefined);
      throw error;
    }
    await tx.commit();
    return result;
  }

  invoke(tx: sql.Transaction, call: InvokeCall): Promise<Execution> {
    return invoke(tx, call);
  }

  async getExecution(token: string): Promise<Execution | null> {
    return (await getExecutions(this.pool, [token]))[0] ?? null;
  }
  getExecutions(tokens: readonly string[]): Promise<Execution[]> {
    return getExecutions(this.pool, tokens);
  }
  listExecutions(filter: ExecutionFilter, page: PageRequest): Promise<ExecutionPage> {
    return listExecutions(this.pool, filter, page);
  }
  countExecutions(filter: ExecutionFilter): Promise<number> {
    return countExecutions(this.pool, filter);
  }
  eventsSince(cursor: string | null, filter: ExecutionFilter, limit: number): Promise<ExecutionEvent[]> {
    return eventsSince(this.pool, cursor, filter, limit);
  }
  latestCursor(): Promise<string | null> {
    return latestCursor(this.pool);
  }
  listProcedures(): Promise<Procedure[]> {
    return listProcedures(this.pool);
  }
  registerProcedure(name: string, options?: MssqlRegisterOptions): Promise<Procedure> {
    return registerProcedure(this.pool, name, options);
  }
  listQueues(): Promise<QueueInfo[]> {
    return listQueues(this.pool);
  }
  /** Create a queue or change its concurrency (MAX_QUEUE_READERS). */
  createQueue(name: string, concurrency?: number): Promise<void> {
    return createQueue(this.pool, name, concurrency);
  }
  /** Create a queue or change its concurrency (1–1000); returns it as listQueues reports it. */
  configureQueue(name: string, concurrency: number): Promise<QueueInfo> {
    return configureQueue(this.pool, name, concurrency);
  }
  /** Every attempt of each execution (asyncexec.AsyncExecAttempts), oldest first; [] for none. */
  getHistory(executionIds: readonly string[]): Promise<Map<string, Attempt[]>> {
    return getHistory(this.pool, executionIds);
  }

  /** Delete finished history older than `olderThanMs`; returns how many executions went. */
  async purge(olderThanMs: number): Promise<number> {
    const result = await this.pool
      .request()
      .input('olderThanSeconds', sql.Int, Math.max(0, Math.floor(olderThanMs / 1000)))
      .execute<{ deleted: number }>('asyncexec.usp_AsyncExecPurge');
    return result.recordset[0]?.deleted ?? 0;
  }

  /** Activation runs in the database (Service Broker starts the readers): nothing to start here. */
  async startActivator(_options: ActivatorOptions): Promise<Closeable> {
    return { close: async () => undefined };
  }

  async startListener(sink: ListenerSink): Promise<Closeable> {
    await this.check();
    const listener = new MssqlListener({ config: this.config, sink, logger: this.logger, waitMs: this.options.listenerWaitMs });
    await listener.start();
    return this.closeables.track(listener);
  }


  async close(): Promise<void> {
    await this.closeables.closeAll();
    await this.pool.close();
  }
}

/** Parse the URL and open the query pool; run migrate() before anything else. */
export async function createMssqlEngine(options: MssqlEngineOptions): Promise<MssqlEngine> {
  return new MssqlEngine(options).connect();
}
