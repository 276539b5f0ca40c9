import type pg from 'pg';
import { EngineError, isTerminal, isUuid, type Batch, type Execution } from '../../engine.js';
import { getBatch } from './batches.js';
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
    // a running call's session is signalled inside (asyncproc.cancel), while its row is held
    const { rows } = await signalling(`cancel the session running ${token}`, () =>
      pool.query<{ outcome: Outcome; backend_pid: number | null }>('select outcome, backend_pid from asyncproc.cancel($1::uuid)', [token]),
    );
    ({ outcome, backend_pid: pid } = rows[0]);
  }
  if (outcome === 'RETRY') throw new Error(`could not cancel ${token}: its state kept changing`);
  if (outcome === 'NOT_FOUND') throw new EngineError('NOT_FOUND', `no execution with token ${token}`);
  if (outcome === 'FINISHED') throw new EngineError('ALREADY_FINISHED', `execution ${token} has already finished`);
  if (outcome === 'RUNNING' && pid !== null) {
    // wait until it is no longer running; a call run outside a transaction is signalled again
    // meanwhile (asyncproc.cancel_resignal: the first signal may have found its worker idle
    // just before the call's own statement)
    for (const deadline = Date.now() + waitMs; Date.now() < deadline; await sleep(50)) {
      const [execution] = await getExecutions(pool, [token]);
      if (isTerminal(execution.status)) return execution;
      await signalling(`cancel the session running ${token}`, () => pool.query('select asyncproc.cancel_resignal($1::uuid)', [token]));
    }
  }
  return (await getExecutions(pool, [token]))[0];
}

/**
 * A statement that signals a session (pg_cancel_backend); a role that may not (neither the
 * session's role nor a member of pg_signal_backend) makes it fail whole, nothing changed:
 * FORBIDDEN.
 */
async function signalling<T>(what: string, statement: () => Promise<T>): Promise<T> {
  try {
    return await statement();
  } catch (error) {
    if ((error as { code?: string }).code === '42501') {
      throw new EngineError('FORBIDDEN', `not allowed to ${what}: ${(error as Error).message}`, { cause: error });
    }
    throw error;
  }
}

/**
 * Cancel a batch (see Engine.cancelBatch): the members not yet started in one transaction
 * holding the batch, then the running ones by signal, in rounds until the batch has ended.
 */
export async function cancelBatch(pool: pg.Pool, id: string, waitMs = 10_000): Promise<Batch> {
  if (!isUuid(id)) throw new EngineError('BAD_USER_INPUT', `malformed batch id "${id}"`);
  const step = async () => (await pool.query<{ outcome: string }>('select outcome from asyncproc.cancel_batch($1::uuid)', [id])).rows[0].outcome;
  const first = await step();
  if (first === 'NOT_FOUND') throw new EngineError('NOT_FOUND', `no batch with id ${id}`);
  if (first === 'FINISHED') throw new EngineError('ALREADY_FINISHED', `batch ${id} has already ended`);
  for (const deadline = Date.now() + waitMs; ; await sleep(50)) {
    // the running members' sessions are signalled inside, while their rows are held
    await signalling(`cancel the running members of batch ${id}`, () => pool.query('select asyncproc.cancel_batch_running($1::uuid)', [id]));
    const batch = await getBatch(pool, id);
    // purged meanwhile (a retention of about nothing): it had ended
    if (!batch) throw new EngineError('ALREADY_FINISHED', `batch ${id} has already ended`);
    if (batch.status !== 'RUNNING' || Date.now() >= deadline) return batch;
    await step(); // a member that went back to WAITING (a retry) meanwhile
  }
}
