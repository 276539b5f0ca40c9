import pg from 'pg';
import type { Snapshot } from '../../changeCursor.js';
import type {
  ActivatorOptions,
  ChangeRead,
  Batch,
  Closeable,
  Engine,
  Execution,
  GroupCommits,
  InvokeCall,
  ListenerSink,
  NewApiKey,
  ApiKeySecret,
  OwnChange,
  RegisterOptions,
  ScheduleChange,
  ScheduleInput,
  SubmitBatchOptions,
} from '../../engine.js';
import { isReplayed, markReplayed, purgedWhileReplayed } from '../../engine.js';
import type { Logger } from '../../logger.js';
import { Closeables } from '../closeables.js';
import { silentLogger } from '../../logger.js';
import { PostgresActivator } from './activator.js';
import { checkDeployment } from './checks.js';
import { connectionConfig, cutShort, isoDates, liftSessionLimits, trackedClient } from './connection.js';
import { countExecutions, currentPosition, getExecutions, listExecutions, purgeHorizon, readChanges } from './executions.js';
import { invoke, SubmitCoalescer, submitMany } from './invoke.js';
import { isTransient } from './errors.js';
import { PostgresListener } from './listener.js';
import { Notifier } from './notifier.js';
import { installDemo, migrate, schemaVersion } from './migrator.js';
import { listProcedures, registerProcedure, unregisterProcedure } from './procedures.js';
import { createApiKey, findApiKey, listApiKeys, revokeApiKey, rotateApiKey } from './apiKeys.js';
import { configureQueue, listQueues, listRunning, pauseQueue } from './queues.js';
import { getBatch, getBatchExecutions, submitBatch } from './batches.js';
import { getHistory } from './history.js';
import { purgeFinished } from './purge.js';
import { cancelBatch, cancelExecution } from './cancel.js';
import { getProgress, ProgressRelay } from './progress.js';
import {
  createSchedule,
  deleteSchedule,
  getSchedule,
  listSchedules,
  pauseSchedule,
  resumeSchedule,
  updateSchedule,
} from './schedules.js';

export interface PostgresEngineOptions {
  connectionString: string;
  logger?: Logger;
  /** Size of the query pool (reads and mutations). @default 10 */
  poolSize?: number;
  /** Housekeeping period of the activator. @default 1000 */
  tickMs?: number;
  /** Finished history is purged after this long. @default 7 days */
  retentionMs?: number;
}

// every connection of the engine reads values with the engine's own parsers (types.ts), not pg's process-wide ones

export type PostgresTransaction = pg.ClientBase;

/** Marks a transaction opened by withTransaction: its invokes notify after the commit. */
const SUBMITTED = Symbol('asyncproc.submitted');
type OwnTransaction = pg.PoolClient & { [SUBMITTED]?: Execution[] };

export class PostgresEngine implements Engine<PostgresTransaction> {
  readonly kind = 'postgres' as const;
  readonly pool: pg.Pool;
  private readonly coalescer: SubmitCoalescer;
  private readonly logger: Logger;
  private readonly closeables = new Closeables();
  private readonly notifier: Notifier;
  private readonly progress: ProgressRelay;
  private readonly activators = new Set<PostgresActivator>();
  /** The pool's connections on their way (an activator's stop cuts them short). */
  private readonly poolOpening = new Set<pg.Client>();

  constructor(readonly options: PostgresEngineOptions) {
    this.logger = options.logger ?? silentLogger;
    this.pool = new pg.Pool({
      ...connectionConfig(options.connectionString),
      Client: trackedClient(this.poolOpening),
      max: options.poolSize ?? 10,
      application_name: 'asyncproc',
      // awaited by the pool before it hands the new connection out (a query queued beside the
      // first one on a 'connect' event is deprecated by pg, and goes in pg 9)
      onConnect: async (client) => {
        // for its whole life: pg-pool listens for errors only while a connection is idle, and one
        // that failed while handed out (cut between two statements of a transaction, say) threw an
        // unhandled 'error' that stopped the process; the statement on it fails, for its caller
        client.on('error', (error) => this.logger.debug({ err: { message: error.message, code: (error as { code?: string }).code } }, 'pool connection failed'));
        await liftSessionLimits(client).catch((error: unknown) => this.logger.debug({ err: error }, 'could not lift the session limits'));
        await isoDates(client);
      },
    });
    // the error without the pool's `client` on it (pg-pool attaches the whole connection: a page of JSON a line)
    this.pool.on('error', (error) =>
      this.logger.warn({ err: { type: error.name, message: error.message, code: (error as { code?: string }).code } }, 'idle pool connection failed'),
    );
    this.notifier = new Notifier(options.connectionString, this.logger);
    this.coalescer = new SubmitCoalescer(this.pool);
    this.progress = new ProgressRelay(this.pool, this.logger);
  }

