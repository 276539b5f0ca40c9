/**
 * Deadlock victims (SQL Server error 1205) are rerun, never reported to a client.
 *
 * "When an instance of the SQL Server Database Engine chooses a transaction as a deadlock
 * victim, it terminates the current batch, rolls back the transaction, and returns error
 * message 1205 to the application. [...] The application should pause briefly before
 * resubmitting its query" (Handling Deadlocks; MSSQLSERVER_1205: "Rerun the transaction").
 * So a step whose whole transaction is its own (a procedure call that begins and commits its
 * own transaction, or engine.withTransaction around a callback that only talks to the
 * database) can simply run again: nothing of the victim is left. The pause is random so that
 * two victims of one cycle do not collide again in step.
 */
import { errorNumber } from './errors.js';

/** "Transaction (Process ID %d) was deadlocked on %.*ls resources [...] Rerun the transaction." */
export const DEADLOCK_VICTIM = 1205;

export interface DeadlockRetry {
  /** Runs in all, the first included. @default 5 */
  attempts?: number;
  /** Pause before the second run; doubled for each run after, then jittered (×0.5–1.5). @default 20 */
  baseMs?: number;
  sleep?: (ms: number) => Promise<void>;
  random?: () => number;
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** Whether `error` says its transaction was chosen as a deadlock victim (and rolled back). */
export function isDeadlockVictim(error: unknown): boolean {
  if (errorNumber(error) === DEADLOCK_VICTIM) return true;
  const cause = (error as { cause?: unknown } | null)?.cause;
  return cause !== undefined && cause !== error && isDeadlockVictim(cause);
}

/**
 * Run `step`; while it fails as a deadlock victim, pause (random, growing) and run it again.
 * After the last attempt the failure is no longer a 1205 to the caller: it becomes a plain
 * Error (masked at the edge as unexpected) that keeps the victim as its cause.
 */
export async function retryDeadlocks<T>(step: () => Promise<T>, options: DeadlockRetry = {}): Promise<T> {
  const attempts = Math.max(1, options.attempts ?? 5);
  const baseMs = options.baseMs ?? 20;
  const pause = options.sleep ?? sleep;
  const random = options.random ?? Math.random;
  for (let attempt = 1; ; attempt++) {
    try {
      return await step();
    } catch (error) {
      if (!isDeadlockVictim(error)) throw error;
      if (attempt >= attempts) {
        throw new Error(`chosen as a deadlock victim ${attempts} times in a row; gave up`, { cause: error });
      }
      await pause(Math.round(baseMs * 2 ** (attempt - 1) * (0.5 + random())));
    }
  }
}
