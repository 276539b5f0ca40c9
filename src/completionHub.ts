import { Repeater } from 'graphql-yoga';
import {
  EngineError,
  isTerminal,
  toError,
  type Batch,
  type Engine,
  type Execution,
  type ExecutionEvent,
  type ExecutionFilter,
  type ListenerSink,
} from './engine.js';
import type { Logger } from './logger.js';

/** Cursors are decimal (PostgreSQL sequence) or hex (SQL Server rowversion) numbers as text. */
export function cursorValue(cursor: string): bigint {
  if (/^\d+$/.test(cursor)) return BigInt(cursor);
  return BigInt(cursor.startsWith('0x') ? cursor : `0x${cursor}`);
}

function matches(filter: ExecutionFilter, event: ExecutionEvent): boolean {
  if (filter.status?.length && !filter.status.includes(event.status)) return false;
  if (filter.procedure && filter.procedure !== event.execution.procedure) return false;
  if (filter.queue && filter.queue !== event.execution.queue) return false;
  return true;
}

/** Per-stream memory of the last change delivered for each execution, bounded. */
class Delivered {
  private readonly seen = new Map<string, bigint>();
  constructor(private readonly limit = 10_000) {}
  /** True when this change is newer than what the stream already delivered for the execution. */
  admit(event: ExecutionEvent): boolean {
    const value = cursorValue(event.cursor);
    const previous = this.seen.get(event.execution.id);
    if (previous !== undefined && previous >= value) return false;
    this.seen.delete(event.execution.id);
    this.seen.set(event.execution.id, value);
    if (this.seen.size > this.limit) this.seen.delete(this.seen.keys().next().value!);
    return true;
  }
}

interface EventStream {
  filter: ExecutionFilter;
  /** Called for live events and on a reconnect (null: catch up from the table). */
  notify(events: ExecutionEvent[] | null): void;
}

const REPLAY_PAGE = 500;

/**
 * The completion hub: receives what the engine's listener hears and fans it out
 * to subscriptions. Notifications are hints; the table is the truth, so every
 * subscription reads it when it starts and again whenever the listener reconnects.
 */
export class CompletionHub implements ListenerSink {
  /** Execution id → completion watchers; a watcher called with null re-reads the table. */
  private readonly watchers = new Map<string, Set<(execution: Execution | null) => void>>();
  private readonly streams = new Set<EventStream>();

  constructor(
    private readonly engine: Engine,
    private readonly logger: Logger,
  ) {}

  interested(executionId: string): boolean {
    return this.streams.size > 0 || this.watchers.has(executionId);
  }

  onEvents(events: ExecutionEvent[]): void {
    for (const event of events) {
      this.watchers.get(event.execution.id)?.forEach((watch) => watch(event.execution));
    }
    for (const stream of this.streams) stream.notify(events);
  }

  onReconnect(): void {
    // whatever finished while we were deaf is read from the table now
    for (const stream of this.streams) stream.notify(null);
    for (const set of this.watchers.values()) set.forEach((watch) => watch(null));
  }

  onError(error: Error): void {
    this.logger.warn({ err: error }, 'listener error');
  }

  /** Number of open subscriptions (monitoring and tests). */
  get size(): number {
    let watched = 0;
    for (const set of this.watchers.values()) watched += set.size;
    return watched + this.streams.size;
  }

  /**
   * The execution once it has finished: one value, then the stream ends — also when
   * it finished before the subscription began. Throws NOT_FOUND for an unknown token.
   */
  async completed(token: string): Promise<AsyncIterableIterator<Execution>> {
    const first = await this.engine.getExecution(token);
    if (!first) throw new EngineError('NOT_FOUND', `no execution with token ${token}`);
    return this.once({
      executionIds: [first.id],
      first,
      read: () => this.engine.getExecution(token),
      ended: (execution) => isTerminal(execution.status),
      // the listener loaded the row: no need to read it again
      onChange: (execution) => execution,
    });
  }

  /**
   * The batch once it has ended: one value, then the stream ends — also when it ended
   * before the subscription began. A batch ends in the transaction that ends its last
   * execution, so the batch is read again whenever one of its executions ends.
   */
  async batchCompleted(id: string): Promise<AsyncIterableIterator<Batch>> {
    const first = await this.engine.getBatch(id);
    if (!first) throw new EngineError('NOT_FOUND', `no batch with id ${id}`);
    return this.once({
      executionIds: (await this.engine.getBatchExecutions(id)).map((execution) => execution.id),
      first,
      read: () => this.engine.getBatch(id),
      ended: (batch) => batch.status !== 'RUNNING',
      onChange: (execution) => (isTerminal(execution.status) ? 'read' : null),
    });
  }