  async migrate(): Promise<void> {
    // before anything is written: a standby or a transaction pooler would fail obscurely later
    await this.check();
    const applied = await migrate(this.pool);
    if (applied.length) this.logger.info({ applied }, 'applied PostgreSQL migrations');
  }

  schemaVersion() {
    return schemaVersion(this.pool);
  }

  /** Start-up checks; each failure names its fix. */
  check(): Promise<void> {
    return checkDeployment(this.options.connectionString, this.logger);
  }

  installDemo(): Promise<void> {
    return installDemo(this.pool);
  }

  async withTransaction<T>(fn: (tx: PostgresTransaction) => Promise<T>): Promise<T> {
    const client: OwnTransaction = await this.pool.connect();
    let broken: Error | undefined;
    const submitted: Execution[] = (client[SUBMITTED] = []);
    try {
      await client.query('begin');
      const result = await fn(client);
      // a transaction a statement failed in (its error caught by `fn`) cannot commit: PostgreSQL
      // answers COMMIT with ROLLBACK, and no error
      const { command } = await client.query('commit');
      if (command !== 'COMMIT') throw new Error('the transaction was rolled back, not committed: a statement in it had failed, and its error was caught');
      this.announce(submitted);
      return result;
    } catch (error) {
      await client.query('rollback').catch((e) => (broken = e as Error));
      throw error;
    } finally {
      delete client[SUBMITTED];
      client.release(broken);
    }
  }

  /** In our own transactions the notifications follow the commit; in a caller's they are part of it. */
  invoke(tx: PostgresTransaction, call: InvokeCall): Promise<Execution> {
    const own = (tx as OwnTransaction)[SUBMITTED];
    return invoke(tx, call, own !== undefined).then((execution) => {
      own?.push(execution);
      return execution;
    });
  }

  async submit(calls: readonly InvokeCall[]): Promise<Execution[]> {
    if (!calls.length) return [];
    // a single call may share a statement with other requests' (SubmitCoalescer); several are all or none
    const executions = calls.length === 1 ? [await this.coalescer.submit(calls[0])] : await submitMany(this.pool, calls);
    this.announce(executions);
    return executions;
  }

  async submitBatch(stages: readonly (readonly InvokeCall[])[], options?: SubmitBatchOptions): Promise<Batch> {
    const { executions, replayed } = await submitBatch(this.pool, stages, options);
    if (!replayed) this.announce(executions);
    // only a replayed batch can be gone: purged since its key was read
    const batch = executions.length ? await getBatch(this.pool, executions[0].batchId!) : null;
    if (!batch) throw purgedWhileReplayed(options?.idempotencyKey);
    return replayed ? markReplayed(batch) : batch;
  }
  getBatch(id: string) {
    return getBatch(this.pool, id);
  }
  getBatchExecutions(id: string) {
    return getBatchExecutions(this.pool, id);
  }
  cancelBatch(id: string) {
    return cancelBatch(this.pool, id);
  }

  private announce(executions: Execution[]): void {
    const ready = new Set<string>();
    let waiting = false;
    for (const execution of executions) {
      // a replay submitted nothing: what it returns was announced by the request that made it
      if (isReplayed(execution)) continue;
      this.notifier.event(execution.id, execution.cursor, execution.status);
      // WAITING too: activators then arm a timer for its runAt
      ready.add(execution.queue);
      waiting ||= execution.status === 'WAITING';
    }
    for (const queue of ready) this.notifier.wake(queue);
    for (const activator of this.activators) activator.wake(ready, waiting);
  }

