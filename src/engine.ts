/**
 * The engine interface: the only boundary that knows a database dialect.
 * Everything above it (GraphQL schema, completion hub, server) is written once;
 * the PostgreSQL and SQL Server engines both implement it and both pass the
 * conformance suite in test/conformance.ts.
 */

import type { Snapshot } from './changeCursor.js';

export const EXECUTION_STATUSES = ['WAITING', 'PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED'] as const;
export type ExecutionStatus = (typeof EXECUTION_STATUSES)[number];
export const TERMINAL_STATUSES: ReadonlySet<ExecutionStatus> = new Set(['SUCCEEDED', 'FAILED', 'CANCELLED']);

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

/** Tokens and batch ids are UUIDs. */
export function isUuid(text: string): boolean {
  return UUID.test(text);
}

export function isTerminal(status: ExecutionStatus): boolean {
  return TERMINAL_STATUSES.has(status);
}

/** One requested call, as a client submits it. */
export interface InvokeCall {
  /** Registered procedure name, schema-qualified (`demo.add`). */
  procedure: string;
  /** Arguments keyed by parameter name. */
  arguments: Record<string, unknown>;
  /** Queue name; defaults to the procedure's registered queue. */
  queue?: string | null;
  /** Do not start before this instant. */
  runAt?: Date | null;
  /** Attempts in all; defaults to the procedure's registration. */
  maxAttempts?: number | null;
  /** Who submitted the call: the verified subject (or, with auth off, what the caller said). Recorded. */
  submittedBy?: string | null;
  /**
   * The caller's roles, checked by the engine against the procedure's registered roles
   * (FORBIDDEN, nothing enqueued, when the procedure names roles and the caller holds
   * none of them and is not `admin`). null/absent: not checked (anonymous development
   * mode, SQL callers of the database functions).
   */
  callerRoles?: readonly string[] | null;
  /**
   * The caller's key for this call (checkIdempotencyKey): the same key sent again by the same caller
   * (`submittedBy`) with the same call returns the execution the first one made, and submits
   * nothing; with another call it is refused (IDEMPOTENCY_KEY_REUSED). While another transaction
   * that has not ended holds it, `submit` refuses it at once (IDEMPOTENCY_KEY_IN_USE, transient:
   * send it again shortly), and so does SQL Server's `invoke`; PostgreSQL's `invoke(tx, call)`
   * waits for that transaction, as for a row lock. Held as long as that execution's history is
   * kept. Not taken by a batch's calls.
   */
  idempotencyKey?: string | null;
}

export interface ExecutionError {
  /** SQLSTATE on PostgreSQL, error number on SQL Server (as text). */
  number: string | null;
  message: string;
  severity: number | null;
  state: number | null;
  line: number | null;
  /** PostgreSQL's DETAIL (null on SQL Server). */
  detail: string | null;
  /** Where it happened: PostgreSQL's CONTEXT (the call stack), SQL Server's ERROR_PROCEDURE(). */
  context: string | null;
}

export interface ExecutionResult {
  returnValue: unknown;
  /** OUT / INOUT / OUTPUT parameters keyed by name (no leading `@`). */
  outputParameters: Record<string, unknown> | null;
  /** The first result set's rows, at most the configured cap (ASYNCPROC_MAX_ROWS). */
  rows: unknown[] | null;
  /** Rows the routine produced (more than `rows` holds when truncated); null when it returned no result set or the engine does not count. */
  rowCount: number | null;
  /** Whether `rows` was cut at the cap; null when not known (SQL Server, or results recorded before it was tracked). */
  truncated: boolean | null;
}

/**
 * A stored outcome as an ExecutionResult. Outcomes recorded before rowCount/truncated
 * existed say nothing about a cut: unknown, except that no rows cannot have been cut.
 */
export function toExecutionResult(stored: Partial<ExecutionResult>): ExecutionResult {
  const rows = stored.rows ?? null;
  return {
    returnValue: stored.returnValue ?? null,
    outputParameters: stored.outputParameters ?? null,
    rows,
    rowCount: stored.rowCount ?? null,
    truncated: stored.truncated ?? (rows === null ? false : null),
  };
}

