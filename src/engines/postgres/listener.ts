import pg from 'pg';
import type { Closeable, ExecutionEvent, ExecutionStatus, ListenerSink } from '../../engine.js';
import { toError } from '../../engine.js';
import type { Logger } from '../../logger.js';
import { getExecutionsByIds, latestCursor } from './executions.js';

export interface PostgresListenerOptions {
  connectionString: string;
  pool: pg.Pool;
  sink: ListenerSink;
  logger: Logger;
  /** A silent connection is probed this often, so a half-open one is found. @default 10000 */
  heartbeatMs?: number;
  /** The table is read this often for changes whose notification was lost. @default 1000 */
  pollMs?: number;
}

/** Changes whose commit may lag their sequence value are looked for this far back. */
const POLL_WINDOW = 5000n;

/** Insertion-ordered set that forgets its oldest members past a size. */
class RecentKeys {
  private readonly keys = new Set<string>();
  constructor(private readonly limit: number) {}
  /** False when the key was already there. */
  add(key: string): boolean {
    if (this.keys.has(key)) return false;
    this.keys.add(key);
    if (this.keys.size > this.limit) this.keys.delete(this.keys.values().next().value!);
    return true;
  }
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
  private poller: NodeJS.Timeout | null = null;
  private polling = false;
  private highWater = 0n;
  /** Changes before the listener started are not looked for (subscriptions read the table themselves). */
  private floor = 0n;
  private readonly heard = new RecentKeys(100_000);

  constructor(private readonly options: PostgresListenerOptions) {}

  /** The backend pid of the current connection (tests cut it on purpose). */
  get backendPid(): number | null {
    return (this.client as unknown as { processID?: number } | null)?.processID ?? null;
  }

  async start(): Promise<void> {
    this.highWater = this.floor = BigInt((await latestCursor(this.options.pool)) ?? '0');
    await this.connect(false);
    this.poller = setInterval(() => void this.poll(), this.options.pollMs ?? 1000);
  }

  /** The safety net: changes committed without a notification reaching us (the table is the truth). */
  private async poll(): Promise<void> {
    if (this.polling || this.closed || !this.client) return;
    this.polling = true;
    try {
      const windowed = this.highWater - POLL_WINDOW;
      const low = windowed > this.floor ? windowed : this.floor;
      const { rows } = await this.options.pool.query<{ id: string; seq: string; status: ExecutionStatus }>(
        'select id, seq, status from asyncproc.executions where seq > $1 order by seq',
        [low.toString()],
      );
      for (const row of rows) this.take(row.id, row.seq, row.status);
    } catch (error) {
      this.options.logger.debug({ err: toError(error) }, 'listener poll failed');
    } finally {
      this.polling = false;
    }
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
    for (const key of payload.split(';')) {
      const [executionId, cursor, status] = key.split(':');
      if (executionId && cursor && status) this.take(executionId, cursor, status as ExecutionStatus);
    }
  }

  private take(executionId: string, cursor: string, status: ExecutionStatus): void {
    if (!this.heard.add(`${executionId}:${cursor}`)) return;
    const seq = BigInt(cursor);
    if (seq > this.highWater) this.highWater = seq;
    if (this.options.sink.interested && !this.options.sink.interested(executionId)) return;
    this.hints.push({ executionId, cursor, status });
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
    if (this.poller) clearInterval(this.poller);
    if (this.reconnectTimer) clearTimeout(this.reconnectTimer);
    await this.client?.end().catch(() => undefined);
    this.client = null;
  }
}
