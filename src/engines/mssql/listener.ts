import sql from 'mssql';
import { toError, type Closeable, type ExecutionEvent, type ExecutionStatus, type ListenerSink } from '../../engine.js';
import type { Logger } from '../../logger.js';
import { eventsSince, getExecutionsById, latestCursor } from './executions.js';

export interface MssqlListenerOptions {
  config: sql.config;
  sink: ListenerSink;
  logger: Logger;
  /** WAITFOR … TIMEOUT of one RECEIVE, and the period of the table catch-up. @default 1000 */
  waitMs?: number;
  /** Most messages taken per round trip. @default 500 */
  batchSize?: number;
  /** Longest pause between reconnect attempts. @default 30000 */
  maxBackoffMs?: number;
}

const END_DIALOG = 'http://schemas.microsoft.com/SQL/ServiceBroker/EndDialog';
const ERROR = 'http://schemas.microsoft.com/SQL/ServiceBroker/Error';

/**
 * One round trip: wait for the first messages, then take whatever else is queued
 * (each RECEIVE returns the messages of one conversation group, i.e. of one call),
 * end the dialogs whose EndDialog or Error arrived, commit, and return the status
 * changes. XACT_ABORT makes a cancelled or timed-out batch roll back its RECEIVEs.
 */
function receiveBatch(waitMs: number, batchSize: number): string {
  return `SET NOCOUNT ON; SET XACT_ABORT ON;
DECLARE @m TABLE (conversation_handle uniqueidentifier, message_type_name sysname, message_body varbinary(max), queuing_order bigint);
DECLARE @got int, @total int, @h uniqueidentifier;
BEGIN TRANSACTION;
WAITFOR (RECEIVE conversation_handle, message_type_name, message_body, queuing_order
           FROM asyncexec.AsyncExecNotifyQueue INTO @m), TIMEOUT ${waitMs};
SELECT @got = @@ROWCOUNT;
SET @total = @got;
WHILE @got > 0 AND @total < ${batchSize}
BEGIN
    SET @got = 0;   -- RECEIVE must follow a statement ended by a semicolon
    RECEIVE TOP (${batchSize}) conversation_handle, message_type_name, message_body, queuing_order
      FROM asyncexec.AsyncExecNotifyQueue INTO @m;
    SELECT @got = @@ROWCOUNT;
    SET @total += @got;
END;
DECLARE ends CURSOR LOCAL FAST_FORWARD FOR
    SELECT DISTINCT conversation_handle FROM @m WHERE message_type_name IN (N'${END_DIALOG}', N'${ERROR}');
OPEN ends;
FETCH NEXT FROM ends INTO @h;
WHILE @@FETCH_STATUS = 0
BEGIN
    END CONVERSATION @h;   -- the activated side has ended already: this completes the dialog
    FETCH NEXT FROM ends INTO @h;
END;
CLOSE ends;
DEALLOCATE ends;
COMMIT TRANSACTION;
SELECT CAST(message_body AS xml).value('(/status/@id)[1]', 'bigint') AS id,
       CAST(message_body AS xml).value('(/status/@status)[1]', 'varchar(10)') AS status,
       CAST(message_body AS xml).value('(/status/@cursor)[1]', 'varchar(18)') AS [cursor]
  FROM @m
 WHERE message_type_name = N'asyncexec/Status'
 ORDER BY queuing_order;`;
}

interface StatusMessage {
  id: string | number;
  status: ExecutionStatus;
  cursor: string;
}

/**
 * Feeds the completion hub from the notification queue, on a connection of its own.
 * Messages give each status change as it commits; a catch-up read of the table by
 * rowversion after every round trip covers what this process did not receive (another
 * instance's listener took it, or it happened while disconnected) and submissions,
 * which send nothing to the listener.
 */
export class MssqlListener implements Closeable {
  private pool: sql.ConnectionPool | undefined;
  private pending: sql.Request | undefined;
  private closed = false;
  private loop: Promise<void> | undefined;
  private cursor: string | null = null;
  /** Latest cursor delivered per execution id, so the catch-up does not repeat the messages. */
  private readonly delivered = new Map<string, string>();
  private readonly waitMs: number;
  private readonly batchSize: number;
  private readonly maxBackoffMs: number;