export interface Execution {
  /** Internal numeric id, as text (stable order: larger is newer). */
  id: string;
  token: string;
  procedure: string;
  arguments: Record<string, unknown>;
  queue: string;
  status: ExecutionStatus;
  submittedAt: Date;
  runAt: Date | null;
  startedAt: Date | null;
  finishedAt: Date | null;
  attempts: number;
  maxAttempts: number;
  submittedBy: string | null;
  /** The schedule that submitted it (null: a client did). */
  schedule: string | null;
  error: ExecutionError | null;
  result: ExecutionResult | null;
  /** Who ran (or runs) it: worker id on PostgreSQL, `session <spid>` on SQL Server. */
  worker: string | null;
  /** Database session that ran it: backend pid (PostgreSQL) or session id (SQL Server). */
  sessionId: number | null;
  /** Change cursor of the row's latest status change (sequence value / rowversion as text). */
  cursor: string;
  /** The batch it belongs to (null: submitted on its own). */
  batchId: string | null;
  /** Its stage in that batch, 1-based (null outside a batch). */
  stage: number | null;
  /**
   * The latest progress its current (or last) attempt reported, when already read (a
   * progress event carries it); absent: not read with the row (see Engine.getProgress).
   */
  progress?: ExecutionProgress | null;
}

/** How far a running call says it has got (asyncproc.progress() on PostgreSQL). */
export interface ExecutionProgress {
  /** 0–100. */
  percent: number;
  /** A short message, or null: at most 200 characters on PostgreSQL, 54 on SQL Server (it travels in CONTEXT_INFO). */
  message: string | null;
  /** When it was stored, by the database's clock. */
  at: Date;
}

export const BATCH_STATUSES = ['RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED'] as const;
/** RUNNING until every execution has ended; then FAILED if any failed, else CANCELLED if any was cancelled, else SUCCEEDED. */
export type BatchStatus = (typeof BATCH_STATUSES)[number];

/** CANCEL: the first execution that ends other than SUCCEEDED cancels every one not yet started. CONTINUE: later stages run anyway. */
export type BatchFailurePolicy = 'CANCEL' | 'CONTINUE';

/** Counts of one stage's executions by status. */
export interface BatchStage {
  /** 1-based. */
  stage: number;
  total: number;
  waiting: number;
  pending: number;
  running: number;
  succeeded: number;
  failed: number;
  cancelled: number;
}

/** Executions grouped in ordered stages: stage n+1 is released when every execution of stage n has ended. */
export interface Batch {
  id: string;
  status: BatchStatus;
  onFailure: BatchFailurePolicy;
  /** The stage released last (1 … stageCount). */
  currentStage: number;
  stageCount: number;
  submittedAt: Date;
  finishedAt: Date | null;
  submittedBy: string | null;
  stages: BatchStage[];
}

export interface SubmitBatchOptions {
  onFailure?: BatchFailurePolicy | null;
  submittedBy?: string | null;
  /**
   * The caller's key for this batch (checkIdempotencyKey), as InvokeCall.idempotencyKey is for a
   * call: the same batch sent again with it gets the batch the first one made, and nothing is
   * submitted; another batch with it is refused (IDEMPOTENCY_KEY_REUSED); one a transaction that
   * has not ended holds is refused at once (IDEMPOTENCY_KEY_IN_USE). Apart from single calls' keys.
   * Held as long as the batch is.
   */
  idempotencyKey?: string | null;
}

/** An execution that is RUNNING now, with how long it has run by the database's clock. */
export interface RunningExecution {
  execution: Execution;
  elapsedMs: number;
}

/** How many executions of a queue ended, by outcome, within a recent window. */
export interface OutcomeCounts {
  succeeded: number;
  failed: number;
  cancelled: number;
}

export type ParameterMode = 'IN' | 'OUT' | 'INOUT';

export interface ProcedureParameter {
  name: string;
  /** The database's own type name (`integer`, `nvarchar(50)`, …). */
  type: string;
  mode: ParameterMode;
  hasDefault: boolean;
  position: number;
}

export interface Procedure {
  name: string;
  parameters: ProcedureParameter[];
  queue: string;
  maxAttempts: number;
  timeoutMs: number | null;
  /** Roles that may invoke it (any one of them, or `admin`); empty: any authenticated caller. */
  roles: string[];
  /** See RegisterOptions.transactional. */
  transactional: boolean;
}

/**
 * The ranges of a registration both engines store (maxAttempts 1–100, timeoutMs 1 ms to the
 * largest int4), refused as BAD_USER_INPUT before the database's own constraint would fail the
 * statement as an unexpected error.
 */
