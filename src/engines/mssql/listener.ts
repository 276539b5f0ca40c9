import sql from 'mssql';
import { toError, type Closeable, type ListenerSink } from '../../engine.js';
import type { Logger } from '../../logger.js';

export interface MssqlListenerOptions {
  config: sql.config;
  sink: ListenerSink;
  logger: Logger;
  /** WAITFOR … TIMEOUT of one RECEIVE. @default 1000 */
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

/**
 * Wakes the completion hub from the notification queue, on a connection of its own.
 * A message says that a status change committed; the hub then reads the change feed
 * (the table is the truth), which also covers what this process did not receive
 * (another instance's listener took it, or it happened while disconnected).
 */
export class MssqlListener implements Closeable {
  private pool: sql.ConnectionPool | undefined;
  private pending: sql.Request | undefined;
  private closed = false;
  private loop: Promise<void> | undefined;
  private readonly waitMs: number;
  private readonly batchSize: number;
  private readonly maxBackoffMs: number;

  constructor(private readonly options: MssqlListenerOptions) {
    this.waitMs = options.waitMs ?? 1000;
    this.batchSize = options.batchSize ?? 500;
    this.maxBackoffMs = options.maxBackoffMs ?? 30_000;
  }

  async start(): Promise<void> {
    await this.connect();
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
          this.safely(() => this.options.sink.onChange());
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
    let received: number;
    try {
      received = (await request.batch(receiveBatch(this.waitMs, this.batchSize))).recordset?.length ?? 0;
    } finally {
      this.pending = undefined;
    }
    this.safely(() => this.options.sink.onHeartbeat?.());
    if (!this.closed && received) this.safely(() => this.options.sink.onChange());
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
