import pg from 'pg';
import { isTerminal, toError, type Execution, type ExecutionStatus, type ListenerSink } from '../../engine.js';
import type { Logger } from '../../logger.js';
import { connectionConfig, liftSessionLimits } from './connection.js';

/** NOTIFY payloads must stay under 8000 bytes; keys are ~30 bytes each. */
const MAX_PAYLOAD = 7000;

/**
 * Sends the hot paths' notifications after their transactions committed, batched,
 * from one connection with synchronous_commit off: a NOTIFY then holds the global
 * notify lock for microseconds instead of a WAL flush, so calls commit in parallel.
 * A notification lost here (a crash between commit and send) is a lost hint only:
 * every completion hub also reads the change feed once a second. One that could not be
 * sent is sent again (other instances hear it at once rather than at their next read),
 * and a connection that stops answering is given up after a timeout, not waited on.
 * Listeners of this process are told at once (`local`): they read the feed without waiting
 * for the NOTIFY's round trip and its delivery back to them, and ignore it when it comes
 * back (`sentBy`).
 */
export class Notifier {
  private client: pg.Client | null = null;
  private connecting: Promise<pg.Client> | null = null;
  private events: string[] = [];
  private wakes = new Set<string>();
  private sending = false;
  private closed = false;
  /**
   * This process's listeners: told of every event as it is queued, whether it ended its
   * execution, and (when the listener awaits that end) the execution the worker read back.
   */
  readonly local = new Set<Pick<ListenerSink, 'onChange' | 'awaits'>>();

  constructor(
    private readonly connectionString: string,
    private readonly logger: Logger,
    /** A send that has not answered by then is given up (and sent again on a new connection). @default 10000 */
    private readonly timeoutMs = 10_000,
  ) {}

  event(executionId: string, seq: string, status: ExecutionStatus, execution?: Execution): void {
    this.events.push(`${executionId}:${seq}:${status}`);
    this.kick();
    const own = { terminal: isTerminal(status), execution };
    for (const listener of this.local) listener.onChange(own);
  }

  /** Whether a listener of this process awaits this call's end (its worker then reads the ended row back). */
  awaited(token: string): boolean {
    for (const listener of this.local) if (listener.awaits?.(token)) return true;
    return false;
  }

  /**
   * Whether a notification came from this notifier's session (its backend pid): this process
   * heard it already, from `local` or its own wake, when the NOTIFY was queued.
   */
  sentBy(processId: number): boolean {
    return (this.client as { processID?: number } | null)?.processID === processId;
  }

  wake(queue: string): void {
    this.wakes.add(queue);
    this.kick();
  }

  private kick(): void {
    if (!this.sending && !this.closed) {
      this.sending = true;
      // after the current I/O phase, so completions that arrive together go in one NOTIFY
      setImmediate(() => void this.flush());
    }
  }

  private async connection(): Promise<pg.Client> {
    if (this.client) return this.client;
    this.connecting ??= (async () => {
      const client = new pg.Client({
        ...connectionConfig(this.connectionString),
        application_name: 'asyncproc notifier',
        // a half-open socket fails the send within seconds instead of stalling every notification
        query_timeout: this.timeoutMs,
        connectionTimeoutMillis: this.timeoutMs,
      });
      // a connection that failed or ended is forgotten, and with it its pid (sentBy)
      const forget = () => {
        if (this.client === client) this.client = null;
      };
      client.on('error', forget);
      client.on('end', forget);
      await client.connect();
      await liftSessionLimits(client);
      await client.query('set synchronous_commit = off');
      this.client = client;
      return client;
    })().finally(() => (this.connecting = null));
    return this.connecting;
  }

  private async flush(): Promise<void> {
    let failed = false;
    let unsent: string[] = [];
    let unsentWakes: string[] = [];
    try {
      while ((this.events.length || this.wakes.size) && !this.closed) {
        const payloads: string[] = [];
        let payload = '';
        const events = (unsent = this.events.splice(0));
        for (const event of events) {
          if (payload.length + event.length + 1 > MAX_PAYLOAD) {
            payloads.push(payload);
            payload = '';
          }
          payload = payload ? `${payload};${event}` : event;
        }
        if (payload) payloads.push(payload);
        const wakes = (unsentWakes = [...this.wakes]);
        this.wakes.clear();
        const client = await this.connection();
        // a named (prepared) statement: parsed and planned once per connection, not at every send
        // (planning was most of the send's cost: about 10 µs of the database's CPU a drained call)
        await client.query({
          name: 'asyncproc-notify',
          text: `select pg_notify('asyncproc_events', p) from unnest($1::text[]) p
           union all select pg_notify('asyncproc_wake', q) from unnest($2::text[]) q`,
          values: [payloads, wakes],
        });
        unsent = unsentWakes = [];
      }
    } catch (error) {
      failed = true;
      // sent again with what came since (bounded: listeners read the feed anyway)
      this.events = [...unsent, ...this.events].slice(-100_000);
      for (const queue of unsentWakes) this.wakes.add(queue);
      this.logger.warn({ err: toError(error) }, 'notifier could not send; will send again (listeners also read the feed)');
      this.client?.end().catch(() => undefined);
      this.client = null;
    } finally {
      this.sending = false;
      if ((this.events.length || this.wakes.size) && !this.closed) {
        if (failed) setTimeout(() => this.kick(), 500).unref();
        else this.kick();
      }
    }
  }

  async close(): Promise<void> {
    // send what is queued before going
    while (this.sending) await new Promise((resolve) => setTimeout(resolve, 5));
    if (this.events.length || this.wakes.size) await this.flush();
    this.closed = true;
    await this.client?.end().catch(() => undefined);
  }
}