export function checkRegisterRanges(options: Pick<RegisterOptions, 'maxAttempts' | 'timeoutMs'>): void {
  const { maxAttempts, timeoutMs } = options;
  if (maxAttempts !== undefined && (!Number.isInteger(maxAttempts) || maxAttempts < 1 || maxAttempts > 100)) {
    throw new EngineError('BAD_USER_INPUT', `maxAttempts must be between 1 and 100, got ${maxAttempts}`);
  }
  if (timeoutMs !== undefined && timeoutMs !== null && (!Number.isInteger(timeoutMs) || timeoutMs < 1 || timeoutMs > 2_147_483_647)) {
    throw new EngineError('BAD_USER_INPUT', `timeoutMs must be at least 1 (or absent: no timeout), got ${timeoutMs}`);
  }
}

export interface RegisterOptions {
  queue?: string;
  maxAttempts?: number;
  timeoutMs?: number | null;
  /** Roles that may invoke it; empty or absent: any authenticated caller. Names as ROLE_NAME. */
  roles?: readonly string[] | null;
  /**
   * true (default): the call runs inside the transaction that records its outcome, so its
   * effects and its outcome commit together, or neither. false: the call runs with no
   * transaction open (it may COMMIT itself, commit in chunks, or run what cannot run in a
   * transaction: VACUUM, BACKUP, CREATE DATABASE …) and its outcome is recorded afterwards
   * in a transaction of its own. Given up: effects and outcome no longer commit together,
   * so a call whose worker is lost mid-run ends FAILED (never re-run: its effects may be
   * partly done), and a retried failure re-runs what the failed attempt had committed.
   */
  transactional?: boolean;
}

/** Role names (JWT claims, API keys, procedure permissions): 1–64 of A-Z a-z 0-9 _ . : - */
export const ROLE_NAME = /^[A-Za-z0-9_.:-]{1,64}$/;
/** Register procedures, configure queues, manage API keys, see and cancel everything. */
export const ADMIN_ROLE = 'admin';
/** See and cancel everything. */
export const OPERATOR_ROLE = 'operator';

/** A stored API key (never its secret: only a SHA-256 hash of it is kept). */
export interface ApiKey {
  id: string;
  name: string;
  roles: string[];
  /** The first characters of the secret (`apk_abcd`), so an operator can tell keys apart. */
  prefix: string;
  createdAt: Date;
  createdBy: string | null;
  lastUsedAt: Date | null;
  /** When it stopped working; a rotated key's lies ahead until its overlap with its successor ends. */
  revokedAt: Date | null;
}

/** Whether a key works now: not revoked, or rotated and still within its overlap (its revokedAt ahead). */
export function apiKeyActive(key: ApiKey, now = Date.now()): boolean {
  return key.revokedAt === null || key.revokedAt.getTime() > now;
}

/** The longest a rotated key goes on working beside its successor: 30 days. */
export const MAX_ROTATION_OVERLAP_SECONDS = 30 * 24 * 3600;

/** A key's secret as stored: its hash and first characters, and who made it. */
export type ApiKeySecret = Pick<NewApiKey, 'secretHash' | 'prefix' | 'createdBy'>;

export interface NewApiKey {
  /** 1–128 characters, unique among keys not revoked (BAD_USER_INPUT otherwise). */
  name: string;
  roles: readonly string[];
  /** Lower-case hex SHA-256 of the secret. */
  secretHash: string;
  prefix: string;
  createdBy: string | null;
}

/**
 * Grouped commits of a queue: a worker runs up to `size` short transactional calls in one
 * transaction, each under its own savepoint, closing the group once `maxMs` have passed.
 * size 1: one transaction per call.
 */
export interface GroupCommits {
  /** Calls at most in one transaction (1–1000). @default 1 */
  size: number;
  /** No call joins a group begun longer ago than this (1–10000 ms). @default 50 */
  maxMs: number;
}

export interface QueueInfo {
  name: string;
  concurrency: number;
  /** Paused: its calls are taken and wait PENDING; none starts until it is resumed (pauseQueue). */
  paused: boolean;
  groupCommits: GroupCommits;
  waiting: number;
  pending: number;
  running: number;
  /** Executions that ended within the last `recentSeconds`, by outcome. */
  recent: OutcomeCounts;
  recentSeconds: number;
}

