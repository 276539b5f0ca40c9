import sql from 'mssql';
import type { Snapshot } from '../../changeCursor.js';
import {
  EngineError,
  markReplayed,
  purgedWhileReplayed,
  type ActivatorOptions,
  type Attempt,
  type Batch,
  type Closeable,
  type Engine,
  type Execution,
  type ChangePage,
  type ChangeRead,
  type ExecutionFilter,
  type ExecutionPage,
  type ExecutionProgress,
  type GroupCommits,
  type InvokeCall,
  type ListenerSink,
  type NewApiKey,
  type ApiKeySecret,
  type PageRequest,
  type Procedure,
  type QueueInfo,
  type RunningExecution,
  type Schedule,
  type ScheduleChange,
  type ScheduleInput,
  type SchemaVersion,
  type SubmitBatchOptions,
} from '../../engine.js';
import type { Logger } from '../../logger.js';
import { Closeables } from '../closeables.js';
import { highestMigration } from '../migrationFiles.js';
import { silentLogger } from '../../logger.js';
import { mssqlCancelSteps, runCancel } from './cancel.js';
import { cancelBatch } from './cancelBatch.js';
import { checkBroker, checkDatabase, checkOwner, checkQueues, checkReadCommittedSnapshot } from './checks.js';
import { checkBatch, getBatch, getBatchExecutions, submitBatch } from './executionBatches.js';
import { countExecutions, currentPosition, getExecutions, listExecutions, listRunning, purgeHorizon, readChanges } from './executions.js';
import { isToken } from './types.js';
import { getHistory } from './history.js';
import { invoke } from './invoke.js';
import { MssqlListener } from './listener.js';
import { canReadOtherSessions, getProgress, startProgressReader } from './progress.js';
import { installDemo, migrate, MSSQL_SQL_DIR } from './migrator.js';
import {
  configureQueue,
  createQueue,
  listProcedures,
  listQueues,
  pauseQueue,
  registerProcedure,
  unregisterProcedure,
  type MssqlRegisterOptions,
} from './procedures.js';
import { createApiKey, findApiKey, listApiKeys, revokeApiKey, rotateApiKey } from './apiKeys.js';
import { parseMssqlUrl } from './url.js';
import { ConnectionPool } from './pool.js';
import {
  createSchedule,
  deleteSchedule,
  getSchedule,
  listSchedules,
  pauseSchedule,
  resumeSchedule,
  startScheduleTicker,
  updateSchedule,
} from './schedules.js';
import { retryDeadlocks } from './deadlock.js';
import { isTransient } from './errors.js';
import { mssqlPurgeRound, purgeHistory, recoverLostCalls, Sweeper, type RecoveryReport } from './sweeper.js';

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
  /**
   * Let cancelExecution KILL the session running a RUNNING call (the login needs ALTER ANY
   * CONNECTION and VIEW SERVER STATE; see docs/mssql.md). Overrides the URL's allowKill.
   * @default the URL's allowKill, else false
   */
  allowKill?: boolean;
  /** How long cancelExecution (and cancelBatch) waits for killed calls to stop RUNNING. @default 10000 */
  cancelWaitMs?: number;
  /** Finished history is purged after this long (the sweeper, sweeper.ts). @default 7 days */
  retentionMs?: number;
  /** Between the sweeper's recoveries of calls whose dialog is gone (usp_AsyncExecRecover). @default 60000 */
  sweepPeriodMs?: number;
  /** Between two reads of the running calls' progress reports (progress.ts). @default 500 */
  progressIntervalMs?: number;
}

/** The SQL Server engine: activation runs in the database, the service invokes, reads and listens. */
export class MssqlEngine implements Engine<sql.Transaction> {
  readonly kind = 'mssql' as const;
  readonly pool: sql.ConnectionPool;
  readonly config: sql.config;
  readonly database: string;
  /** Whether cancelExecution may KILL the session running a call. */
  readonly allowKill: boolean;
  private readonly logger: Logger;
  private readonly closeables = new Closeables();
  /** Whether the missing permission for live progress was logged (once per engine). */
  private progressRefusalLogged = false;
  /** The one sweeper of this engine, while the activator or the listener (or both) run. */
  private sweeper: { started: Promise<Sweeper>; users: number } | undefined;

