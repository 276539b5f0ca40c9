import type pg from 'pg';
import { EngineError, isTerminal, type Execution } from '../../engine.js';
import { getExecutions } from './executions.js';

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * Cancel by token (see Engine.cancelExecution). A running call is stopped with
 * pg_cancel_backend on the session that runs it; its worker then records CANCELLED.
 */
export async function cancelExecution(pool: pg.Pool, token: string, waitMs = 10_000): Promise<Execution> {
  const { rows } = await pool.query<{ outcome: 'CANCELLED' | 'RUNNING' | 'FINISHED' | 'NOT_FOUND'; backend_pid: number | null }>(
    'select outcome, backend_pid from asyncproc.cancel($1::uuid)',
    [token],
  );
  const { outcome, backend_pid: pid } = rows[0];
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
