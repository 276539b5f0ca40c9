/**
 * Batches of executions in ordered stages on SQL Server (sql/mssql/0007_batches.sql;
 * docs/mssql.md, "Batches"). Not to be confused with batches.ts, which splits T-SQL
 * scripts into `GO`-separated batches.
 *
 * Submission creates the batch row (usp_AsyncExecBatchCreate) and invokes every call with
 * its batch and stage, in one transaction; usp_AsyncExecInvoke holds the calls of later
 * stages. Release happens in the database, in the transaction that ends a stage's last
 * member (usp_AsyncExecBatchSettle): nothing here waits for a stage.
 */
import { createHash } from 'node:crypto';
import sql from 'mssql';
import {
  BATCH_STATUSES,
  checkIdempotencyKey,
  EngineError,
  refuseKeysInBatch,
  type Batch,
  type BatchFailurePolicy,
  type BatchStage,
  type BatchStatus,
  type Execution,
  type InvokeCall,
  type SubmitBatchOptions,
} from '../../engine.js';
import { mapDatabaseError } from './errors.js';
import { EXECUTION_COLUMNS, toExecution, type ExecutionRow, type Queryable } from './executions.js';
import { enqueue } from './invoke.js';
import { encodeArguments, isToken } from './types.js';

const POLICIES: readonly BatchFailurePolicy[] = ['CANCEL', 'CONTINUE'];

export interface CheckedBatch {
  onFailure: BatchFailurePolicy;
  submittedBy: string | null;
  idempotencyKey: string | null;
}

/** Refuse what cannot be a batch before anything is written: no stages, an empty stage, a bad policy. */
export function checkBatch(stages: readonly (readonly InvokeCall[])[], options: SubmitBatchOptions = {}): CheckedBatch {
  if (!Array.isArray(stages) || stages.length === 0) throw new EngineError('BAD_USER_INPUT', 'a batch needs at least one stage');
  stages.forEach((calls, index) => {
    if (!Array.isArray(calls) || calls.length === 0) {
      throw new EngineError('BAD_USER_INPUT', `stage ${index + 1} of the batch has no calls`);
    }
  });
  refuseKeysInBatch(stages);
  checkIdempotencyKey(options.idempotencyKey);
  const onFailure = options.onFailure ?? 'CANCEL';
  if (!POLICIES.includes(onFailure)) throw new EngineError('BAD_USER_INPUT', `onFailure must be CANCEL or CONTINUE, not ${String(onFailure)}`);
  const submittedBy = options.submittedBy ?? null;
  if (submittedBy !== null && submittedBy.length > 256) throw new EngineError('BAD_USER_INPUT', 'submittedBy is at most 256 characters');
  return { onFailure, submittedBy, idempotencyKey: options.idempotencyKey ?? null };
}

/**
 * What a batch asks for, as usp_AsyncExecBatchCreate's @requestDigest: SHA-256 of its calls in
 * order (each as a single call's key compares it: procedure, arguments as sent, queue, runAt,
 * maxAttempts) and its failure policy. The same batch sent again gives the same digest.
 */
export function batchDigest(stages: readonly (readonly InvokeCall[])[], onFailure: BatchFailurePolicy): Buffer {
  // the arguments' text as usp_AsyncExecInvoke receives it (bigints as exact strings)
  const calls = stages.map((stage) => stage.map((c) => [c.procedure, encodeArguments(c.arguments ?? {}), c.queue ?? null, c.runAt?.getTime() ?? null, c.maxAttempts ?? null]));
  return createHash('sha256').update(JSON.stringify([calls, onFailure])).digest();
}

/**
 * Create the batch and enqueue its calls inside the caller's open transaction, in order
 * (stage by stage); returns the batch id, and whether its idempotency key replayed a batch an
 * earlier request made (then nothing was enqueued). Any refusal leaves the caller to roll back.
 */
export async function submitBatch(
  tx: sql.Transaction,
  stages: readonly (readonly InvokeCall[])[],
  options: SubmitBatchOptions = {},
): Promise<{ id: string; replayed: boolean }> {
  const { onFailure, submittedBy, idempotencyKey } = checkBatch(stages, options);
  let batchId: string;
  try {
    const result = await new sql.Request(tx)
      .input('stageCount', sql.Int, stages.length)
      .input('onFailure', sql.VarChar(8), onFailure)
      .input('submittedBy', sql.NVarChar(256), submittedBy)
      .output('batchId', sql.UniqueIdentifier)
      .input('idempotencyKey', sql.NVarChar(129), idempotencyKey)
      .input('requestDigest', sql.VarBinary(33), idempotencyKey === null ? null : batchDigest(stages, onFailure))
      .output('replayedBatchId', sql.UniqueIdentifier)
      .execute('asyncexec.usp_AsyncExecBatchCreate');
    // the key's batch, made by an earlier request: nothing more is submitted
    if (result.output.replayedBatchId) return { id: String(result.output.replayedBatchId).toLowerCase(), replayed: true };
    batchId = String(result.output.batchId).toLowerCase();
  } catch (error) {
    throw mapDatabaseError(error);
  }
  for (const [index, calls] of stages.entries()) {
    for (const call of calls) {
      // one request at a time: a transaction runs its requests in turn
      await enqueue(tx, { ...call, submittedBy: call.submittedBy ?? submittedBy }, { batchId, stage: index + 1 });
    }
  }
  return { id: batchId, replayed: false };
}