  /**
   * One value once `ended` holds, then the stream ends. `first` was read before the
   * watch began, so the table is read once more after it (the end may fall between),
   * again on each change `onChange` asks for, and again after a listener reconnect.
   */
  private once<T>(options: {
    executionIds: readonly string[];
    first: T;
    read: () => Promise<T | null>;
    ended: (value: T) => boolean;
    /** A change of a watched execution: the new value itself, 'read' to read the table, or null to ignore it. */
    onChange: (execution: Execution) => T | 'read' | null;
  }): AsyncIterableIterator<T> {
    const { read, ended, onChange } = options;
    return new Repeater<T>(async (push, stop) => {
      let finished = false;
      const finish = (value: T | null) => {
        if (finished || value === null || !ended(value)) return;
        finished = true;
        void push(value).then(() => stop());
      };
      let reading: Promise<void> | null = null;
      let again = false;
      const recheck = (): Promise<void> => {
        if (reading) {
          again = true;
          return reading;
        }
        const readUntilQuiet = async () => {
          do {
            again = false;
            finish(await read());
          } while (again && !finished);
        };
        return (reading = readUntilQuiet()
          .catch((error) => this.logger.warn({ err: toError(error) }, 'could not re-read a watched row'))
          .finally(() => (reading = null)));
      };
      const unwatch = this.watch(options.executionIds, (execution) => {
        // null: the listener reconnected, read the table again
        const change = execution ? onChange(execution) : 'read';
        if (change === 'read') void recheck();
        else finish(change);
      });
      try {
        finish(options.first);
        if (!finished) await recheck();
        await stop;
      } finally {
        unwatch();
      }
    });
  }

  /** Call `watcher` with each change of these executions (null: re-read, the listener reconnected). */
  private watch(executionIds: readonly string[], watcher: (execution: Execution | null) => void): () => void {
    for (const id of executionIds) {
      let set = this.watchers.get(id);
      if (!set) this.watchers.set(id, (set = new Set()));
      set.add(watcher);
    }
    return () => {
      for (const id of executionIds) {
        const set = this.watchers.get(id);
        set?.delete(watcher);
        if (set && !set.size) this.watchers.delete(id);
      }
    };
  }

  /**
   * Every status change matching `filter`: first what changed after `after`
   * (the latest state of each such execution, in change order), then live.
   */
  events(filter: ExecutionFilter, after: string | null): AsyncIterableIterator<ExecutionEvent> {
    if (after !== null && !/^(0x)?[0-9a-fA-F]+$/.test(after)) {
      throw new EngineError('BAD_USER_INPUT', `malformed cursor "${after}"`);
    }
    return new Repeater<ExecutionEvent>(async (push, stop) => {
      const delivered = new Delivered();
      let cursor = after ?? (await this.engine.latestCursor()) ?? '0';
      // nothing at or before where the stream starts is news to this subscriber
      const start = cursorValue(cursor);
      let replaying: Promise<void> | null = null;
      let again = false;
      const buffered: ExecutionEvent[] = [];
      const deliver = async (event: ExecutionEvent) => {
        if (cursorValue(event.cursor) <= start || !matches(filter, event) || !delivered.admit(event)) return;
        if (cursorValue(event.cursor) > cursorValue(cursor)) cursor = event.cursor;
        await push(event);
      };
      const replay = async () => {
        do {
          again = false;
          for (;;) {
            const page = await this.engine.eventsSince(cursor, filter, REPLAY_PAGE);
            for (const event of page) {
              await deliver(event);
              if (cursorValue(event.cursor) > cursorValue(cursor)) cursor = event.cursor;
            }
            if (page.length < REPLAY_PAGE) break;
          }
        } while (again);
        for (const event of buffered.splice(0)) await deliver(event);
      };
      const startReplay = () => {
        if (replaying) {
          again = true;
          return;
        }
        replaying = replay()
          .catch((error) => this.logger.warn({ err: toError(error) }, 'event replay failed'))
          .finally(() => (replaying = null));
      };
      const stream: EventStream = {
        filter,
        notify: (events) => {
          if (events === null) return startReplay();
          if (replaying) buffered.push(...events);
          else for (const event of events) void deliver(event);
        },
      };
      this.streams.add(stream);
      try {
        startReplay();
        await stop;
      } finally {
        this.streams.delete(stream);
      }
    });
  }
}
