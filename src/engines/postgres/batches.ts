import type pg from 'pg';
import { checkIdempotencyKey, EngineError, isUuid, refuseKeysInBatch, type Batch, type BatchStage, type Execution, type InvokeCall, type SubmitBatchOptions } from '../../engine.js';
import { mapSubmitError } from './errors.js';
import { callsAsJson, checkArguments } from './invoke.js';
import { EXECUTION_COLUMNS, toExecution, type ExecutionRow } from './rows.js';

/** Shape checks that need no database (the database repeats them for plain-SQL callers). */
export function checkStages(stages: readonly (readonly InvokeCall[])[]): void {
  if (!stages.length) throw new EngineError('BAD_USER_INPUT', 'a batch needs at least one stage');
  refuseKeysInBatch(stages);
  stages.forEach((calls, i) => {
    if (!calls.length) throw new EngineError('BAD_USER_INPUT', `stage ${i + 1} of the batch has no calls`);
    calls.forEach(checkArguments);
  });
}

/**
 * The whole batch in one statement (one transaction): all or none. Returns its executions in order,
 * and whether its idempotency key replayed a batch an earlier request made (its calls were made
 * before this statement began).
 */
export async function submitBatch(
  pool: pg.Pool,
  stages: readonly (readonly InvokeCall[])[],
  options: SubmitBatchOptions = {},
): Promise<{ executions: Execution[]; replayed: boolean }> {
  checkStages(stages);
  checkIdempotencyKey(options.idempotencyKey);
  try {
    // key_wait false: a key another transaction holds is refused at once (AP013), as for a single call
    const { rows } = await pool.query<ExecutionRow & { replayed: boolean }>(
      `select ${EXECUTION_COLUMNS}, e.submitted_at < statement_timestamp() as replayed
         from asyncproc.submit_batch($1::jsonb, $2, $3, true, $4, false) e`,
      [JSON.stringify(stages.map(callsAsJson)), options.onFailure ?? 'CANCEL', options.submittedBy ?? null, options.idempotencyKey ?? null],
    );
    return { executions: rows.map(toExecution), replayed: options.idempotencyKey != null && rows[0]?.replayed === true };
  } catch (error) {
    throw mapSubmitError(error);
  }
}

interface BatchRow {
  id: string;
  status: Batch['status'];
  on_failure: Batch['onFailure'];
  current_stage: number;
  stage_count: number;
  submitted_at: Date;
  finished_at: Date | null;
  submitted_by: string | null;
  stages: BatchStage[];
}

export async function getBatch(pool: pg.Pool, id: string): Promise<Batch | null> {
  if (!isUuid(id)) return null;
  const { rows } = await pool.query<BatchRow>(
    `select b.id, b.status, b.on_failure, b.current_stage, b.stage_count, b.submitted_at, b.finished_at, b.submitted_by,
            coalesce((select jsonb_agg(jsonb_build_object(
                       'stage', s.stage, 'total', s.total, 'waiting', s.waiting, 'pending', s.pending,
                       'running', s.running, 'succeeded', s.succeeded, 'failed', s.failed, 'cancelled', s.cancelled)
                       order by s.stage)
                       from (select e.stage, count(*) as total,
                                    count(*) filter (where e.status = 'WAITING') as waiting,
                                    count(*) filter (where e.status = 'PENDING') as pending,
                                    count(*) filter (where e.status = 'RUNNING') as running,
                                    count(*) filter (where e.status = 'SUCCEEDED') as succeeded,
                                    count(*) filter (where e.status = 'FAILED') as failed,
                                    count(*) filter (where e.status = 'CANCELLED') as cancelled
                               from asyncproc.executions e where e.batch_id = b.id group by e.stage) s), '[]') as stages
       from asyncproc.batches b where b.id = $1::uuid`,
    [id],
  );
  const row = rows[0];
  if (!row) return null;
  return {
    id: row.id,
    status: row.status,
    onFailure: row.on_failure,
    currentStage: row.current_stage,
    stageCount: row.stage_count,
    submittedAt: row.submitted_at,
    finishedAt: row.finished_at,
    submittedBy: row.submitted_by,
    stages: row.stages,
  };
}

export async function getBatchExecutions(pool: pg.Pool, id: string): Promise<Execution[]> {
  if (!isUuid(id)) return [];
  const { rows } = await pool.query<ExecutionRow>(
    `select ${EXECUTION_COLUMNS} from asyncproc.executions e where e.batch_id = $1::uuid order by e.stage, e.id`,
    [id],
  );
  return rows.map(toExecution);
}