  constructor(private readonly options: MssqlListenerOptions) {
    this.waitMs = options.waitMs ?? 1000;
    this.batchSize = options.batchSize ?? 500;
    this.maxBackoffMs = options.maxBackoffMs ?? 30_000;
  }

  async start(): Promise<void> {
    const pool = await this.connect();
    this.cursor = await latestCursor(pool);
    this.loop = this.run();
  }

  private async connect(): Promise<sql.ConnectionPool> {
    const pool = new sql.ConnectionPool({
      ...this.options.config,
      // longer than the WAITFOR, so the driver never cancels a RECEIVE that is only waiting
      requestTimeout: this.waitMs + 30_000,
      pool: { min: 0, max: 1 },
    });
    pool.on('error', (error: unknown) => this.options.logger.warn({ err: error }, 'listener connection failed'));
    await pool.connect();
    this.pool = pool;
    return pool;
  }

  private async dropConnection(): Promise<void> {
    const pool = this.pool;
    this.pool = undefined;
    await pool?.close().catch(() => undefined);
  }

  private async run(): Promise<void> {
    let backoff = 250;
    let lost = false;
    while (!this.closed) {
      try {
        const pool = this.pool ?? (await this.connect());
        if (lost) {
          lost = false;
          this.options.logger.info('listener reconnected');
          this.safely(() => this.options.sink.onReconnect());
        }
        await this.cycle(pool);
        backoff = 250;
      } catch (error) {
        if (this.closed) break;
        const err = toError(error);
        this.options.logger.warn({ err, retryInMs: backoff }, 'listener lost its connection');
        this.safely(() => this.options.sink.onError(err));
        lost = true;
        await this.dropConnection();
        await new Promise((resolve) => setTimeout(resolve, backoff));
        backoff = Math.min(backoff * 2, this.maxBackoffMs);
      }
    }
  }

  private async cycle(pool: sql.ConnectionPool): Promise<void> {
    const request = pool.request();
    this.pending = request;
    let messages: StatusMessage[];
    try {
      messages = (await request.batch<StatusMessage>(receiveBatch(this.waitMs, this.batchSize))).recordset ?? [];
    } finally {
      this.pending = undefined;
    }
    if (this.closed) return;
    if (messages.length) {
      const executions = new Map(
        (await getExecutionsById(pool, [...new Set(messages.map((m) => String(m.id)))])).map((e) => [e.id, e]),
      );
      const events: ExecutionEvent[] = [];
      for (const message of messages) {
        const execution = executions.get(String(message.id));
        if (!execution) continue; // purged since
        events.push({ cursor: message.cursor, status: message.status, execution });
        this.remember(execution.id, message.cursor);
      }
      if (events.length) this.safely(() => this.options.sink.onEvents(events));
    }
    await this.catchUp(pool);
  }

  private async catchUp(pool: sql.ConnectionPool): Promise<void> {
    for (;;) {
      const changes = await eventsSince(pool, this.cursor, {}, this.batchSize);
      if (!changes.length) return;
      this.cursor = changes[changes.length - 1].cursor;
      const unseen = changes.filter((event) => {
        const seen = this.delivered.get(event.execution.id);
        return seen === undefined || seen < event.cursor;
      });
      for (const event of unseen) this.remember(event.execution.id, event.cursor);
      if (unseen.length) this.safely(() => this.options.sink.onEvents(unseen));
      this.prune();
      if (changes.length < this.batchSize || this.closed) return;
    }
  }

  private remember(id: string, cursor: string): void {
    const seen = this.delivered.get(id);
    if (seen === undefined || seen < cursor) this.delivered.set(id, cursor);
  }

  /** Entries at or below the catch-up cursor can no longer be repeated by it. */
  private prune(): void {
    if (this.cursor === null || this.delivered.size < 10_000) return;
    for (const [id, cursor] of this.delivered) if (cursor <= this.cursor) this.delivered.delete(id);
  }

  private safely(fn: () => void): void {
    try {
      fn();
    } catch (error) {
      this.options.logger.error({ err: error }, 'listener sink failed');
    }
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.pending?.cancel(); // stop the WAITFOR now rather than at its timeout
    await this.loop?.catch(() => undefined);
    await this.dropConnection();
  }
}
