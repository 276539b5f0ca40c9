/**
 * The SQL Server sweeper: the service's periodic housekeeping of the database side.
 *
 *  * recovery (sql/mssql/procedures/usp_AsyncExecRecover.sql): calls left PENDING, WAITING or
 *    RUNNING whose dialog is gone (SET NEW_BROKER after a restore, an administrator's END
 *    CONVERSATION … WITH CLEANUP, an invoke cut short by a client timeout whose caller
 *    committed anyway) get a new dialog and request; running ones are left to their reader
 *    while it is alive. At start and then every `periodMs`.
 *  * retention (usp_AsyncExecPurge): finished history older than `retentionMs`, in bounded
 *    batches (each its own transaction, each call of the procedure bounded in time), every
 *    `purgePeriodMs`.
 *
 * Runs once per engine whatever starts it (the activator, the listener, or both), one sweep at
 * a time; any number of service processes may sweep the same database: the procedure takes each
 * call's application lock without waiting and checks the call again under it. A failed sweep is
 * logged and tried again on the next period; it never throws into the void.
 */
import sql from 'mssql';
import { toError, type Closeable } from '../../engine.js';
import type { Logger } from '../../logger.js';
import { retryDeadlocks } from './deadlock.js';

/** What one usp_AsyncExecRecover run reports. */
export interface RecoveryReport {
  examined: number;
  recovered: number;
  /** Held by a live reader, or moved on (finished, given a dialog) meanwhile. */
  skipped: number;
  /** Could not be given a dialog (logged in asyncexec.AsyncExecErrors). */
  failed: number;
}

/** One usp_AsyncExecRecover run; a deadlock victim is run again. */
export async function recoverLostCalls(pool: sql.ConnectionPool, options: { limit?: number; minAgeSeconds?: number } = {}): Promise<RecoveryReport> {
  const result = await retryDeadlocks(() =>
    pool
      .request()
      .input('limit', sql.Int, options.limit ?? 500)
      .input('minAgeSeconds', sql.Int, options.minAgeSeconds ?? 5)
      .execute<RecoveryReport>('asyncexec.usp_AsyncExecRecover'),
  );
  const row = result.recordset[0];
  return {
    examined: Number(row?.examined ?? 0),
    recovered: Number(row?.recovered ?? 0),
    skipped: Number(row?.skipped ?? 0),
    failed: Number(row?.failed ?? 0),
  };
}

/** One call of usp_AsyncExecPurge: calls deleted, and whether its time ran out with some left. */
export type PurgeRound = (olderThanSeconds: number) => Promise<{ deleted: number; more: boolean }>;

export function mssqlPurgeRound(pool: sql.ConnectionPool): PurgeRound {
  return async (olderThanSeconds) => {
    const result = await retryDeadlocks(() =>
      pool
        .request()
        .input('olderThanSeconds', sql.Int, olderThanSeconds)
        .execute<{ deleted: number; more: boolean | number }>('asyncexec.usp_AsyncExecPurge'),
    );
    const row = result.recordset[0];
    return { deleted: Number(row?.deleted ?? 0), more: Boolean(row?.more) };
  };
}

/**
 * Purge finished history older than `olderThanMs`: usp_AsyncExecPurge again while it reports
 * that its time ran out with rows left (each call is bounded below the request timeout, each of
 * its batches is a transaction of its own), until done or `stopped()`. Returns the calls deleted.
 */
export async function purgeHistory(round: PurgeRound, olderThanMs: number, stopped: () => boolean = () => false): Promise<number> {
  const seconds = Math.max(0, Math.floor(olderThanMs / 1000));
  let total = 0;
  for (;;) {
    const { deleted, more } = await round(seconds);
    total += deleted;
    if (!more || stopped()) return total;
  }
}

export interface SweeperSteps {
  recover(): Promise<RecoveryReport>;
  /** Purge history past the retention; returns the calls deleted. */
  purge(stopped: () => boolean): Promise<number>;
}

export interface SweeperOptions {
  logger: Logger;
  /** Between recovery sweeps. @default 60000 */
  periodMs?: number;
  /** Between purges of finished history; 0 turns purging off. @default 600000 */
  purgePeriodMs?: number;
  now?: () => number;
}

/** Runs the steps at start and then on a period, one sweep at a time, until closed. */
export class Sweeper implements Closeable {
  private timer: NodeJS.Timeout | undefined;
  private running: Promise<void> | undefined;
  private closed = false;
  private lastPurge = Number.NEGATIVE_INFINITY;
  private readonly now: () => number;

  constructor(
    private readonly steps: SweeperSteps,
    private readonly options: SweeperOptions,
  ) {
    this.now = options.now ?? Date.now;
  }

  /** Sweep once now (awaited: calls lost while the service was down are sent again before it serves), then on the period. */
  async start(): Promise<this> {
    await this.sweep();
    this.schedule();
    return this;
  }

  /** One sweep (recovery, then the purge when it is due); failures are logged, never thrown. */
  sweep(): Promise<void> {
    this.running ??= this.sweepOnce().finally(() => {
      this.running = undefined;
    });
    return this.running;
  }

  async close(): Promise<void> {
    this.closed = true;
    if (this.timer) clearTimeout(this.timer);
    this.timer = undefined;
    await this.running;
  }

  private schedule(): void {
    if (this.closed) return;
    this.timer = setTimeout(() => {
      this.timer = undefined;
      void this.sweep().then(() => this.schedule());
    }, this.options.periodMs ?? 60_000);
  }

  private async sweepOnce(): Promise<void> {
    if (this.closed) return;
    const { logger } = this.options;
    try {
      const report = await this.steps.recover();
      if (report.recovered > 0) {
        logger.warn({ ...report }, 'recovered calls whose Service Broker dialog was gone (SET NEW_BROKER, END CONVERSATION WITH CLEANUP, or an invoke cut short by a client timeout)');
      }
      if (report.failed > 0) {
        logger.error({ ...report }, 'calls whose dialog is gone could not be given a new one (see asyncexec.AsyncExecErrors): they stay unfinished until this succeeds');
      }
    } catch (error) {
      logger.warn({ err: toError(error) }, 'recovering lost calls failed; the next sweep tries again');
    }
    const purgePeriod = this.options.purgePeriodMs ?? 600_000;
    if (purgePeriod > 0 && !this.closed && this.now() - this.lastPurge >= purgePeriod) {
      this.lastPurge = this.now();
      try {
        const deleted = await this.steps.purge(() => this.closed);
        if (deleted > 0) logger.info({ deleted }, 'purged finished history past the retention');
      } catch (error) {
        logger.warn({ err: toError(error) }, 'purging finished history failed; the next purge tries again');
      }
    }
  }
}