/** One attempt of an execution, as the execution log records it. */
export interface Attempt {
  /** 1, 2, …; a run lost with its worker and started again is logged too, with status LOST. */
  number: number;
  status: 'RUNNING' | 'SUCCEEDED' | 'FAILED' | 'CANCELLED' | 'LOST';
  startedAt: Date;
  finishedAt: Date | null;
  /** Who ran it (worker id on PostgreSQL, `session <spid>` on SQL Server). */
  worker: string | null;
  /** Backend pid (PostgreSQL) or session id (SQL Server). */
  sessionId: number | null;
  error: ExecutionError | null;
}

export interface ExecutionFilter {
  status?: ExecutionStatus[] | null;
  procedure?: string | null;
  queue?: string | null;
  /** Only executions submitted by this subject: a plain caller's view of its own work. */
  submittedBy?: string | null;
  /** Only executions started by this schedule. */
  schedule?: string | null;
}

/** ALLOW: fire on time regardless. SKIP: no fire while the schedule's previous execution has not ended. */
export type ScheduleOverlap = 'ALLOW' | 'SKIP';
/** Instants missed while nothing ran: ONCE fires once on the next start, SKIP fires none. */
export type ScheduleCatchUp = 'ONCE' | 'SKIP';

/** A procedure started at the instants of a cron expression in a time zone. */
export interface Schedule {
  name: string;
  procedure: string;
  arguments: Record<string, unknown>;
  /** Five fields (minute hour day-of-month month day-of-week), or six with seconds first. */
  cron: string;
  /** IANA time zone the cron expression is read in. */
  timezone: string;
  /** null: the procedure's registered queue at each fire. */
  queue: string | null;
  maxAttempts: number | null;
  overlap: ScheduleOverlap;
  catchUp: ScheduleCatchUp;
  paused: boolean;
  /** The next instant it fires at (null while paused). */
  nextRunAt: Date | null;
  /** When it last fired. */
  lastRunAt: Date | null;
  createdAt: Date;
  createdBy: string | null;
}

/** createSchedule's input; updateSchedule takes the same fields but the name, each optional. */
export interface ScheduleInput {
  name: string;
  procedure: string;
  arguments: Record<string, unknown>;
  cron: string;
  /** @default "UTC" */
  timezone?: string | null;
  queue?: string | null;
  maxAttempts?: number | null;
  /** @default "ALLOW" */
  overlap?: ScheduleOverlap | null;
  /** @default "ONCE" */
  catchUp?: ScheduleCatchUp | null;
  /** Recorded; its fires are submitted by this subject. */
  createdBy?: string | null;
  /** Checked against the procedure's roles at create/update, as for invoke. */
  callerRoles?: readonly string[] | null;
}

export type ScheduleChange = Partial<Omit<ScheduleInput, 'name' | 'createdBy'>>;

/** Keyset page request over executions, newest first. Cursors are execution ids. */
export interface PageRequest {
  first?: number | null;
  after?: string | null;
  last?: number | null;
  before?: string | null;
}

export interface ExecutionPage {
  items: Execution[];
  hasNextPage: boolean;
  hasPreviousPage: boolean;
}

/**
 * A status change as a subscriber sees it. `execution` is the row as that change left it
 * and `status` is its status (they always agree); `cursor` resumes a stream right after it.
 */
export interface ExecutionEvent {
  cursor: string;
  status: ExecutionStatus;
  execution: Execution;
}

/** One change of an execution row, as the change feed reads it (see changeCursor.ts). */
export interface Change {
  /** The writer that made it: transaction id (PostgreSQL) or rowversion (SQL Server). */
  writer: bigint;
  /** Its order among one writer's changes; per execution it grows with every change. */
  order: bigint;
  /** The row as this change left it. */
  execution: Execution;
}

export interface ChangePage {
  /** The snapshot the read saw: the page holds only changes it sees. */
  position: Snapshot;
  /** In (writer, order) order. */
  changes: Change[];
}

export interface ChangeRead {
  filter?: ExecutionFilter;
  limit: number;
  /** Only changes this snapshot sees (the later pages of one read); default: the read's own snapshot. */
  upTo?: Snapshot;
  /** Only changes after this one, in (writer, order) order (the next page). */
  after?: { writer: bigint; order: bigint };
}