  constructor(readonly options: MssqlEngineOptions) {
    const { config, database, allowKill } = parseMssqlUrl(options.url);
    this.config = config;
    this.database = database;
    this.allowKill = options.allowKill ?? allowKill;
    this.logger = options.logger ?? silentLogger;
    const poolConfig = { max: options.poolSize ?? 10, ...config.pool };
    // the kill holds the call's row on one connection while another one runs KILL
    if (this.allowKill && (poolConfig.max ?? 10) < 2) throw new Error('DATABASE_URL: allowKill=true needs poolMax ≥ 2');
    this.pool = new ConnectionPool({ ...config, pool: poolConfig }, () =>
      this.logger.warn('a pooled connection had a transaction left open (a request cut by its requestTimeout): closed, which rolls it back'),
    );
    this.pool.on('error', (error: unknown) => this.logger.warn({ err: error }, 'query pool connection failed'));
  }

  async connect(): Promise<this> {
    await this.pool.connect();
    return this;
  }

  async migrate(): Promise<void> {
    await checkBroker(this.pool);
    // before any migration: one that fails half-way on an unusable database says less than this
    await checkDatabase(this.pool, { impersonate: true });
    const { versions, procedures } = await migrate(this.config, this.options.sqlDir ?? MSSQL_SQL_DIR);
    if (versions.length) this.logger.info({ applied: versions }, 'applied SQL Server migrations');
    // an ALTER drops a module signature (docs/mssql.md, "Security context of the calls")
    if (procedures.length) this.logger.info({ procedures }, 'applied SQL Server procedure files (sign again any you had signed)');
    await this.objectChecks();
  }

  /**
   * One round trip; the tables are looked for first (a restored or emptied database may lack
   * them): the versions, and the tables every call goes through (one renamed or dropped by hand
   * is a schema not there, whatever the versions say).
   */
  async schemaVersion(): Promise<SchemaVersion> {
    const tables = ['AsyncExecSchemaVersions', 'AsyncExecResults', 'AsyncExecQueues', 'AsyncExecProcedures'];
    const { recordset } = await this.pool.request().query<{ version: number | null }>(
      `IF ${tables.map((t) => `OBJECT_ID(N'asyncexec.${t}', N'U') IS NULL`).join(' OR ')} BEGIN SELECT CAST(NULL AS int) AS version; END
       ELSE BEGIN SELECT MAX(version) AS version FROM asyncexec.AsyncExecSchemaVersions; END;`,
    );
    return { applied: recordset[0]?.version ?? null, expected: await highestMigration(this.options.sqlDir ?? MSSQL_SQL_DIR) };
  }

  /** Start-up checks; each failure names its fix. */
  async check(): Promise<void> {
    await checkBroker(this.pool);
    // a login that is not db_owner may serve (docs/mssql.md, Permissions): no impersonation here
    await checkDatabase(this.pool, { impersonate: false });
    await this.objectChecks();
  }

