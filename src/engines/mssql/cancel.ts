import sql from 'mssql';
import { EngineError, isTerminal, type Execution } from '../../engine.js';
import { retryDeadlocks } from './deadlock.js';
import { mapDatabaseError } from './errors.js';
import { getExecutionsById } from './executions.js';

/**
 * cancelExecution on SQL Server (the T-SQL is in sql/mssql/procedures/usp_AsyncExecCancel.sql and its neighbours; the lock
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
 *
 * The kill step holds one pooled connection (the row, in a transaction) while it asks the pool
 * for a second one (KILL). k such steps at once in a pool of k connections would each hold one
 * and wait for ever for another: so at most k - 1 run at once (killGate), and one of them can
 * always get its second connection. Every database step is rerun when it is chosen as a
 * deadlock victim (deadlock.ts): a 1205 never reaches the client.
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

/** Lets at most `permits` holders run at once; the others wait in line (first come, first served). */
export class Semaphore {
  private free: number;
  private readonly waiting: Array<() => void> = [];

  constructor(readonly permits: number) {
    if (!(permits >= 1)) throw new Error(`a semaphore needs at least one permit, not ${permits}`);
    this.free = permits;
  }

  async use<T>(fn: () => Promise<T>): Promise<T> {
    if (this.free > 0) this.free--;
    else await new Promise<void>((resolve) => this.waiting.push(resolve));
    try {
      return await fn();
    } finally {
      const next = this.waiting.shift();
      if (next) next(); // the permit passes on
      else this.free++;
    }
  }
}

/**
 * How many kill steps may run at once in a pool of `poolMax` connections: each holds one
 * connection while it waits for a second, so k of them in a pool of k would wait for ever.
 * With k - 1, one connection is always left for a second request (the constructor of
 * MssqlEngine refuses allowKill with fewer than 2).
 */
export function killPermits(poolMax: number): number {
  return Math.max(1, Math.floor(poolMax) - 1);
}

const gates = new WeakMap<sql.ConnectionPool, Semaphore>();

/** The one kill gate of a pool (its size read from the pool's own configuration). */
export function killGate(pool: sql.ConnectionPool): Semaphore {
  let gate = gates.get(pool);
  if (!gate) {
    const max = (pool as unknown as { config?: sql.config }).config?.pool?.max ?? 10;
    gate = new Semaphore(killPermits(max));
    gates.set(pool, gate);
  }
  return gate;
}

/** The two connections of a kill step. */
export interface KillConnections {
  /** Begin a transaction on one pooled connection and read the call's row WITH (UPDLOCK); release() rolls it back. */
  hold(id: string): Promise<{ row: { status: string; session_id: number | null } | undefined; release(): Promise<void> }>;
  /** usp_AsyncExecKill on another pooled connection, outside any transaction: whether it killed. */
  kill(id: string, sessionId: number): Promise<boolean>;
}

/**
 * Kill the session still running the call (unless already killed by us), holding the call's
 * row meanwhile so that its reader cannot record an outcome and move on to another call.
 * Runs inside `gate`, so that never every connection of the pool is held by a kill step
 * waiting for a second one.
 */
export function killStep(connections: KillConnections, gate: Semaphore, id: string, killed: Set<number>): Promise<void> {
  return gate.use(async () => {
    const held = await connections.hold(id);
    try {
      const row = held.row;
      if (row && row.status === 'RUNNING' && row.session_id !== null && !killed.has(row.session_id)) {
        if (await connections.kill(id, row.session_id)) killed.add(row.session_id);
      }
    } finally {
      await held.release();
    }
  });
}

/** A kill step's connections from the query pool. */
export function mssqlKillConnections(pool: sql.ConnectionPool): KillConnections {
  return {
    async hold(id) {
      const tx = new sql.Transaction(pool);
      await tx.begin();
      const release = () => tx.rollback().catch(() => undefined); // it changed nothing
      try {
        const row = (
          await new sql.Request(tx)
            .input('id', sql.BigInt, id)
            .query<{ status: string; session_id: number | null }>(
              `SELECT status, session_id FROM asyncexec.AsyncExecResults WITH (UPDLOCK, ROWLOCK)
                WHERE id = @id AND cancel_requested = 1`,
            )
        ).recordset[0];
        return { row, release };
      } catch (error) {
        await release();
        throw error;
      }
    },
    async kill(id, sessionId) {
      const result = await pool
        .request()
        .input('id', sql.BigInt, id)
        .input('sessionId', sql.Int, sessionId)
        .output('killed', sql.Bit)
        .execute('asyncexec.usp_AsyncExecKill');
      return Boolean(result.output.killed);
    },
  };
}

/** The steps against a pool; the kill holds one connection and uses a second one (killStep). */
export function mssqlCancelSteps(pool: sql.ConnectionPool, token: string, allowKill: boolean): CancelSteps {
  return {
    async request() {
      try {
        const result = await retryDeadlocks(() =>
          pool
            .request()
            .input('token', sql.UniqueIdentifier, token)
            .input('allowKill', sql.Bit, allowKill)
            .output('id', sql.BigInt)
            .output('status', sql.VarChar(10))
            .execute('asyncexec.usp_AsyncExecCancel'),
        );
        return { id: String(result.output.id), status: result.output.status as CancelRequestStatus };
      } catch (error) {
        throw mapDatabaseError(error);
      }
    },
    async read(id) {
      return (await getExecutionsById(pool, [id]))[0] ?? null;
    },
    kill: (id, killed) => retryDeadlocks(() => killStep(mssqlKillConnections(pool), killGate(pool), id, killed)),
    async settle(id) {
      await retryDeadlocks(() =>
        pool.request().input('id', sql.BigInt, id).output('status', sql.VarChar(10)).execute('asyncexec.usp_AsyncExecSettleCancel'),
      );
    },
    sleep,
    now: () => Date.now(),
  };
}
