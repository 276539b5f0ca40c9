import type pg from 'pg';
import { toError, type ExecutionProgress } from '../../engine.js';
import type { Logger } from '../../logger.js';

/** The text asyncproc.progress() raises (sql/postgres/routines/progress.sql), then its JSON. */
const PREFIX = 'asyncproc.progress ';
/** The channel a stored report is announced on; the payload is the execution id. */
export const PROGRESS_CHANNEL = 'asyncproc_progress';

/**
 * A worker connection, and the call it runs now (set by the activator; null between calls).
 * `group`: while that call heads a grouped commit, how many calls the group may hold and the
 * other calls' ids reported so far (a report names its call then: run_group sets it).
 */
export type ProgressSource = pg.Client & { executionId?: string | null; group?: { size: number; others: Set<string> } | null };

/**
 * Whose a report on `client` is: the call it runs, or (a grouped commit) another call of its
 * group, at most as many as the group holds; null: no one's. A notice is text any procedure can
 * raise: one naming a call it does not run wrote that call's progress (even a finished call's
 * of another caller), and thousands naming as many calls each passed the throttle, which is per
 * call, and starved the pool.
 */
export function reportedCall(client: ProgressSource, named: string | undefined): string | null {
  const own = client.executionId ?? null;
  if (!own || named === undefined || named === own) return own;
  const group = client.group;
  if (!group) return null;
  if (!group.others.has(named)) {
    if (group.others.size >= group.size - 1) return null;
    group.others.add(named);
  }
  return named;
}

interface Report {
  percent: number;
  message: string | null;
  /** The call that reported, when its worker's connection runs several in one transaction (grouped commits). */
  execution?: string;
}

/** One execution's reports: the time of the last write, the one in flight, the latest waiting. */
interface Channel {
  lastWrite: number;
  writing: boolean;
  pending: Report | null;
  timer: NodeJS.Timeout | null;
}

/** Parse a notice of asyncproc.progress(); null for any other notice. */
export function parseProgressNotice(text: string | undefined): Report | null {
  if (!text?.startsWith(PREFIX)) return null;
  try {
    const value = JSON.parse(text.slice(PREFIX.length)) as { percent?: unknown; message?: unknown; execution?: unknown };
    const percent = Number(value.percent);
    if (!Number.isFinite(percent) || percent < 0 || percent > 100) return null;
    const report: Report = { percent, message: typeof value.message === 'string' ? value.message.slice(0, 200) : null };
    if (typeof value.execution === 'string' && /^\d+$/.test(value.execution)) report.execution = value.execution;
    return report;
  } catch {
    return null;
  }
}

/**
 * Carries the progress a running call reports (a NOTICE on its worker's connection, sent
 * at once, inside the call's open transaction) to every service process: the latest report
 * of each execution is written to asyncproc.execution_progress from the pool, in its own
 * autocommitted statement that also NOTIFYs asyncproc_progress, so it is visible while the
 * call's own writes are not. Throttled per execution: the first report is written at once,
 * later ones at most once per `intervalMs`, the latest winning (the last report of a call is
 * written at most `intervalMs` after it, also when the call has ended by then).
 */
export class ProgressRelay {
  private readonly channels = new Map<string, Channel>();
  private closed = false;

  constructor(
    private readonly pool: pg.Pool,
    private readonly logger: Logger,
    /** Least time between two writes of one execution's progress. @default 250 */
    readonly intervalMs = 250,
  ) {}

  /** Forward the progress reports of the calls `client` runs. */
  attach(client: ProgressSource): void {
    client.on('notice', (notice) => {
      const report = parseProgressNotice(notice.message);
      const executionId = report && reportedCall(client, report.execution);
      if (report && executionId) this.report(executionId, { percent: report.percent, message: report.message });
    });
  }

  report(executionId: string, report: Report): void {
    if (this.closed) return;
    let channel = this.channels.get(executionId);
    if (!channel) this.channels.set(executionId, (channel = { lastWrite: 0, writing: false, pending: null, timer: null }));
    channel.pending = report;
    this.schedule(executionId, channel);
  }

  private schedule(executionId: string, channel: Channel): void {
    if (channel.writing || channel.timer || !channel.pending) return;
    const wait = channel.lastWrite + this.intervalMs - Date.now();
    if (wait > 0) {
      channel.timer = setTimeout(() => {
        channel.timer = null;
        this.schedule(executionId, channel);
      }, wait);
      return;
    }
    const report = channel.pending;
    channel.pending = null;
    channel.writing = true;
    channel.lastWrite = Date.now();
    void this.write(executionId, report).finally(() => {
      channel.writing = false;
      if (channel.pending && !this.closed) this.schedule(executionId, channel);
      // nothing more to say for now: forget it once its interval is over
      else if (!channel.timer) {
        channel.timer = setTimeout(() => {
          channel.timer = null;
          if (channel.pending) this.schedule(executionId, channel);
          else this.channels.delete(executionId);
        }, this.intervalMs);
      }
    });
  }

  private async write(executionId: string, report: Report): Promise<void> {
    try {
      await this.pool.query({
        name: 'asyncproc-progress',
        text: `with stored as (
                 insert into asyncproc.execution_progress as p (execution_id, percent, message, at)
                 values ($1, $2, $3, clock_timestamp())
                 on conflict (execution_id) do update set percent = excluded.percent, message = excluded.message, at = excluded.at
                 returning p.execution_id)
               select pg_notify('${PROGRESS_CHANNEL}', execution_id::text) from stored`,
        values: [executionId, report.percent, report.message],
      });
    } catch (error) {
      // a lost report is replaced by the next one; the call itself is not affected
      this.logger.warn({ err: toError(error), execution: executionId }, 'could not store a progress report');
    }
  }

  async close(): Promise<void> {
    // write what is waiting, then stop
    for (const [id, channel] of this.channels) {
      if (channel.timer) clearTimeout(channel.timer);
      channel.timer = null;
      if (channel.pending && !channel.writing) {
        const report = channel.pending;
        channel.pending = null;
        await this.write(id, report);
      }
    }
    this.closed = true;
    while ([...this.channels.values()].some((c) => c.writing)) await new Promise((resolve) => setTimeout(resolve, 5));
    for (const channel of this.channels.values()) if (channel.timer) clearTimeout(channel.timer);
    this.channels.clear();
  }
}

/** The latest progress of each of these executions, reported during their current (or last) attempt. */
export async function getProgress(pool: pg.Pool, executionIds: readonly string[]): Promise<Map<string, ExecutionProgress>> {
  if (!executionIds.length) return new Map();
  const { rows } = await pool.query<{ execution_id: string; percent: string; message: string | null; at: Date }>(
    `select p.execution_id, p.percent::text as percent, p.message, p.at
       from asyncproc.execution_progress p
       join asyncproc.executions e on e.id = p.execution_id
      where p.execution_id = any($1::bigint[]) and p.at >= e.started_at`,
    [executionIds],
  );
  return new Map(rows.map((row) => [row.execution_id, { percent: Number(row.percent), message: row.message, at: row.at }]));
}
