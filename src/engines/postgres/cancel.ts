import type pg from 'pg';
import { EngineError, isTerminal, type Execution } from '../../engine.js';
import { getExecutions } from './executions.js';

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * Cancel by token (see Engine.cancelExecution). A running call is stopped with
 * pg_cancel_backend on the session that runs it; its worker then records CANCELLED.
 */
export async function cancelExecution(pool: pg.Pool, token: string, waitMs = 10_000): Promise<Execution> {
  type Outcome = 'CANCELLED' | 'RUNNING' | 'FINISHED' | 'NOT_FOUND' | 'RETRY';
  let outcome: Outcome = 'RETRY';
  let pid: number | null = null;
  // RETRY: a batch member started while we held its batch; ask again in a new transaction
  for (let tries = 0; outcome === 'RETRY' && tries < 20; tries++) {
    const { rows } = await pool.query<{ outcome: Outcome; backend_pid: number | null }>(
      'select outcome, backend_pid from asyncproc.cancel($1::uuid)',
      [token],
    );
    ({ outcome, backend_pid: pid } = rows[0]);
  }
  if (outcome === 'RETRY') throw new Error(`could not cancel ${token}: its state kept changing`);
  if (outcome === 'NOT_FOUND') throw new EngineError('NOT_FOUND', `no execution with token ${token}`);
  if (outcome === 'FINISHED') throw new EngineError('ALREADY_FINISHED', `execution ${token} has already finished`);
  if (outcome === 'RUNNING') {
    let signalled = false;
    try {
      signalled = (await pool.query<{ ok: boolean }>('select pg_cancel_backend($1) as ok', [pid])).rows[0].ok;
    } catch (error) {
      throw new EngineError('FORBIDDEN', `not allowed to cancel the session running ${token}: ${(error as Error).message}`, { cause: error });
    }
    // the call may have ended just before the signal; either way, wait until it is no longer running
    for (const deadline = Date.now() + waitMs; Date.now() < deadline; await sleep(50)) {
      const [execution] = await getExecutions(pool, [token]);
      if (isTerminal(execution.status) || !signalled) return execution;
    }
  }
  return (await getExecutions(pool, [token]))[0];
}
