import pg from 'pg';
import type { Closeable, ListenerSink } from '../../engine.js';
import { EXECUTION_STATUSES, toError } from '../../engine.js';
import type { Logger } from '../../logger.js';
import { connectionConfig, cutShort, liftSessionLimits, trackedClient } from './connection.js';
import { PROGRESS_CHANNEL } from './progress.js';

export interface PostgresListenerOptions {
  connectionString: string;
  sink: ListenerSink;
  logger: Logger;
  /** A silent connection is probed this often, so a half-open one is found. @default 10000 */
  heartbeatMs?: number;
  /** Whether a notification's sender is this process's own notifier (the sink heard its events already). */
  ownSender?: (processId: number) => boolean;
}

/** One notification key: `id:seq:status`. */
const KEY = new RegExp(`^\\d{1,19}:\\d{1,19}:(?:${EXECUTION_STATUSES.join('|')})$`);

/**
 * Whether a payload of asyncproc_events has our shape (keys joined by `;`). Any database
 * user may NOTIFY on the channel: a payload is never trusted for more than "read the feed".
 */
export function isEventPayload(payload: string): boolean {
  return payload.length > 0 && payload.length < 8000 && payload.split(';').every((key) => KEY.test(key));
}

/**
 * The completion listener: a dedicated connection doing LISTEN asyncproc_events. A
 * notification is a hint that the change feed has something new; the hub reads the
 * feed (the table is the truth), so a payload's content is never acted on. It reconnects
 * with capped backoff and then asks the hub to read, for whatever it missed while deaf.
 */
export class PostgresListener implements Closeable {
  private client: pg.Client | null = null;
  private closed = false;
  private heartbeat: NodeJS.Timeout | null = null;
  private backoff = 100;
  private reconnectTimer: NodeJS.Timeout | null = null;
  private connecting: Promise<void> | null = null;
  /** A connection on its way (close() cuts it short). */
  private readonly opening = new Set<pg.Client>();
  private readonly Client = trackedClient(this.opening);
  private malformed = 0;

  constructor(private readonly options: PostgresListenerOptions) {}

  /** The backend pid of the current connection (tests cut it on purpose). */
  get backendPid(): number | null {
    return (this.client as unknown as { processID?: number } | null)?.processID ?? null;
  }

  async start(): Promise<void> {
    await this.connect(false);
  }

  private async connect(isReconnect: boolean): Promise<void> {
    const client = new this.Client({ ...connectionConfig(this.options.connectionString), application_name: 'asyncproc listener' });
    let lost = false;
    const onLost = (error?: Error) => {
      if (lost) return;
      lost = true;
      const connected = this.client === client;
      if (connected) {
        this.client = null;
        // its probe goes with it (a reconnect starts its own)
        if (this.heartbeat) clearInterval(this.heartbeat);
        this.heartbeat = null;
      }
      client.end().catch(() => undefined);
      if (this.closed) return;
      // a lost connection is told once (the listener_reconnects_total metric); an attempt to
      // connect again that fails while the database is away is only logged
      if (connected) {
        this.options.logger.warn({ err: error }, 'listener connection lost; reconnecting');
        this.options.sink.onError(error ?? new Error('the listener connection ended'));
      } else this.options.logger.warn({ err: error }, 'listener could not connect; trying again');
      this.scheduleReconnect();
    };
    client.on('error', onLost);
    client.on('end', () => onLost());
    client.on('notification', (msg) => {
      // heard from the database (readiness, the listener_lag_seconds metric), not only by the heartbeat
      this.options.sink.onHeartbeat?.();
      // this process's own notifier: its listeners were told when it queued the NOTIFY
      if (msg.channel === 'asyncproc_events' && this.options.ownSender?.(msg.processId)) return;
      this.hear(msg.channel, msg.payload);
    });
    try {
      await client.connect();
      await liftSessionLimits(client);
      await client.query(`listen asyncproc_events; listen ${PROGRESS_CHANNEL}`);
    } catch (error) {
      onLost(toError(error));
      if (!isReconnect) throw error;
      return;
    }
    // closed while this connection was on its way (a reconnect the close did not see): it must
    // not outlive the close, nor start a probe that would keep the process from exiting
    if (this.closed) {
      lost = true;
      await client.end().catch(() => undefined);
      return;
    }
    this.client = client;
    this.backoff = 100;
    this.options.sink.onHeartbeat?.();
    this.startHeartbeat(client, onLost);
    // whatever changed while we were deaf is in the feed
    if (isReconnect) this.options.sink.onChange();
  }

  private hear(channel: string, payload: string | undefined): void {
    if (channel === 'asyncproc_events' && payload !== undefined && isEventPayload(payload)) {
      this.options.sink.onChange();
      return;
    }
    // a report was stored: the hub reads it (the payload only says whose)
    if (channel === PROGRESS_CHANNEL && payload !== undefined && /^\d{1,19}$/.test(payload)) {
      this.options.sink.onProgress?.(payload);
      return;
    }
    // logged, never acted on (the first few, then every thousandth: a flood must not flood the log)
    if (++this.malformed <= 10 || this.malformed % 1000 === 0) {
      this.options.logger.warn({ channel, payload: payload?.slice(0, 200), count: this.malformed }, 'ignored a malformed notification');
    }
  }

  private scheduleReconnect(): void {
    if (this.reconnectTimer || this.closed) return;
    const delay = this.backoff;
    this.backoff = Math.min(this.backoff * 2, 5000);
    this.reconnectTimer = setTimeout(() => {
      this.reconnectTimer = null;
      this.connecting = this.connect(true).finally(() => (this.connecting = null));
    }, delay);
  }

  private startHeartbeat(client: pg.Client, onLost: (e?: Error) => void): void {
    if (this.heartbeat) clearInterval(this.heartbeat);
    const every = this.options.heartbeatMs ?? 10_000;
    this.heartbeat = setInterval(() => {
      const timeout = setTimeout(() => onLost(new Error('listener heartbeat timed out')), every);
      client.query('select 1').then(
        () => {
          clearTimeout(timeout);
          this.options.sink.onHeartbeat?.();
        },
        (error) => {
          clearTimeout(timeout);
          onLost(toError(error));
        },
      );
    }, every);
  }

  async close(): Promise<void> {
    this.closed = true;
    if (this.heartbeat) clearInterval(this.heartbeat);
    if (this.reconnectTimer) clearTimeout(this.reconnectTimer);
    // a reconnect on its way is cut short (a database that does not answer would hold the close
    // for the connect timeout); one that got through ends its connection once it sees the close
    this.opening.forEach(cutShort);
    await this.connecting;
    await this.client?.end().catch(() => undefined);
    this.client = null;
  }
}
