/**
 * cancelBatch on SQL Server (the T-SQL is sql/mssql/procedures/usp_AsyncExecCancelBatch.sql;
 * docs/mssql.md, "Batches"). A step chosen as a deadlock victim is run again (deadlock.ts); the
 * members' kills share the pool's kill gate (cancel.ts), so concurrent cancels cannot take
 * every connection of the pool and wait for one more.
 *
 *  1. usp_AsyncExecCancelBatch, one transaction: the batch row locked first; NOT_FOUND or
 *     FINISHED refused; every member not yet started CANCELLED (as the settle's CANCEL branch
 *     does), every RUNNING one marked cancel_requested (no retry, no restart); the batch
 *     settled, so it ends at once when nothing is left running.
 *  2. After that commit, never while the batch row is held: with allowKill, each RUNNING member
 *     is cancelled through cancelExecution's own steps (cancel.ts: usp_AsyncExecCancel, the
 *     kill, usp_AsyncExecSettleCancel), all of them first, then waited for together; whatever
 *     ends the last one settles the batch. Without allowKill they run to their end (not an
 *     error here): the batch is returned at once.
 */
import sql from 'mssql';
import { EngineError, isTerminal, type Batch } from '../../engine.js';
import { mssqlCancelSteps, type CancelSteps, type CancelTiming } from './cancel.js';
import { retryDeadlocks } from './deadlock.js';
import { mapDatabaseError } from './errors.js';
import { getBatch } from './executionBatches.js';
import { isToken } from './types.js';

/** What usp_AsyncExecCancelBatch reports. */
export type CancelBatchOutcome = 'CANCELLED' | 'FINISHED' | 'NOT_FOUND';

/** The database steps of a batch cancel; the loop in runCancelBatch is pure. */
export interface CancelBatchSteps {
  /** usp_AsyncExecCancelBatch (step one, its own transaction). */
  cancel(): Promise<CancelBatchOutcome>;
  /** Tokens of the batch's members RUNNING now. */
  running(): Promise<string[]>;
  /** cancelExecution's steps for one member, KILL allowed. */
  member(token: string): CancelSteps;
  /** The batch as it is now; null when it is gone (purged). */
  read(): Promise<Batch | null>;
  sleep(ms: number): Promise<void>;
  now(): number;
}

export interface CancelBatchOptions extends CancelTiming {
  /** Whether RUNNING members may be killed (the engine's allowKill). */
  allowKill: boolean;
  /** A running member that could not be cancelled (other than by ending first): it runs to its end. */
  onMemberError?: (token: string, error: unknown) => void;
}

interface RunningMember {
  token: string;
  id: string;
  steps: CancelSteps;
  killed: Set<number>;
}

export async function runCancelBatch(id: string, steps: CancelBatchSteps, options: CancelBatchOptions): Promise<Batch> {
  const waitMs = options.waitMs ?? 10_000;
  const pollMs = options.pollMs ?? 100;
  const deadline = steps.now() + waitMs;
  const outcome = await steps.cancel();
  if (outcome === 'NOT_FOUND') throw new EngineError('NOT_FOUND', `batch ${id} does not exist`);
  if (outcome === 'FINISHED') throw new EngineError('ALREADY_FINISHED', `batch ${id} has already finished`);
  const read = async () => {
    const batch = await steps.read();
    if (!batch) throw new EngineError('NOT_FOUND', `batch ${id} no longer exists`);
    return batch;
  };
  // Without KILL the running members run to their end; nothing to wait for.
  if (!options.allowKill) return read();

  // Ask each RUNNING member to stop (records cancel_requested and commits, as cancelExecution).
  let waiting: RunningMember[] = [];
  for (const token of await steps.running()) {
    const member = steps.member(token);
    try {
      const first = await member.request();
      // CANCELLED or BUSY: it was no longer RUNNING (it cannot have started again: step one
      // marked it cancel_requested, so a failure ends it CANCELLED instead of a retry).
      if (first.status === 'RUNNING') waiting.push({ token, id: first.id, steps: member, killed: new Set() });
    } catch (error) {
      // ALREADY_FINISHED / NOT_FOUND: it ended (or went) meanwhile. Anything else (FORBIDDEN:
      // the login may not KILL) leaves it running to its end, which is not a batch cancel error.
      if (!(error instanceof EngineError && (error.code === 'ALREADY_FINISHED' || error.code === 'NOT_FOUND'))) {
        options.onMemberError?.(token, error);
      }
    }
  }

  // Kill them all first, then wait for them together (not one cancelExecution wait after another).
  for (;;) {
    const still: RunningMember[] = [];
    for (const member of waiting) {
      try {
        await member.steps.kill(member.id, member.killed);
        await member.steps.settle(member.id);
        const execution = await member.steps.read(member.id);
        if (execution && !isTerminal(execution.status)) still.push(member);
      } catch (error) {
        options.onMemberError?.(member.token, error); // given up on: it runs to its end
      }
    }
    waiting = still;
    const batch = await read();
    if (batch.status !== 'RUNNING' || waiting.length === 0 || steps.now() >= deadline) return batch;
    await steps.sleep(pollMs);
  }
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** The steps against a pool (members' kills as cancelExecution does them: one connection held, a second one used). */
export function mssqlCancelBatchSteps(pool: sql.ConnectionPool, id: string): CancelBatchSteps {
  return {
    async cancel() {
      try {
        // a deadlock victim's transaction was rolled back whole: run it again (deadlock.ts)
        const result = await retryDeadlocks(() =>
          new sql.Request(pool)
            .input('batchId', sql.UniqueIdentifier, id)
            .output('outcome', sql.VarChar(10))
            .execute('asyncexec.usp_AsyncExecCancelBatch'),
        );
        const outcome = result.output.outcome as CancelBatchOutcome | null;
        if (outcome !== 'CANCELLED' && outcome !== 'FINISHED' && outcome !== 'NOT_FOUND') {
          throw new Error(`usp_AsyncExecCancelBatch reported ${String(outcome)}`);
        }
        return outcome;
      } catch (error) {
        throw mapDatabaseError(error);
      }
    },
    async running() {
      const result = await retryDeadlocks(() =>
        new sql.Request(pool)
          .input('id', sql.UniqueIdentifier, id)
          .query<{ token: string }>(
            `SELECT token FROM asyncexec.AsyncExecResults WHERE batch_id = @id AND status = 'RUNNING' ORDER BY stage, id`,
          ),
      );
      return result.recordset.map((row) => String(row.token).toLowerCase());
    },
    member: (token) => mssqlCancelSteps(pool, token, true),
    read: () => getBatch(pool, id),
    sleep,
    now: () => Date.now(),
  };
}

/** cancelBatch: BAD_USER_INPUT for a malformed id (before anything reaches the server), then runCancelBatch. */
export async function cancelBatch(pool: sql.ConnectionPool, id: string, options: CancelBatchOptions): Promise<Batch> {
  if (typeof id !== 'string' || !isToken(id)) throw new EngineError('BAD_USER_INPUT', `malformed batch id "${String(id)}"`);
  return runCancelBatch(id.toLowerCase(), mssqlCancelBatchSteps(pool, id), options);
}