/** A batch row with one stage's counts (none when no member is left: purged). */
export interface BatchRow {
  id: string;
  status: BatchStatus;
  on_failure: BatchFailurePolicy;
  current_stage: number;
  stage_count: number;
  submitted_at: Date;
  finished_at: Date | null;
  submitted_by: string | null;
  stage: number | null;
  total: number | null;
  waiting: number | null;
  pending: number | null;
  running: number | null;
  succeeded: number | null;
  failed: number | null;
  cancelled: number | null;
}

/** The rows of one batch (one per stage that has members) as a Batch; every stage 1…stageCount is listed. */
export function toBatch(rows: readonly BatchRow[]): Batch | null {
  const first = rows[0];
  if (!first) return null;
  if (!BATCH_STATUSES.includes(first.status)) throw new Error(`batch ${first.id} has an unknown status ${first.status}`);
  const stages: BatchStage[] = Array.from({ length: first.stage_count }, (_, i) => ({
    stage: i + 1,
    total: 0,
    waiting: 0,
    pending: 0,
    running: 0,
    succeeded: 0,
    failed: 0,
    cancelled: 0,
  }));
  for (const row of rows) {
    if (row.stage === null || row.stage < 1 || row.stage > stages.length) continue;
    stages[row.stage - 1] = {
      stage: row.stage,
      total: row.total ?? 0,
      waiting: row.waiting ?? 0,
      pending: row.pending ?? 0,
      running: row.running ?? 0,
      succeeded: row.succeeded ?? 0,
      failed: row.failed ?? 0,
      cancelled: row.cancelled ?? 0,
    };
  }
  return {
    id: first.id.toLowerCase(), // the driver spells GUIDs in capitals; ids are lower case everywhere
    status: first.status,
    onFailure: first.on_failure,
    currentStage: first.current_stage,
    stageCount: first.stage_count,
    submittedAt: first.submitted_at,
    finishedAt: first.finished_at,
    submittedBy: first.submitted_by,
    stages,
  };
}

function batchId(id: string): string {
  if (typeof id !== 'string' || !isToken(id)) throw new EngineError('BAD_USER_INPUT', `malformed batch id "${String(id)}"`);
  return id;
}

/** The batch with its per-stage counts, read in one statement (one snapshot under RCSI); null when there is none. */
export async function getBatch(db: Queryable, id: string): Promise<Batch | null> {
  const req = new sql.Request(db as sql.ConnectionPool);
  req.input('id', sql.UniqueIdentifier, batchId(id));
  const result = await req.query<BatchRow>(
    `SELECT b.id, b.status, b.on_failure, b.current_stage, b.stage_count, b.submitted_at, b.finished_at, b.submitted_by,
            s.stage, s.total, s.waiting, s.pending, s.running, s.succeeded, s.failed, s.cancelled
       FROM asyncexec.AsyncExecBatches AS b
       OUTER APPLY (SELECT e.stage, COUNT(*) AS total,
                           COUNT(CASE WHEN e.status = 'WAITING' THEN 1 END) AS waiting,
                           COUNT(CASE WHEN e.status = 'PENDING' THEN 1 END) AS pending,
                           COUNT(CASE WHEN e.status = 'RUNNING' THEN 1 END) AS running,
                           COUNT(CASE WHEN e.status = 'SUCCEEDED' THEN 1 END) AS succeeded,
                           COUNT(CASE WHEN e.status = 'FAILED' THEN 1 END) AS failed,
                           COUNT(CASE WHEN e.status = 'CANCELLED' THEN 1 END) AS cancelled
                      FROM asyncexec.AsyncExecResults AS e
                     WHERE e.batch_id = b.id
                     GROUP BY e.stage) AS s
      WHERE b.id = @id
      ORDER BY s.stage`,
  );
  return toBatch(result.recordset);
}

/** The batch's executions by stage, then submission order; [] for a batch that does not exist. */
export async function getBatchExecutions(db: Queryable, id: string): Promise<Execution[]> {
  const req = new sql.Request(db as sql.ConnectionPool);
  req.input('id', sql.UniqueIdentifier, batchId(id));
  const result = await req.query<ExecutionRow>(
    `SELECT ${EXECUTION_COLUMNS} FROM asyncexec.AsyncExecResults AS e WHERE e.batch_id = @id ORDER BY e.stage, e.id`,
  );
  return result.recordset.map(toExecution);
}