  async getExecution(token: string) {
    return (await getExecutions(this.pool, [token]))[0] ?? null;
  }
  getExecutions(tokens: readonly string[]) {
    return getExecutions(this.pool, tokens);
  }
  isTransient(error: unknown): boolean {
    return isTransient(error);
  }
  listExecutions(filter: Parameters<typeof listExecutions>[1], page: Parameters<typeof listExecutions>[2]) {
    return listExecutions(this.pool, filter, page);
  }
  countExecutions(filter: Parameters<typeof countExecutions>[1]) {
    return countExecutions(this.pool, filter);
  }
  readChanges(since: Snapshot, read: ChangeRead) {
    return readChanges(this.pool, since, read);
  }
  currentPosition() {
    return currentPosition(this.pool);
  }
  purgeHorizon() {
    return purgeHorizon(this.pool);
  }
  listProcedures() {
    return listProcedures(this.pool);
  }
  registerProcedure(name: string, options?: RegisterOptions) {
    return registerProcedure(this.pool, name, options);
  }
  unregisterProcedure(name: string) {
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
  /** Delete finished history older than `olderThanMs`, in small transactions (asyncproc.purge); returns how many executions went. */
  purge(olderThanMs: number): Promise<number> {
    return purgeFinished(this.pool, olderThanMs);
  }
  listQueues(recentSeconds?: number) {
    return listQueues(this.pool, recentSeconds);
  }
  listRunning(queue: string | null, limit: number, submittedBy?: string | null) {
    return listRunning(this.pool, queue, limit, submittedBy);
  }
  configureQueue(name: string, concurrency: number, groupCommits?: Partial<GroupCommits>) {
    return configureQueue(this.pool, name, concurrency, groupCommits);
  }

  pauseQueue(name: string, paused: boolean) {
    return pauseQueue(this.pool, name, paused);
  }
  cancelExecution(token: string) {
    return cancelExecution(this.pool, token);
  }
  getProgress(ids: readonly string[]) {
    return getProgress(this.pool, ids);
  }
  getHistory(ids: readonly string[]) {
    return getHistory(this.pool, ids);
  }
  createSchedule(input: ScheduleInput) {
    return createSchedule(this.pool, input);
  }
  updateSchedule(name: string, change: ScheduleChange) {
    return updateSchedule(this.pool, name, change);
  }
  pauseSchedule(name: string) {
    return pauseSchedule(this.pool, name);
  }
  resumeSchedule(name: string) {
    return resumeSchedule(this.pool, name);
  }
  deleteSchedule(name: string) {
    return deleteSchedule(this.pool, name);
  }
  listSchedules() {
    return listSchedules(this.pool);
  }
  getSchedule(name: string) {
    return getSchedule(this.pool, name);
  }

  async startActivator(options: ActivatorOptions): Promise<Closeable> {
    const activator = new PostgresActivator(
      {
        ...options,
        connectionString: this.options.connectionString,
        logger: this.logger,
        tickMs: this.options.tickMs,
        retentionMs: this.options.retentionMs,
        notifier: this.notifier,
        progress: this.progress,
        cutPoolConnects: () => this.cutPoolConnects(),
      },
      this.pool,
    );
    await activator.start();
    this.activators.add(activator);
    return this.closeables.track(activator, () => this.activators.delete(activator));
  }

  async startListener(sink: ListenerSink): Promise<PostgresListener> {
    const listener = new PostgresListener({
      connectionString: this.options.connectionString,
      sink,
      logger: this.logger,
      ownSender: (processId) => this.notifier.sentBy(processId),
    });
    await listener.start();
    // events of this process's own transactions: read at once, not when their NOTIFY comes back
    const local = { onChange: (own?: OwnChange) => sink.onChange(own), awaits: (token: string) => sink.awaits?.(token) ?? false };
    this.notifier.local.add(local);
    return this.closeables.track(listener, () => this.notifier.local.delete(local));
  }

  /**
   * The pool's connections on their way, cut short (its statement fails): one to a database that
   * does not answer would hold a stop for the connect timeout (30 s).
   */
  private cutPoolConnects(): void {
    this.poolOpening.forEach(cutShort);
  }

  /** Ends everything the engine opened; a second call waits for the first (pg refuses to end a pool twice). */
  close(): Promise<void> {
    this.closing ??= (async () => {
      await this.closeables.closeAll();
      // a pool connection on its way would hold the progress writes and the pool's end too
      this.cutPoolConnects();
      await this.progress.close();
      await this.notifier.close();
      await this.pool.end();
    })();
    return this.closing;
  }
  private closing: Promise<void> | undefined;
}

export function createPostgresEngine(options: PostgresEngineOptions): PostgresEngine {
  return new PostgresEngine(options);
}