/** A change this process committed, as its worker tells it (see ListenerSink.onChange). */
export interface OwnChange {
  terminal: boolean;
  /** The execution as the commit left it: only for an end a subscriber of this process awaits. */
  execution?: Execution;
}

/** Where a listener says that something may have changed. Hints only: the table is the truth. */
export interface ListenerSink {
  /**
   * A change was heard (or may have been missed, after a reconnect): read the change feed.
   * `own`: a change this process itself committed, told before any notification (trusted,
   * unlike a payload): whether it ended its execution, and when it did and `awaits` asked for
   * it, the execution as that commit left it. Absent: read.
   */
  onChange(own?: OwnChange): void;
  /**
   * Whether a subscriber here waits for this call's end: a worker of this process that ends it
   * then hands the ended execution with the change (onChange), and the subscriber hears it
   * without a read of the change feed.
   */
  awaits?(token: string): boolean;
  onError(error: Error): void;
  /** A progress report of this execution was stored (a hint: read it with Engine.getProgress). */
  onProgress?(executionId: string): void;
  /** The listener heard from the database just now (connected, or a round trip of its own succeeded): readiness and lag. */
  onHeartbeat?(): void;
}

/** Where the database's schema stands against the migrations this service carries. */
export interface SchemaVersion {
  /** The highest migration recorded in the database (null: none, the schema is missing). */
  applied: number | null;
  /** The highest migration among the service's files. */
  expected: number;
}

export interface Closeable {
  close(): Promise<void>;
}

export interface ActivatorOptions {
  /** Identifies this process in `Execution.worker`. */
  workerId: string;
  /** Only serve these queues (all when absent). */
  queues?: string[];
  /** Rows of a call's first result set kept in its result (PostgreSQL: run()'s row_cap). @default 100 */
  maxRows?: number;
  /**
   * On stop, how long calls running in this process are waited for; then the transactional ones
   * are handed back (their statement cancelled, rolled back, PENDING again at once, to run again
   * from the start here or on another worker). Calls that run outside a transaction are always
   * waited for. PostgreSQL only (SQL Server's calls run in the database). @default Infinity
   */
  stopGraceMs?: number;
  onError?: (error: Error) => void;
}

/** Expected failures, mapped one to one onto GraphQL `extensions.code`. */
export type EngineErrorCode =
  | 'UNKNOWN_PROCEDURE'
  | 'INVALID_ARGUMENTS'
  | 'UNKNOWN_QUEUE'
  | 'BAD_USER_INPUT'
  | 'NOT_FOUND'
  | 'FORBIDDEN'
  | 'PAYLOAD_TOO_LARGE'
  /** cancelExecution on an execution that already ended. */
  | 'ALREADY_FINISHED'
  /** An event stream whose subscriber fell too far behind was ended; resume from the last cursor with `after`. */
  | 'SLOW_CONSUMER'
  /**
   * A cursor ahead of the database: it names writers the database has not had (a failover that
   * lost commits, a restored backup, another database's cursor). Nothing can be resumed from it:
   * subscribe without `after` and read the current state.
   */
  | 'CURSOR_AHEAD'
  /**
   * A cursor older than the retention: a call whose change it may not have read has since been
   * purged. Nothing can be resumed from it without a silent gap: subscribe without `after` and
   * read the current state.
   */
  | 'CURSOR_EXPIRED'
  /** The engine cannot honour the setting asked for (grouped commits on SQL Server); nothing was changed. */
  | 'NOT_SUPPORTED'
  /** An idempotency key the caller sent before with another call; nothing was submitted. */
  | 'IDEMPOTENCY_KEY_REUSED'
  /** An idempotency key another transaction holds (a request with it still under way); nothing was submitted: send it again shortly. */
  | 'IDEMPOTENCY_KEY_IN_USE';

