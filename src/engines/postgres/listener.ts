import pg from 'pg';
import type { Closeable, ExecutionEvent, ExecutionStatus, ListenerSink } from '../../engine.js';
import { toError } from '../../engine.js';
import type { Logger } from '../../logger.js';
import { getExecutionsByIds } from './executions.js';

export interface PostgresListenerOptions {
  connectionString: string;
  pool: pg.Pool;
  sink: ListenerSink;
  logger: Logger;
  /** A silent connection is probed this often, so a half-open one is found. @default 10000 */
  heartbeatMs?: number;
}

interface Hint {
  executionId: string;
  cursor: string;
  status: ExecutionStatus;
}

/**
 * The completion listener: a dedicated connection doing LISTEN asyncproc_events.
 * Notifications carry keys (`id:seq:status`); rows are read in batches from the
 * table. It reconnects with capped backoff and then tells the sink to catch up.
 */
export class PostgresListener implements Closeable {
  private client: pg.Client | null = null;
  private closed = false;
  private hints: Hint[] = [];
  private flushing = false;
  private heartbeat: NodeJS.Timeout | null = null;
  private backoff = 100;
  private reconnectTimer: NodeJS.Timeout | null = null;

  constructor(private readonly options: PostgresListenerOptions) {}

  /** The backend pid of the current connection (tests cut it on purpose). */
  get backendPid(): number | null {
    return (this.client as unknown as { processID?: number } | null)?.processID ?? null;
  }

  async start(): Promise<void> {
    await this.connect(false);
  }

  private async connect(isReconnect: boolean): Promise<void> {
    const client = new pg.Client({
      connectionString: this.options.connectionString,
      application_name: 'asyncproc listener',
      keepAlive: true,
    });
    let lost = false;
    const onLost = (error?: Error) => {
      if (lost) return;
      lost = true;
      if (this.client === client) this.client = null;
      client.end().catch(() => undefined);
      if (this.closed) return;
      this.options.logger.warn({ err: error }, 'listener connection lost; reconnecting');
      if (error) this.options.sink.onError(error);
      this.scheduleReconnect();
    };
    client.on('error', onLost);
    client.on('end', () => onLost());
    client.on('notification', (msg) => {
      if (msg.channel === 'asyncproc_events' && msg.payload) this.hear(msg.payload);
    });
    try {
      await client.connect();
      await client.query('listen asyncproc_events');
    } catch (error) {
      onLost(toError(error));
      if (!isReconnect) throw error;
      return;
    }
    this.client = client;
    this.backoff = 100;
    this.startHeartbeat(client, onLost);
    if (isReconnect) this.options.sink.onReconnect();
  }

  private scheduleReconnect(): void {
    if (this.reconnectTimer || this.closed) return;
    const delay = this.backoff;
    this.backoff = Math.min(this.backoff * 2, 5000);
    this.reconnectTimer = setTimeout(() => {
      this.reconnectTimer = null;
      void this.connect(true);
    }, delay);
  }

  private startHeartbeat(client: pg.Client, onLost: (e?: Error) => void): void {
    if (this.heartbeat) clearInterval(this.heartbeat);
    const every = this.options.heartbeatMs ?? 10_000;
    this.heartbeat = setInterval(() => {
      const timeout = setTimeout(() => onLost(new Error('listener heartbeat timed out')), every);
      client.query('select 1').then(
        () => clearTimeout(timeout),
        (error) => {
          clearTimeout(timeout);
          onLost(toError(error));
        },
      );
    }, every);
  }

  private hear(payload: string): void {
    const [executionId, cursor, status] = payload.split(':');
    if (!executionId || !cursor || !status) return;
    if (this.options.sink.interested && !this.options.sink.interested(executionId)) return;
    this.hints.push({ executionId, cursor, status: status as ExecutionStatus });
    if (!this.flushing) {
      this.flushing = true;
      setImmediate(() => void this.flush());
    }
  }

  /** Load the rows of everything heard since the last flush, in one query. */
  private async flush(): Promise<void> {
    while (this.hints.length && !this.closed) {
      const batch = this.hints.splice(0, 1000);
      try {
        const rows = await getExecutionsByIds(this.options.pool, [...new Set(batch.map((h) => h.executionId))]);
        const byId = new Map(rows.map((r) => [r.id, r]));
        const events: ExecutionEvent[] = [];
        for (const hint of batch) {
          const execution = byId.get(hint.executionId);
          if (execution) events.push({ cursor: hint.cursor, status: hint.status, execution });
        }
        if (events.length) this.options.sink.onEvents(events);
      } catch (error) {
        // rows could not be read: the sink catches up from the table
        this.options.sink.onError(toError(error));
        this.options.sink.onReconnect();
      }
    }
    this.flushing = false;
  }

  async close(): Promise<void> {
    this.closed = true;
    if (this.heartbeat) clearInterval(this.heartbeat);
    if (this.reconnectTimer) clearTimeout(this.reconnectTimer);
    await this.client?.end().catch(() => undefined);
    this.client = null;
  }
}
