import type pg from 'pg';

/** Executions one purge transaction deletes at most (asyncproc.purge's max_rows). */
export const PURGE_ROWS = 1000;

/**
 * Retention in small transactions: asyncproc.purge deletes at most PURGE_ROWS executions a
 * call (an ended batch's over as many calls as it needs, its row with the last); call it again while it finds that many, for at most
 * `budgetMs`, so a day's million finished calls never become one long transaction holding
 * locks while workers run. Returns the executions deleted.
 */
export async function purgeFinished(
  pool: pg.Pool,
  olderThanMs: number,
  options: { budgetMs?: number; stopped?: () => boolean } = {},
): Promise<number> {
  const started = Date.now();
  let total = 0;
  for (;;) {
    const { rows } = await pool.query<{ n: number }>(`select asyncproc.purge($1::interval, $2) as n`, [`${olderThanMs} milliseconds`, PURGE_ROWS]);
    total += rows[0].n;
    if (rows[0].n < PURGE_ROWS || Date.now() - started > (options.budgetMs ?? Infinity) || options.stopped?.()) return total;
  }
}
