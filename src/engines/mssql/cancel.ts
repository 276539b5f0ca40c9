import sql from 'mssql';
import { EngineError, isTerminal, type Execution } from '../../engine.js';
import { mapDatabaseError } from './errors.js';
import { getExecutionsById } from './executions.js';

/**
 * cancelExecution on SQL Server (the T-SQL is in sql/mssql/0005_activated.sql; the lock
 * order and the races are described there and in docs/mssql.md, "Cancelling a call").
 *
 *  * WAITING / PENDING: usp_AsyncExecCancel records CANCELLED under the call's lock, in one
 *    transaction; the activated side ends the dialog and sends CANCELLED to the listener.
 *  * RUNNING, allowKill: usp_AsyncExecCancel records (and commits) cancel_requested; then,
 *    until the call is no longer RUNNING or the wait is over: hold the call's row (UPDLOCK,
 *    so its reader cannot record an outcome and move on), KILL the reader's session if it
 *    still holds the call's lock (usp_AsyncExecKill, on another connection, outside any
 *    transaction), and once that session is gone record CANCELLED (usp_AsyncExecSettleCancel).
 *  * RUNNING without allowKill: FORBIDDEN from usp_AsyncExecCancel, nothing changed.
 */

/** What usp_AsyncExecCancel reports: done, cancel recorded (kill next), or a reader holds the call right now. */
export type CancelRequestStatus = 'CANCELLED' | 'RUNNING' | 'BUSY';

/** The database steps of a cancel; the loop in runCancel is pure. */
export interface CancelSteps {
  /** usp_AsyncExecCancel; refuses with NOT_FOUND, ALREADY_FINISHED or FORBIDDEN EngineErrors. */
  request(): Promise<{ id: string; status: CancelRequestStatus }>;
  /** The execution as it is now; null when it is gone (purged). */
  read(id: string): Promise<Execution | null>;
  /** Kill the session still running the call, unless it is in `killed`; adds what it killed. */
  kill(id: string, killed: Set<number>): Promise<void>;
  /** Record CANCELLED once the killed session is gone (nothing while it is not). */
  settle(id: string): Promise<void>;
  sleep(ms: number): Promise<void>;
  now(): number;
}

export interface CancelTiming {
  /** How long to wait for a RUNNING call to stop. @default 10000 */
  waitMs?: number;
  /** Pause between looks. @default 100 */
  pollMs?: number;
}

export async function runCancel(steps: CancelSteps, timing: CancelTiming = {}): Promise<Execution> {
  const waitMs = timing.waitMs ?? 10_000;
  const pollMs = timing.pollMs ?? 100;
  const deadline = steps.now() + waitMs;
  // Only this first request may refuse: NOT_FOUND, ALREADY_FINISHED, FORBIDDEN.
  const first = await steps.request();
  const id = first.id;
  let status: CancelRequestStatus = first.status;
  let recorded = status === 'RUNNING';
  const killed = new Set<number>();
  for (;;) {
    if (status === 'RUNNING') {
      await steps.kill(id, killed);
      await steps.settle(id);
    }
    const execution = await steps.read(id);
    if (!execution) throw new EngineError('NOT_FOUND', `execution ${id} no longer exists`);
    // Finished: CANCELLED, or an outcome its run reached before the kill landed.
    if (isTerminal(execution.status) || steps.now() >= deadline) return execution;
    if (execution.status === 'RUNNING' && recorded) {
      status = 'RUNNING';
    } else {
      // WAITING or PENDING (the first request found a reader claiming it), or RUNNING since
      // then without a recorded cancel: ask again, with the same refusals.
      try {
        status = (await steps.request()).status;
      } catch (error) {
        if (!(error instanceof EngineError && error.code === 'ALREADY_FINISHED')) throw error;
        continue; // it finished meanwhile: read it and return it
      }
      recorded ||= status === 'RUNNING';
      if (status !== 'BUSY') continue;
    }
    await steps.sleep(pollMs);
  }
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** The steps against a pool; the kill holds one connection and uses a second one. */
export function mssqlCancelSteps(pool: sql.ConnectionPool, token: string, allowKill: boolean): CancelSteps {
  return {
    async request() {
      try {
        const result = await pool
          .request()
          .input('token', sql.UniqueIdentifier, token)
          .input('allowKill', sql.Bit, allowKill)
          .output('id', sql.BigInt)
          .output('status', sql.VarChar(10))
          .execute('asyncexec.usp_AsyncExecCancel');
        return { id: String(result.output.id), status: result.output.status as CancelRequestStatus };
      } catch (error) {
        throw mapDatabaseError(error);
      }
    },
    async read(id) {
      return (await getExecutionsById(pool, [id]))[0] ?? null;
    },
    async kill(id, killed) {
      const tx = new sql.Transaction(pool);
      await tx.begin();
      try {
        // Hold the row: the reader cannot record an outcome (and so cannot release the
        // call's lock and move on to another call) until we end this transaction.
        const row = (
          await new sql.Request(tx)
            .input('id', sql.BigInt, id)
            .query<{ status: string; session_id: number | null }>(
              `SELECT status, session_id FROM asyncexec.AsyncExecResults WITH (UPDLOCK, ROWLOCK)
                WHERE id = @id AND cancel_requested = 1`,
            )
        ).recordset[0];
        if (row && row.status === 'RUNNING' && row.session_id !== null && !killed.has(row.session_id)) {
          const result = await pool
            .request()
            .input('id', sql.BigInt, id)
            .input('sessionId', sql.Int, row.session_id)
            .output('killed', sql.Bit)
            .execute('asyncexec.usp_AsyncExecKill');
          if (result.output.killed) killed.add(row.session_id);
        }
      } finally {
        await tx.rollback().catch(() => undefined); // it changed nothing
      }
    },
    async settle(id) {
      await pool.request().input('id', sql.BigInt, id).output('status', sql.VarChar(10)).execute('asyncexec.usp_AsyncExecSettleCancel');
    },
    sleep,
    now: () => Date.now(),
  };
}