  /** The checks of what the migrations made and the database's options (migrate() ran the database's own before migrating). */
  private async objectChecks(): Promise<void> {
    await checkQueues(this.pool, this.logger);
    await checkOwner(this.pool, this.logger);
    await checkReadCommittedSnapshot(this.pool);
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
  isTransient(error: unknown): boolean {
    return isTransient(error);
  }
  listExecutions(filter: ExecutionFilter, page: PageRequest): Promise<ExecutionPage> {
    return listExecutions(this.pool, filter, page);
  }
  countExecutions(filter: ExecutionFilter): Promise<number> {
    return countExecutions(this.pool, filter);
  }
  readChanges(since: Snapshot, read: ChangeRead): Promise<ChangePage> {
    return readChanges(this.pool, since, read);
  }
  currentPosition(): Promise<Snapshot> {
    return currentPosition(this.pool);
  }
  purgeHorizon(): Promise<bigint | null> {
    return purgeHorizon(this.pool);
  }
  listProcedures(): Promise<Procedure[]> {
    return listProcedures(this.pool);
  }
  registerProcedure(name: string, options?: MssqlRegisterOptions): Promise<Procedure> {
    return registerProcedure(this.pool, name, options);
  }
  /** usp_AsyncExecUnregister: the row stays, marked, so calls submitted before still run. */
  unregisterProcedure(name: string): Promise<Procedure> {
    return unregisterProcedure(this.pool, name);
  }
  createApiKey(key: NewApiKey) {
    return createApiKey(this.pool, key);
  }
  listApiKeys() {
    return listApiKeys(this.pool);
  }
  revokeApiKey(id: string) {
    return revokeApiKey(this.pool, id);
  }
  rotateApiKey(id: string, successor: ApiKeySecret, overlapSeconds: number) {
    return rotateApiKey(this.pool, id, successor, overlapSeconds);
  }
  findApiKey(secretHash: string) {
    return findApiKey(this.pool, secretHash);
  }
  /** Every queue with its counts; `recent` covers the last `recentSeconds` (default 3600). */
  listQueues(recentSeconds?: number): Promise<QueueInfo[]> {
    return listQueues(this.pool, recentSeconds);
  }
  /** RUNNING executions, longest-running first, with elapsed time by the server's clock. */
  listRunning(queue: string | null, limit: number, submittedBy?: string | null): Promise<RunningExecution[]> {
    return listRunning(this.pool, queue, limit, submittedBy);
  }
  /**
   * One transaction, all or none: the batch row, stage 1 enqueued, later stages held; the
   * database releases each stage when the one before has ended (usp_AsyncExecBatchSettle).
   */
  async submitBatch(stages: readonly (readonly InvokeCall[])[], options?: SubmitBatchOptions): Promise<Batch> {
    checkBatch(stages, options); // refused before a transaction is even opened
    // a deadlock victim's transaction was rolled back whole: submit it again (deadlock.ts)
    return retryDeadlocks(() =>
      this.withTransaction(async (tx) => {
        const { id, replayed } = await submitBatch(tx, stages, options);
        const batch = await getBatch(tx, id);
        // only a replayed batch can be gone: purged since its key was read
        if (!batch) throw purgedWhileReplayed(options?.idempotencyKey);
        return replayed ? markReplayed(batch) : batch;
      }),
    );
  }
  getBatch(id: string): Promise<Batch | null> {
    return getBatch(this.pool, id);
  }
  getBatchExecutions(id: string): Promise<Execution[]> {
    return getBatchExecutions(this.pool, id);
  }
  /**
   * usp_AsyncExecCancelBatch cancels every member not yet started and settles the batch in one
   * transaction; then, with allowKill only, each RUNNING member is cancelled as cancelExecution
   * does and the batch is waited for (up to cancelWaitMs). Without allowKill running members run
   * to their end and the batch is returned at once. NOT_FOUND, ALREADY_FINISHED, BAD_USER_INPUT.
   */
  cancelBatch(id: string): Promise<Batch> {
    return cancelBatch(this.pool, id, {
      allowKill: this.allowKill,
      waitMs: this.options.cancelWaitMs,
      onMemberError: (token, error) =>
        this.logger.warn({ err: error, batchId: id, token }, 'cancelBatch: a running execution could not be cancelled; it runs to its end'),
    });
  }
  /** Create a queue or change its concurrency (MAX_QUEUE_READERS). */
  createQueue(name: string, concurrency?: number): Promise<void> {
    return createQueue(this.pool, name, concurrency);
  }
  /** Create a queue or change its concurrency (1–1000); returns it as listQueues reports it. */
  configureQueue(name: string, concurrency: number, groupCommits?: Partial<GroupCommits>): Promise<QueueInfo> {
    return configureQueue(this.pool, name, concurrency, groupCommits);
  }
  /**
   * Pause or resume a queue: its reader goes on receiving every message of the queue but starts
   * none of its calls while paused (usp_AsyncExecActivated); a resume wakes them (docs/mssql.md).
   */
  pauseQueue(name: string, paused: boolean): Promise<QueueInfo> {
    return pauseQueue(this.pool, name, paused);
  }
  /**
   * WAITING/PENDING → CANCELLED at once; RUNNING → FORBIDDEN unless allowKill, else the
   * reader's session is killed and the call recorded CANCELLED (waits up to cancelWaitMs).
   */
  async cancelExecution(token: string): Promise<Execution> {
    if (typeof token !== 'string' || !isToken(token)) throw new EngineError('BAD_USER_INPUT', `malformed token "${String(token)}"`);
    return runCancel(mssqlCancelSteps(this.pool, token, this.allowKill), { waitMs: this.options.cancelWaitMs });
  }
  /** Every attempt of each execution (asyncexec.AsyncExecAttempts), oldest first; [] for none. */
  createSchedule(input: ScheduleInput): Promise<Schedule> {
    return createSchedule(this.pool, input);
  }
  updateSchedule(name: string, change: ScheduleChange): Promise<Schedule> {
    return updateSchedule(this.pool, name, change);
  }
  pauseSchedule(name: string): Promise<Schedule> {
    return pauseSchedule(this.pool, name);
  }
  resumeSchedule(name: string): Promise<Schedule> {
    return resumeSchedule(this.pool, name);
  }
  deleteSchedule(name: string): Promise<Schedule> {
    return deleteSchedule(this.pool, name);
  }
  listSchedules(): Promise<Schedule[]> {
    return listSchedules(this.pool);
  }
  getSchedule(name: string): Promise<Schedule | null> {
    return getSchedule(this.pool, name);
  }

  /** The latest progress each execution's current or last run reported (asyncexec.AsyncExecProgress; progress.ts). */
  getProgress(executionIds: readonly string[]): Promise<Map<string, ExecutionProgress>> {
    return getProgress(this.pool, executionIds);
  }

  getHistory(executionIds: readonly string[]): Promise<Map<string, Attempt[]>> {
    return getHistory(this.pool, executionIds);
  }

  /**
   * Delete finished history (and finished batches left without executions) older than `olderThanMs`,
   * in bounded batches (usp_AsyncExecPurge, called again until nothing is left); returns how many executions went.
   */
  purge(olderThanMs: number): Promise<number> {
    return purgeHistory(mssqlPurgeRound(this.pool), olderThanMs);
  }

  /** One recovery sweep now: calls whose dialog is gone get a new one (usp_AsyncExecRecover; the sweeper runs it periodically). */
  recoverLostCalls(options?: { limit?: number; minAgeSeconds?: number }): Promise<RecoveryReport> {
    return recoverLostCalls(this.pool, options);
  }

  /**
   * Activation runs in the database (Service Broker starts the readers); the service runs the
   * sweeper (recovery of lost dialogs, retention), shared with the listener, and fires due
   * recurring schedules once a second (schedules.ts).
   */
  async startActivator(_options: ActivatorOptions): Promise<Closeable> {
    const sweeper = await this.startSweeper();
    // recurring schedules fire from here, as from the PostgreSQL activator's tick
    const ticker = startScheduleTicker(this.pool, this.logger);
    return this.closeables.track({ close: async () => void (await Promise.all([ticker.close(), sweeper.close()])) });
  }

  async startListener(sink: ListenerSink): Promise<Closeable> {
    await this.check();
    const listener = new MssqlListener({ config: this.config, sink, logger: this.logger, waitMs: this.options.listenerWaitMs });
    await listener.start();
    const sweeper = await this.startSweeper().catch(async (error: unknown) => {
      await listener.close();
      throw error;
    });
    const progress = await this.startProgressReader(sink);
    return this.closeables.track({ close: async () => void (await Promise.all([progress.close(), sweeper.close(), listener.close()])) });
  }

  /** Live progress needs other sessions' CONTEXT_INFO: without the permission, say so once and read none. */
  private async startProgressReader(sink: ListenerSink): Promise<Closeable> {
    const allowed = await canReadOtherSessions(this.pool).catch((error: unknown) => {
      this.logger.warn({ err: error }, 'could not check the permission live progress needs; progress is not read');
      return false;
    });
    if (!allowed) {
      if (!this.progressRefusalLogged) {
        this.progressRefusalLogged = true;
        this.logger.warn(
          'live progress is off: the login lacks VIEW SERVER STATE (VIEW SERVER PERFORMANCE STATE on 2022), which reading the CONTEXT_INFO of the sessions running calls needs; Execution.progress shows only the last report stored with each outcome (docs/mssql.md, "Live progress")',
        );
      }
      return { close: async () => undefined };
    }
    return startProgressReader({ pool: this.pool, sink, logger: this.logger, intervalMs: this.options.progressIntervalMs });
  }

  /** The engine's one sweeper (sweeper.ts): started by the first user, closed with the last. */
  private async startSweeper(): Promise<Closeable> {
    if (!this.sweeper) {
      const steps = {
        recover: () => recoverLostCalls(this.pool),
        purge: (stopped: () => boolean) =>
          purgeHistory(mssqlPurgeRound(this.pool), this.options.retentionMs ?? 7 * 86_400_000, stopped),
      };
      const sweeper = new Sweeper(steps, { logger: this.logger, periodMs: this.options.sweepPeriodMs });
      this.sweeper = { started: sweeper.start().then(() => sweeper), users: 0 };
    }
    const entry = this.sweeper;
    entry.users++;
    const sweeper = await entry.started;
    let closed = false;
    return this.closeables.track({
      close: async () => {
        if (closed) return;
        closed = true;
        if (--entry.users === 0) {
          if (this.sweeper === entry) this.sweeper = undefined;
          await sweeper.close();
        }
      },
    });
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