/** Half of a surrogate pair: a high one not followed by a low one, or a low one not preceded by a high one (neither database nor UTF-8 holds one). */
export const LONE_SURROGATE = /[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/;

/** Longest idempotency key, in UTF-16 code units (SQL Server keeps it as nvarchar(128)). */
export const MAX_IDEMPOTENCY_KEY = 128;

/** BAD_USER_INPUT unless `key` is absent or 1–128 characters, no control character, no white space at either end (InvokeCall.idempotencyKey). */
export function checkIdempotencyKey(key: unknown): void {
  if (key === undefined || key === null) return;
  if (typeof key !== 'string') throw new EngineError('BAD_USER_INPUT', `idempotencyKey must be a string, not ${typeof key}`);
  if (key.length < 1 || key.length > MAX_IDEMPOTENCY_KEY) throw new EngineError('BAD_USER_INPUT', `idempotencyKey must be 1 to ${MAX_IDEMPOTENCY_KEY} characters`);
  // SQL Server's = ignores trailing blanks ("k " would be "k"): refused on both engines alike
  if (key !== key.trim()) throw new EngineError('BAD_USER_INPUT', 'idempotencyKey must not begin or end with white space');
  // control characters, and half of a surrogate pair (neither database stores one as sent)
  if (/[\u0000-\u001f\u007f-\u009f]/.test(key) || LONE_SURROGATE.test(key)) {
    throw new EngineError('BAD_USER_INPUT', 'idempotencyKey holds a control character or half of a surrogate pair');
  }
}

/**
 * What an idempotency key replayed, gone before it was read back: retention purged it meanwhile,
 * which also freed the key. Transient: sent again, it is made anew.
 */
export function purgedWhileReplayed(key: string | null | undefined, what: 'batch' | 'call' = 'batch'): EngineError {
  return new EngineError('IDEMPOTENCY_KEY_IN_USE', `the ${what} idempotency key "${key}" made was being purged as it was replayed: send the ${what} again`);
}

/** Executions and batches that an idempotency key returned as an earlier request made them (markReplayed). */
const REPLAYED = new WeakSet<object>();

/** Mark what submit, invoke or submitBatch returns as a replay: nothing was submitted, an earlier request made it. */
export function markReplayed<T extends object>(made: T): T {
  REPLAYED.add(made);
  return made;
}

/**
 * Whether `made`, as submit, invoke or submitBatch returned it, is what an earlier request made
 * with the same idempotency key (nothing was submitted this time). False for anything else,
 * including the same execution read again later.
 */
export function isReplayed(made: object): boolean {
  return REPLAYED.has(made);
}

/** BAD_USER_INPUT if a call of the batch carries an idempotency key: a batch's calls take none. */
export function refuseKeysInBatch(stages: readonly (readonly InvokeCall[])[]): void {
  if (stages.some((calls) => Array.isArray(calls) && calls.some((call) => call?.idempotencyKey != null))) {
    throw new EngineError('BAD_USER_INPUT', "a batch's calls take no idempotency key: give the batch one (submitBatch's idempotencyKey)");
  }
}

export class EngineError extends Error {
  constructor(
    readonly code: EngineErrorCode,
    message: string,
    options?: { cause?: unknown },
  ) {
    super(message, options);
    this.name = 'EngineError';
  }
}

/** The grouping of a queue that says nothing: one transaction per call. */
export const NO_GROUP_COMMITS: GroupCommits = { size: 1, maxMs: 50 };

/** BAD_USER_INPUT unless each given field is in range (size 1–1000, maxMs 1–10000). */
export function checkGroupCommits({ size, maxMs }: Partial<GroupCommits>): void {
  if (size !== undefined && (!Number.isInteger(size) || size < 1 || size > 1000)) {
    throw new EngineError('BAD_USER_INPUT', `groupCommits.size must be a whole number from 1 to 1000, not ${size}`);
  }
  if (maxMs !== undefined && (!Number.isInteger(maxMs) || maxMs < 1 || maxMs > 10_000)) {
    throw new EngineError('BAD_USER_INPUT', `groupCommits.maxMs must be a whole number from 1 to 10000, not ${maxMs}`);
  }
}

/** Coerce an unknown caught value to an Error, keeping the original as cause. */
export function toError(value: unknown): Error {
  if (value instanceof Error) return value;
  return new Error(typeof value === 'string' ? value : JSON.stringify(value), { cause: value });
}

/**
 * One database dialect. `Tx` is the engine's transaction handle: a `pg` client
 * inside BEGIN for PostgreSQL, an `mssql` Transaction for SQL Server.
 */
export interface Engine<Tx = unknown> {
  readonly kind: 'postgres' | 'mssql';
  /** Apply pending migrations (idempotent, safe when two processes start at once). */
  migrate(): Promise<void>;
  /** One cheap round trip (readiness): the schema version recorded in the database against the files'. */
  schemaVersion(): Promise<SchemaVersion>;
  /** Install and register the demo procedures (`demo.sleep`, `demo.fail`, `demo.add`, `demo.record`). */
  installDemo(): Promise<void>;
  /** Run `fn` in a new transaction: commit when it resolves, roll back when it throws. */
  withTransaction<T>(fn: (tx: Tx) => Promise<T>): Promise<T>;
  /** Enqueue inside the caller's open transaction; nothing is visible until it commits. */
  invoke(tx: Tx, call: InvokeCall): Promise<Execution>;
  /** Optional fast path: enqueue all of `calls` in one new transaction, all or none (in order). */
  submit?(calls: readonly InvokeCall[]): Promise<Execution[]>;
  getExecution(token: string): Promise<Execution | null>;
  getExecutions(tokens: readonly string[]): Promise<Execution[]>;
  /**
   * Whether a failed database request may succeed if only tried again later: the connection was
   * lost or refused, the database is restarting or failing over, the request lost a deadlock or
   * timed out. Not: a missing table, a permission denied, a bad statement (those wait for a
   * person). A subscriber's first read retries the first kind and fails at once on the second.
   */
  isTransient(error: unknown): boolean;
  listExecutions(filter: ExecutionFilter, page: PageRequest): Promise<ExecutionPage>;
  countExecutions(filter: ExecutionFilter): Promise<number>;
  /**
   * The change feed: the latest change of every execution that `since` does not see,
   * at most `read.limit`, in (writer, order) order, with the snapshot the read saw.
   */
  readChanges(since: Snapshot, read: ChangeRead): Promise<ChangePage>;
  /** The feed's position now: a reader there has nothing older left to read. */
  currentPosition(): Promise<Snapshot>;
  /**
   * The newest writer of any execution retention has deleted (null: none yet). A position
   * whose xmin is not past it may not see a change that is gone: a resume from it is refused
   * (CURSOR_EXPIRED).
   */
  purgeHorizon(): Promise<bigint | null>;
  listProcedures(): Promise<Procedure[]>;
  /** Register (or re-register, replacing its options) a procedure. Errors: UNKNOWN_PROCEDURE, UNKNOWN_QUEUE, BAD_USER_INPUT. */
  registerProcedure(name: string, options?: RegisterOptions): Promise<Procedure>;
  /** Remove a registration (the routine itself stays); executions already submitted still run. NOT_FOUND when not registered. */
  unregisterProcedure(name: string): Promise<Procedure>;
  /** Store a new API key; BAD_USER_INPUT for a bad or duplicate name or a bad role name. */
  createApiKey(key: NewApiKey): Promise<ApiKey>;
  /** Every key, revoked ones too, newest first. */
  listApiKeys(): Promise<ApiKey[]>;
  /**
   * Revoke a key (it stops working at once; a rotated key's overlap ends now); NOT_FOUND for an
   * unknown id, the key as it is when already revoked.
   */
  revokeApiKey(id: string): Promise<ApiKey>;
  /**
   * Give a live key a successor with its name and roles (the same caller), in one transaction:
   * the old key goes on working for `overlapSeconds` (0: it stops at once), so a service moves
   * to the new secret without a gap. NOT_FOUND for an unknown id; BAD_USER_INPUT for a key
   * revoked or rotated already, or an overlap out of 0–MAX_ROTATION_OVERLAP_SECONDS.
   */
  rotateApiKey(id: string, successor: ApiKeySecret, overlapSeconds: number): Promise<{ key: ApiKey; previous: ApiKey }>;
  /** The key whose secret hashes to `secretHash`, if not revoked (and record its use, at most once a minute). */
  findApiKey(secretHash: string): Promise<ApiKey | null>;
  /** Every queue with its counts; `recent` covers executions that ended within the last `recentSeconds` (default 3600). */
  listQueues(recentSeconds?: number): Promise<QueueInfo[]>;
  /**
   * Create a named queue or change its concurrency limit (1–1000) and, where given, its grouped
   * commits (an omitted field keeps its value); BAD_USER_INPUT for a bad name, limit or grouping,
   * NOT_SUPPORTED for a grouping the engine cannot honour. Nothing changes on either error.
   */
  configureQueue(name: string, concurrency: number, groupCommits?: Partial<GroupCommits>): Promise<QueueInfo>;
  /**
   * Pause a queue (paused true) or resume it. Paused, it still takes calls, which wait PENDING;
   * none of its calls starts in any worker process from the pause on (calls running then end as
   * they would; one already claimed is given back). Cancels, retries' backoff, batches and
   * schedules go on. NOT_FOUND for an unknown queue.
   */
  pauseQueue(name: string, paused: boolean): Promise<QueueInfo>;
  /** Executions RUNNING now (optionally of one queue), longest-running first, with elapsed time by the database clock. */
  listRunning(queue: string | null, limit: number, submittedBy?: string | null): Promise<RunningExecution[]>;
  /**
   * Submit a batch in one new transaction, all or none: `stages[0]` is released at once,
   * each later stage when every execution of the one before has ended (released by
   * whoever records that last outcome, in the same transaction). Errors as for invoke;
   * BAD_USER_INPUT for no stages or an empty stage.
   */
  submitBatch(stages: readonly (readonly InvokeCall[])[], options?: SubmitBatchOptions): Promise<Batch>;
  getBatch(id: string): Promise<Batch | null>;
  /**
   * Cancel a whole batch: every execution not yet started ends CANCELLED (it never starts);
   * every RUNNING one is cancelled as cancelExecution does (PostgreSQL: pg_cancel_backend;
   * SQL Server: KILL only where allowed, else it runs to its end). The batch then ends
   * CANCELLED (FAILED if an execution had failed). Resolves with the batch as it is then
   * (after waiting a little for running executions to stop). NOT_FOUND for an unknown id,
   * ALREADY_FINISHED for a batch that has ended.
   */
  cancelBatch(id: string): Promise<Batch>;
  /** The batch's executions, by stage then submission order. */
  getBatchExecutions(id: string): Promise<Execution[]>;
  /**
   * Cancel an execution. WAITING/PENDING: CANCELLED, it never starts. RUNNING: the database
   * is asked to cancel the running statement (where the service has that right; else
   * FORBIDDEN) and the call ends CANCELLED, its own writes rolled back. Already ended:
   * ALREADY_FINISHED. Unknown token: NOT_FOUND. Resolves with the execution as it is then.
   */
  cancelExecution(token: string): Promise<Execution>;
  /**
   * Retention: delete finished history older than `olderThanMs`, in small transactions,
   * never an unfinished execution nor any part of a batch that has not ended before the
   * cutoff. Returns how many executions went. (The activator or sweeper runs it periodically.)
   */
  purge(olderThanMs: number): Promise<number>;
  /**
   * The latest progress each execution (by id) reported during its current or last attempt;
   * executions with none are absent. An engine without live progress omits it.
   */
  getProgress?(executionIds: readonly string[]): Promise<Map<string, ExecutionProgress>>;
  /**
   * Create a schedule. Its arguments are checked against the procedure's signature as invoke
   * checks them (same codes); BAD_USER_INPUT for a malformed cron expression or time zone,
   * a bad or taken name. Nothing is created when anything is refused.
   */
  createSchedule(input: ScheduleInput): Promise<Schedule>;
  /** Change a schedule (checked as at create); a new cron or time zone computes its next run again. NOT_FOUND for an unknown name. */
  updateSchedule(name: string, change: ScheduleChange): Promise<Schedule>;
  /** Stop firing (instants passed while paused never fire). NOT_FOUND for an unknown name. */
  pauseSchedule(name: string): Promise<Schedule>;
  /** Fire again from the next instant after now. NOT_FOUND for an unknown name. */
  resumeSchedule(name: string): Promise<Schedule>;
  /** Remove a schedule (its executions stay). NOT_FOUND for an unknown name. */
  deleteSchedule(name: string): Promise<Schedule>;
  listSchedules(): Promise<Schedule[]>;
  getSchedule(name: string): Promise<Schedule | null>;
  /** The execution log: every attempt of each execution (by execution id), oldest first. */
  getHistory(executionIds: readonly string[]): Promise<Map<string, Attempt[]>>;
  /** Start running calls in this process (PostgreSQL worker pool; SQL Server: activation is in the database). */
  startActivator(options: ActivatorOptions): Promise<Closeable>;
  /** Start the background listener that feeds completion events. */
  startListener(sink: ListenerSink): Promise<Closeable>;
  close(): Promise<void>;
}
