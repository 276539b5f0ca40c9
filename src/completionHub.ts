import { Repeater } from 'graphql-yoga';
import { EventQueue } from './eventQueue.js';
import { extend, formatCursor, formatSnapshot, parseCursor, sees, union, type Cursor, type Snapshot } from './changeCursor.js';
import {
  EngineError,
  isTerminal,
  toError,
  type Batch,
  type Change,
  type ChangePage,
  type ChangeRead,
  type Closeable,
  type Engine,
  type Execution,
  type ExecutionEvent,
  type ExecutionFilter,
  type ExecutionProgress,
  type ExecutionStatus,
  type ListenerSink,
  type OwnChange,
} from './engine.js';
import type { Logger } from './logger.js';

function matches(filter: ExecutionFilter, execution: Execution): boolean {
  if (filter.status?.length && !filter.status.includes(execution.status)) return false;
  if (filter.procedure && filter.procedure !== execution.procedure) return false;
  if (filter.queue && filter.queue !== execution.queue) return false;
  if (filter.submittedBy != null && filter.submittedBy !== execution.submittedBy) return false;
  if (filter.schedule != null && filter.schedule !== execution.schedule) return false;
  return true;
}

/** Per-stream memory of the last change delivered for each execution, bounded. */
class Delivered {
  private readonly seen = new Map<string, bigint>();
  constructor(private readonly limit = 10_000) {}
  /** True when this change is newer than what the stream already delivered for the execution. */
  admit(change: Change): boolean {
    const previous = this.seen.get(change.execution.id);
    if (previous !== undefined && previous >= change.order) return false;
    this.seen.delete(change.execution.id);
    this.seen.set(change.execution.id, change.order);
    if (this.seen.size > this.limit) this.seen.delete(this.seen.keys().next().value!);
    return true;
  }
}

/**
 * Part of one read of the change feed: changes `upper` sees, in (writer, order) order.
 * After it, every change `upper` sees from a writer below `through` has been handed out.
 */
interface FeedBatch {
  upper: Snapshot;
  changes: Change[];
  through: bigint;
}

interface EventStream {
  receive(batch: FeedBatch): void;
  /**
   * Retention purged changes the feed had not read, written by `horizon` at the newest: the stream
   * cannot go on without a gap, unless it began from a position that sees them all (it joined
   * after they were written: what it was owed starts later).
   */
  expire(horizon: bigint): void;
}

/** A stream that ends at once: the hub is closing, or the subscriber left before its first read. */
function endedStream<T>(): EventQueue<T> {
  const queue = new EventQueue<T>();
  queue.end();
  return queue;
}

/** Rows per page of a replay and of a feed read. */
const REPLAY_PAGE = 500;
const FEED_PAGE = 1000;

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
/** How long close() waits for a read of the feed under way. */
const CLOSE_READ_WAIT_MS = 2000;
/** At most one line this often about subscriptions whose reads fail (a database out of reach). */
const SUBSCRIPTION_READS_LOG_MS = 10_000;

/**
 * `read` as a trigger that runs it one at a time: a trigger while it runs makes it run once
 * more afterwards (not once per trigger), until `done`; the promise settles when it is quiet.
 */
export function untilQuiet(read: () => Promise<void>, done: () => boolean, onError: (error: unknown) => void): () => Promise<void> {
  let reading: Promise<void> | null = null;
  let again = false;
  return () => {
    if (reading) {
      again = true;
      return reading;
    }
    const loop = async () => {
      try {
        do {
          again = false;
          await read();
        } while (again && !done());
      } catch (error) {
        onError(error);
      } finally {
        // in the same step as the loop's last look at `again`: a trigger from now on starts a new loop
        reading = null;
      }
    };
    return (reading = loop());
  };
}

/** What the hub tells an observer (the service's metrics). Called on the feed's path: keep each call cheap. */
export interface HubObserver {
  /** Asked on each read: read every change even with no subscriber (metrics were scraped lately). */
  wantsChanges?(): boolean;
  /** Changes this hub read from the feed, each once. */
  onChanges?(changes: readonly Change[]): void;
  /** Values handed to subscriptions (events and completions). */
  onDelivered?(count: number): void;
  /** The listener reported an error; it reconnects by itself. */
  onListenerError?(): void;
}

function slowConsumer(limit: number): EngineError {
  return new EngineError(
    'SLOW_CONSUMER',
    `this subscriber fell more than ${limit} changes behind and was stopped so the others are not held up; subscribe again with \`after\` set to the cursor of the last event received to get everything missed`,
  );
}

/**
 * The cursor right after `change` of a batch read from `start` with snapshot `upper`, the next
 * change's writer being `bound`: the position that sees what was read below `bound`; and when that
 * position does not see the change's own writer (more of its changes follow), how far into it the
 * subscriber has read. Otherwise the part of a writer the stream resumed inside (`given`), while
 * the position does not see it yet.
 */
function positionAfter(start: Snapshot, upper: Snapshot, bound: bigint, change: Change, given: Cursor['partial']): Cursor {
  const snapshot = extend(start, upper, bound);
  if (!sees(snapshot, change.writer)) return { snapshot, partial: { writer: change.writer, order: change.order } };
  return { snapshot, partial: given && !sees(snapshot, given.writer) ? given : null };
}

function cursorExpired(): EngineError {
  return new EngineError(
    'CURSOR_EXPIRED',
    'this cursor is older than the retention: calls whose changes it may not have read have been purged since, so nothing can be resumed from it without a gap; subscribe again without `after` (or with `changeCursor`) and read the current state',
  );
}

/** A watched call or batch whose end the feed had not read when retention purged it. */
function purgedUnread(what: string): EngineError {
  return new EngineError('NOT_FOUND', `${what} ended and was purged (retention) before this service read its end: read its history, if you keep it elsewhere`);
}

/** At most one look at the purge horizon this often, after reads of the feed (checkPurged). */
const PURGE_CHECK_MS = 1000;

export interface CompletionHubOptions {
  /** The change feed is read this often even when nothing was heard (a lost notification costs at most this). @default 1000 */
  pollMs?: number;
  /**
   * After an execution ends, its progress stream reads once more this much later before it
   * ends: a worker writes a call's last report up to its throttle interval (250 ms) late. @default 500
   */
  progressSettleMs?: number;
  /** Feed changes one event stream may still have waiting for its subscriber when the next read comes; more, and it ends with SLOW_CONSUMER. @default 20000 */
  maxQueued?: number;
}

/**
 * The completion hub: reads the engine's change feed and fans it out to subscriptions.
 * The listener's notifications only say "read now"; the hub reads the table from the
 * position it last read (a snapshot, see changeCursor.ts), so a change is read once
 * whatever order transactions commit in, a lost notification is found by the next poll,
 * and nothing a payload says is trusted.
 */
export class CompletionHub implements ListenerSink, Closeable {
  /** Execution id → watchers of its changes. */
  private readonly watchers = new Map<string, Set<(execution: Execution) => void>>();
  /** Execution token → watchers of its changes (a watch that begins before the execution is read). */
  private readonly tokenWatchers = new Map<string, Set<(execution: Execution) => void>>();
  private readonly streams = new Set<EventStream>();
  /** Execution id → progress streams to tell that a report was stored. */
  private readonly progressWatchers = new Map<string, Set<() => void>>();
  /** Grows with every trigger of the progress streams' reads (a notification, the poll): see readProgress. */
  private progressTick = 0;
  /** Execution id → the progress read its subscribers share, and the trigger it follows. */
  private readonly progressReads = new Map<string, { tick: number; read: Promise<{ progress: ExecutionProgress; execution: Execution } | null> }>();
  /** Where the feed has been read to (null until started). */
  private position: Snapshot | null = null;
  /**
   * The position before the earliest read of the feed not yet compared with the purge horizon
   * (checkPurged): a read sees nothing of what retention purged before it, so a feed that fell
   * behind by more than the retention (a stalled process, a partition) would skip those ends in silence.
   */
  private uncheckedFrom: Snapshot | null = null;
  private purgeCheckedAt = 0;
  private checkingPurge = false;
  /** Of each watch (completed, progress, once): read its row(s) again, after checkPurged found a gap. */
  private readonly rechecks = new Set<() => void>();
  /** Reads the feed one read at a time; a change heard meanwhile makes it read once more. */
  private readonly readFeed = untilQuiet(
    () => this.readOnce(),
    () => this.closed,
    // the position did not move: the next read (poll or notification) finds it all again
    (error) => {
      if (++this.failures <= 3 || this.failures % 60 === 0) {
        this.logger.warn({ err: toError(error), failures: this.failures }, 'reading the change feed failed; will read again');
      }
    },
  );
  /** The read in progress, or the last one. */
  private reading: Promise<void> = Promise.resolve();
  /** Open watches (watch() calls not yet undone): one per subscription of one value or of progress. */
  private watches = 0;
  /** Grows with every new subscription: a read that skipped rows for want of interest must not move past one. */
  private epoch = 0;
  private poller: NodeJS.Timeout | null = null;
  private closed = false;
  private failures = 0;
  /**
   * Subscriptions' own reads (a first read, a replay) that failed since the last line about
   * them, and when that line was written: one line per SUBSCRIPTION_READS_LOG_MS however many
   * subscriptions wait for the database (each retrying on its own backoff).
   */
  private failedReads = { count: 0, since: 0, loggedAt: 0 };
  private observer: HubObserver = {};
  /** Date.now() when the listener last heard from the database (null: not yet). */
  heardAt: number | null = null;
  /** Date.now() when the feed was last read, or its position last moved, successfully (null: not yet). */
  feedReadAt: number | null = null;
  /** A live batch's events by the position a stream stood at: streams in step share them (one cursor to compute, one object). */
  private readonly shared = new WeakMap<FeedBatch, Map<string, ExecutionEvent[]>>();

  constructor(
    private readonly engine: Engine,
    private readonly logger: Logger,
    private readonly options: CompletionHubOptions = {},
  ) {}

  /** Take the feed's position now and start polling it. */
  async start(): Promise<void> {
    this.position = await this.engine.currentPosition();
    this.poller = setInterval(() => {
      this.onChange();
      // a lost progress notification costs at most a poll
      this.progressTick++;
      for (const set of this.progressWatchers.values()) set.forEach((heard) => heard());
    }, this.options.pollMs ?? 1000);
  }

  onChange(own?: OwnChange): void {
    if (this.closed || !this.position) return;
    // an end this process committed, read back by its worker for a subscriber here that awaits
    // it: handed over now (the feed's read of it, below, then finds that subscriber served)
    if (own?.execution && own.terminal) this.tokenWatchers.get(own.execution.token)?.forEach((watch) => watch(own.execution!));
    // Only streams hand out a change that does not end its execution (every watcher waits for an
    // end): with none, this process's own such change waits for the next read (an end, a
    // notification or the poll) rather than cost one now, on the way of the call that made it.
    if (own && !own.terminal && !this.streams.size) return;
    this.reading = this.readFeed();
  }

  awaits(token: string): boolean {
    return this.tokenWatchers.has(token);
  }

  onProgress(executionId: string): void {
    this.progressTick++;
    this.progressWatchers.get(executionId)?.forEach((heard) => heard());
  }

  /**
   * An execution's latest progress report and the execution, read once for all its progress
   * subscribers: a read in flight that began since the last trigger (a progress notification,
   * the poll) is shared by every subscriber that asks meanwhile, so N subscribers of one call
   * woken together cost one read, not N (1,000 subscribers of one call cost about 1,350
   * transactions a second before). A read begun before the latest trigger may miss what it
   * announced, so it is not shared past it.
   */
  private readProgress(id: string, token: string): Promise<{ progress: ExecutionProgress; execution: Execution } | null> {
    const shared = this.progressReads.get(id);
    if (shared && shared.tick === this.progressTick) return shared.read;
    const read = (async () => {
      const progress = (await this.engine.getProgress?.([id]))?.get(id) ?? null;
      if (!progress) return null;
      const execution = await this.engine.getExecution(token);
      return execution ? { progress, execution } : null;
    })();
    const entry = { tick: this.progressTick, read };
    this.progressReads.set(id, entry);
    // shared while in flight only: the subscribers a trigger wakes ask at once, and nothing stays behind
    const forget = () => {
      if (this.progressReads.get(id) === entry) this.progressReads.delete(id);
    };
    read.then(forget, forget);
    return read;
  }

  onError(error: Error): void {
    this.logger.warn({ err: error }, 'listener error');
    this.observer.onListenerError?.();
  }

  onHeartbeat(): void {
    this.heardAt = Date.now();
  }

  /** Tell `observer` what the hub reads and hands out (one observer: the last given). */
  observe(observer: HubObserver): void {
    this.observer = observer;
  }

  private get interested(): boolean {
    return this.streams.size > 0 || this.watchers.size > 0 || this.tokenWatchers.size > 0 || (this.observer.wantsChanges?.() ?? false);
  }

  /** Read what changed since the position, hand it out, move the position. */
  private async readOnce(): Promise<void> {
    if (!this.interested) {
      // nobody listens: just move on, unless someone subscribed while we asked
      const epoch = this.epoch;
      const now = await this.engine.currentPosition();
      if (epoch === this.epoch && !this.interested) this.position = union(this.position!, now);
      this.feedReadAt = Date.now();
      return;
    }
    const since = this.position!;
    let upper = since;
    for await (const batch of this.pages({}, FEED_PAGE, (read) => this.engine.readChanges(since, read))) {
      this.dispatch(batch);
      upper = batch.upper;
    }
    this.position = union(since, upper);
    this.feedReadAt = Date.now();
    this.failures = 0;
    this.uncheckedFrom ??= since;
    if (Date.now() - this.purgeCheckedAt >= PURGE_CHECK_MS) void this.checkPurged();
  }

  /**
   * Whether retention purged a change the feed's reads since uncheckedFrom may not have seen (as
   * `expired` asks of a resumed cursor): then the streams end with CURSOR_EXPIRED (their clients
   * subscribe again and read the current state) and each watch reads its row again (an end is
   * delivered; a row gone ends the watch with NOT_FOUND), instead of skipping those ends in silence.
   */
  private async checkPurged(): Promise<void> {
    const from = this.uncheckedFrom;
    if (!from || this.checkingPurge || this.closed) return;
    this.checkingPurge = true;
    this.purgeCheckedAt = Date.now();
    // reads from now on are looked at by the next check
    this.uncheckedFrom = null;
    try {
      const horizon = await this.engine.purgeHorizon();
      if (horizon === null || horizon < from.xmin || this.closed) return;
      this.logger.warn(
        { streams: this.streams.size, watches: this.rechecks.size },
        'retention purged calls whose ends the change feed had not read (it fell behind by more than the retention): streams end with CURSOR_EXPIRED, and watched calls are read again',
      );
      for (const stream of this.streams) stream.expire(horizon);
      for (const recheck of this.rechecks) recheck();
    } catch (error) {
      // looked at again after the next read (the poll reads at least once a pollMs)
      // (reads meanwhile started from later positions: `from` covers them)
      this.uncheckedFrom = from;
      this.logger.warn({ err: toError(error) }, 'could not read the purge horizon; will read it again');
    } finally {
      this.checkingPurge = false;
    }
  }

  private dispatch(batch: FeedBatch): void {
    for (const change of batch.changes) {
      if (isTerminal(change.execution.status)) this.logFinished(change.execution);
      this.watchers.get(change.execution.id)?.forEach((watch) => watch(change.execution));
      this.tokenWatchers.get(change.execution.token)?.forEach((watch) => watch(change.execution));
    }
    this.observer.onChanges?.(batch.changes);
    for (const stream of this.streams) stream.receive(batch);
  }

  /** One line per execution's end, as this instance read it from the feed (grep its token). */
  private logFinished(execution: Execution): void {
    const { token, procedure, queue, status, attempts, error } = execution;
    const fields = { token, procedure, queue, status, attempts, worker: execution.worker, batchId: execution.batchId ?? undefined };
    if (error) this.logger.info({ ...fields, error: { number: error.number, message: error.message.slice(0, 500) } }, 'execution finished');
    else this.logger.info(fields, 'execution finished');
  }

  async close(): Promise<void> {
    this.closed = true;
    if (this.poller) clearInterval(this.poller);
    // a read under way is waited for a moment, not for as long as a database that does not answer
    // holds it (a new pool connection's 30 s connect timeout; the engine's close, next, cuts it)
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([this.reading, new Promise((resolve) => (timer = setTimeout(resolve, CLOSE_READ_WAIT_MS)))]);
    clearTimeout(timer);
  }

  /** Open executionEvents streams (tests: the subscriptions of other kinds do not count). */
  get streamCount(): number {
    return this.streams.size;
  }

  /**
   * Number of open subscriptions (monitoring and tests): each watch once, however many
   * executions it watches (a batch's subscriber watches every member), and each stream.
   */
  get size(): number {
    return this.watches + this.streams.size;
  }

  /**
   * The execution once it has finished: one value, then the stream ends — also when
   * it finished before the subscription began. Throws NOT_FOUND for an unknown token,
   * and for one `visible` refuses (so a caller cannot tell another's token from none).
   * `wanted`: while the database cannot be read, the first read is tried again until it
   * succeeds or the subscriber no longer waits (then the stream just ends): a subscriber that
   * leaves during an outage leaves nothing behind. Not `patient`: the read fails at once (firstRead).
   */
  async completed(token: string, visible: (execution: Execution) => boolean = () => true, wanted: () => boolean = () => true, patient = true): Promise<AsyncIterableIterator<Execution>> {
    // The watch begins before the one read of the row: an end that read does not see comes
    // through the watch (the feed hands out whatever its position did not see when the watch
    // began). What it hears before the row was found and `visible` allowed it waits for that.
    const queue = new EventQueue<Execution>();
    let allowed = false;
    let early: Execution | null = null;
    const finish = (execution: Execution) => {
      if (queue.isClosed || !isTerminal(execution.status)) return;
      this.observer.onDelivered?.(1);
      queue.push(execution);
      queue.end();
    };
    // the listener loaded the row: no need to read it again
    // read again when retention purged ends the feed had not read (checkPurged)
    const recheck = () =>
      void this.reread(() => this.engine.getExecution(token), () => queue.isClosed).then((read) => {
        if (!read || !allowed || queue.isClosed) return;
        if (read.row) finish(read.row);
        else queue.end(purgedUnread(`the execution ${token}`));
      });
    const unwatch = this.watch([token], (execution) => (allowed ? finish(execution) : (early = execution)), this.tokenWatchers, recheck);
    // tried until it succeeds (a database restarting meanwhile delays the subscription, never fails
    // it); an engine's refusal (EngineError: a malformed token, say) and a permanent error are final
    let found: { row: Execution | null } | null;
    try {
      found = await this.firstRead(() => this.engine.getExecution(token), wanted, patient);
    } catch (error) {
      unwatch();
      throw error;
    }
    if (!found) {
      // the hub is closing (the service stops, and closes the subscribers' connections), or the subscriber left
      unwatch();
      queue.end();
      return queue;
    }
    const first = found.row;
    if (!first || !visible(first)) {
      unwatch();
      throw new EngineError('NOT_FOUND', `no execution with token ${token}`);
    }
    if (!wanted()) {
      // the subscriber left during the read (an SSE request aborted then): its transport drops
      // what this returns without ending it, so nothing may stay watched for it
      unwatch();
      queue.end();
      return queue;
    }
    allowed = true;
    // the value was taken, or the subscriber left
    void queue.closed.then(unwatch);
    finish(first);
    if (early) finish(early);
    return queue;
  }

  /**
   * The execution's progress reports as they are stored (each with the execution as it is
   * then): first the latest one, if any, then each newer one, until the execution ends (a
   * report stored just after its end still comes). Reports a worker's throttle replaced, or
   * that were replaced before the hub read them, are skipped: the latest always wins.
   * NOT_FOUND as for `completed`. Engines without progress end the stream at the end.
   */
  async progress(token: string, visible: (execution: Execution) => boolean = () => true, wanted: () => boolean = () => true, patient = true): Promise<AsyncIterableIterator<Execution>> {
    // waits for the database as `completed` does
    const found = await this.firstRead(() => this.engine.getExecution(token), wanted, patient);
    if (!found) return endedStream<Execution>();
    const first = found.row;
    if (!first || !visible(first)) throw new EngineError('NOT_FOUND', `no execution with token ${token}`);
    const id = first.id;
    return new Repeater<Execution>(async (push, stop) => {
      let last: ExecutionProgress | null = null;
      /** The status of the last event pushed. */
      let told: ExecutionStatus | null = null;
      let ended = false;
      const readOnce = async () => {
        const read = await this.readProgress(id, token);
        if (!read || (last && read.progress.at.getTime() <= last.at.getTime())) return;
        last = read.progress;
        told = read.execution.status;
        this.observer.onDelivered?.(1);
        await push({ ...read.execution, progress: read.progress });
      };
      const read = untilQuiet(readOnce, () => false, (error) =>
        this.logger.warn({ err: toError(error) }, "could not read an execution's progress"),
      );
      /**
       * The stream's end, with the execution as it ended (null: gone, purged). Its last event says
       * how the call ended: when no report came after the end, the ended execution with the last
       * report (a call that failed at 50 % ended its stream at RUNNING 50 %, and a call cancelled
       * before it started with no event at all).
       */
      const end = (final: Execution | null) => {
        if (ended) return;
        ended = true;
        void sleep(this.options.progressSettleMs ?? 500)
          .then(() => read())
          .then(async () => {
            if (!final || (told !== null && isTerminal(told))) return;
            this.observer.onDelivered?.(1);
            await push({ ...final, progress: last });
          })
          .finally(() => stop());
      };
      let set = this.progressWatchers.get(id);
      if (!set) this.progressWatchers.set(id, (set = new Set()));
      const heard = () => void read();
      set.add(heard);
      const unwatch = this.watch(
        [id],
        (execution) => {
          if (isTerminal(execution.status)) end(execution);
        },
        this.watchers,
        // retention purged ends the feed had not read (checkPurged): a call gone or ended ends the stream
        () => void this.reread(() => this.engine.getExecution(token), () => ended).then((read) => read && (!read.row || isTerminal(read.row.status)) && end(read.row)),
      );
      try {
        await read();
        // the end may fall before the watch began
        const now = await this.engine.getExecution(token);
        if (!now || isTerminal(now.status)) end(now);
        await stop;
      } finally {
        unwatch();
        set.delete(heard);
        if (!set.size && this.progressWatchers.get(id) === set) this.progressWatchers.delete(id);
      }
    });
  }

  /**
   * The batch once it has ended: one value, then the stream ends — also when it ended
   * before the subscription began. A batch ends in the transaction that ends its last
   * execution, so the batch is read again whenever one of its executions ends.
   */
  async batchCompleted(id: string, visible: (batch: Batch) => boolean = () => true, wanted: () => boolean = () => true, patient = true): Promise<AsyncIterableIterator<Batch>> {
    // waits for the database as `completed` does
    const found = await this.firstRead(() => this.engine.getBatch(id), wanted, patient);
    if (!found) return endedStream<Batch>();
    const first = found.row;
    if (!first || !visible(first)) throw new EngineError('NOT_FOUND', `no batch with id ${id}`);
    const executions = await this.firstRead(() => this.engine.getBatchExecutions(id), wanted, patient);
    // no batch read, or the subscriber left during the reads (see completed): nothing is watched for it
    if (!executions || !wanted()) return endedStream<Batch>();
    return this.once({
      executionIds: executions.row.map((execution) => execution.id),
      first,
      read: () => this.engine.getBatch(id),
      ended: (batch) => batch.status !== 'RUNNING',
      onChange: (execution) => (isTerminal(execution.status) ? 'read' : null),
      what: `the batch ${id}`,
    });
  }

  /**
   * One value once `ended` holds, then the stream ends. `first` was read before the
   * watch began, so the table is read once more after it (the end may fall between),
   * again on each change `onChange` asks for, and again after a listener reconnect.
   * An EventQueue rather than a Repeater: a subscriber waiting on its execution holds
   * the queue, the watch and a few closures, and nothing of `first` once it is checked.
   */
  private once<T>(options: {
    executionIds: readonly string[];
    first: T;
    read: () => Promise<T | null>;
    ended: (value: T) => boolean;
    /** A change of a watched execution: the new value itself, 'read' to read the table, or null to ignore it. */
    onChange: (execution: Execution) => T | 'read' | null;
    /** What it waits for, in the error of a row purged before its end was read ("the batch …"). */
    what: string;
  }): AsyncIterableIterator<T> {
    const { read, ended, onChange, executionIds, first } = options;
    const queue = new EventQueue<T>();
    const finish = (value: T | null) => {
      if (queue.isClosed || value === null || !ended(value)) return;
      this.observer.onDelivered?.(1);
      queue.push(value);
      queue.end();
    };
    const recheck = untilQuiet(
      async () => finish(await read()),
      () => queue.isClosed,
      (error) => this.logger.warn({ err: toError(error) }, 'could not re-read a watched row'),
    );
    // retention purged ends the feed had not read (checkPurged): read again; a row gone ends it
    const afterPurge = () =>
      void this.reread(read, () => queue.isClosed).then((got) => {
        if (!got || queue.isClosed) return;
        if (got.row === null) queue.end(purgedUnread(options.what));
        else finish(got.row);
      });
    const unwatch = this.watch(
      executionIds,
      (execution) => {
        const change = onChange(execution);
        if (change === 'read') void recheck();
        else finish(change);
      },
      this.watchers,
      afterPurge,
    );
    // the value was taken, or the subscriber left
    void queue.closed.then(unwatch);
    finish(first);
    if (!queue.isClosed) void recheck();
    return queue;
  }

  /** Call `watcher` with each change of these executions (by id, or in `by` by token). */
  private watch(keys: readonly string[], watcher: (execution: Execution) => void, by = this.watchers, recheck?: () => void): () => void {
    this.epoch++;
    this.watches++;
    if (recheck) this.rechecks.add(recheck);
    for (const key of keys) {
      let set = by.get(key);
      if (!set) by.set(key, (set = new Set()));
      set.add(watcher);
    }
    let watching = true;
    return () => {
      if (watching) this.watches--;
      watching = false;
      if (recheck) this.rechecks.delete(recheck);
      for (const key of keys) {
        const set = by.get(key);
        set?.delete(watcher);
        if (set && !set.size) by.delete(key);
      }
    };
  }

  /**
   * Every status change matching `filter`: with `after` (an event's cursor), first the
   * latest state of each matching execution that changed since, in change order, then
   * live. Never a gap: the cursor is the position the subscriber had read to, and the
   * feed hands out exactly what that position does not see (and of a writer the cursor
   * stopped inside, what follows the last change given). A change is repeated only when a
   * stream that resumed inside one writer's changes is given its cursor inside an older one's.
   */
  events(filter: ExecutionFilter, after: string | null): AsyncIterableIterator<ExecutionEvent> {
    const resumed = after === null ? null : parseCursor(after);
    if (after !== null && !resumed) throw new EngineError('BAD_USER_INPUT', `malformed cursor "${after.slice(0, 100)}"`);
    const floor = resumed?.snapshot ?? null;
    const queue = new EventQueue<ExecutionEvent>();
    const stopped = () => queue.isClosed || this.closed;
    const delivered = new Delivered();
    /** What this subscriber has been given (or did not ask for): set before anything is emitted. */
    let covered: Snapshot;
    /** Of a writer `covered` does not see, the changes up to an order were given too (a cursor that stopped inside it). */
    let partial: Cursor['partial'] = resumed?.partial ?? null;
    /** Hand out one batch's matching changes, each with the position right after it. */
    const emit = (batch: FeedBatch, events: ExecutionEvent[] = []) => {
      const { upper, changes, through } = batch;
      const start = covered;
      const given = partial;
      for (let j = 0; j < changes.length && !queue.isClosed; j++) {
        const change = changes[j];
        if (sees(start, change.writer) || (given && change.writer === given.writer && change.order <= given.order)) continue;
        if (!matches(filter, change.execution) || !delivered.admit(change)) continue;
        const bound = j + 1 < changes.length ? changes[j + 1].writer : through;
        queue.push(
          (events[j] ??= {
            cursor: formatCursor(positionAfter(start, upper, bound, change, given)),
            status: change.execution.status,
            execution: change.execution,
          }),
        );
        this.observer.onDelivered?.(1);
      }
      covered = extend(start, upper, through);
      // read past the writer the cursor stopped in: nothing of it is left to skip
      if (partial && sees(covered, partial.writer)) partial = null;
    };
    const maxQueued = this.options.maxQueued ?? 20_000;
    // batches the feed hands out while the replay runs wait for it
    let buffered: FeedBatch[] | null = [];
    let bufferedChanges = 0;
    /** Where this stream began: its cursor, or (without one) the position of its first read. */
    let began: Snapshot | null = floor;
    const stream: EventStream = {
      // a stream that began seeing every purged writer was owed none of their changes (a new
      // subscriber that joined after the purge was ended with the others on a loaded machine)
      expire: (horizon) => {
        if (!began || horizon >= began.xmin) queue.end(cursorExpired());
      },
      receive: (batch) => {
        // The feed is shared: a subscriber that does not take its events is stopped, never waited
        // for. It is one still holding more than the bound when the next read comes: a read hands
        // out a page at once (up to FEED_PAGE changes), more than a bound below a page, which a
        // subscriber that keeps up takes before the next one. It holds at most the bound and a page.
        if (queue.length + bufferedChanges > maxQueued) {
          queue.end(slowConsumer(maxQueued));
          // what it buffered during its replay goes with it (the replay, woken, stops)
          if (buffered) buffered.length = 0;
          bufferedChanges = 0;
          return;
        }
        if (buffered) {
          buffered.push(batch);
          bufferedChanges += batch.changes.length;
        } else emit(batch, this.sharedEvents(batch, covered, partial));
      },
    };
    this.streams.add(stream);
    this.epoch++;
    void (async () => {
      try {
        // read after joining the feed: what the feed hands out from now on is past `upper` or seen by it
        const upper = await this.untilRead(() => this.engine.currentPosition(), stopped, this.final);
        if (!upper) return;
        if (floor && floor.xmax > upper.xmax) {
          // Writers are numbered in commit-independent order and only ever forward: a cursor past
          // the database's next writer was not given by this database as it is now. After a
          // failover that lost commits the new primary numbers writers again from below the
          // cursor, and resuming would skip its new changes until the numbers pass it.
          queue.end(
            new EngineError(
              'CURSOR_AHEAD',
              'this cursor is ahead of the database (it failed over and lost commits, was restored from a backup, or the cursor is from another database): nothing can be resumed from it; subscribe again without `after` (or with `changeCursor`) and read the current state',
            ),
          );
          return;
        }
        covered = floor ?? upper;
        began = covered;
        if (floor && (await this.expired(floor, stopped))) {
          queue.end(cursorExpired());
          return;
        }
        if (floor) {
          // everything `upper` sees and `floor` does not, matching the filter; a page at a time as the subscriber takes them
          const read = (request: ChangeRead) => this.untilRead(() => this.engine.readChanges(floor, request), stopped, this.final);
          // stopped inside a writer, with no older one left unseen: the read starts right after
          // the last change given (else it reads that writer from its start, and emit skips what
          // was given)
          const from = partial && !floor.xip.some((x) => x < partial!.writer) ? partial : undefined;
          for await (const batch of this.pages(filter, REPLAY_PAGE, read, upper, from)) {
            emit(batch);
            await queue.drained(REPLAY_PAGE);
            if (stopped()) return;
          }
          // a purge that committed while the replay read may have taken a change it had not
          // read yet: the horizon, raised in the purge's transaction, says so now
          if (await this.expired(floor, stopped)) {
            queue.end(cursorExpired());
            return;
          }
        }
        for (const batch of buffered.splice(0)) emit(batch, this.sharedEvents(batch, covered, partial));
        buffered = null;
        bufferedChanges = 0;
        await queue.closed;
      } catch (error) {
        this.logger.warn({ err: toError(error) }, 'event stream failed');
        queue.end(toError(error));
      } finally {
        this.streams.delete(stream);
        // the stream ends when its producer does (an ended queue ignores this)
        queue.end();
      }
    })();
    return queue;
  }

  /**
   * Whether retention purged a change `floor` may not see: a writer of a purged execution at or
   * above its xmin (the writers below xmin it sees; those above it are not told apart, so a
   * cursor taken while a transaction older than the purged calls' last change was open counts as
   * expired too).
   */
  private async expired(floor: Snapshot, stopped: () => boolean): Promise<boolean> {
    const horizon = await this.untilRead(() => this.engine.purgeHorizon(), stopped, this.final);
    return horizon !== null && horizon >= floor.xmin;
  }

  /** The events of a live batch for streams standing at `start` (and `partial`), shared by all of them. */
  private sharedEvents(batch: FeedBatch, start: Snapshot, partial: Cursor['partial']): ExecutionEvent[] {
    let byStart = this.shared.get(batch);
    if (!byStart) this.shared.set(batch, (byStart = new Map()));
    const key = formatCursor({ snapshot: start, partial });
    let events = byStart.get(key);
    if (!events) byStart.set(key, (events = []));
    return events;
  }

  /**
   * One read of the feed, page by page: what `read` returns from its position (matching
   * `filter`), up to the snapshot of the first page, or `upTo` when given. `read` makes
   * the engine call (a subscriber's replay retries it; null ends the read).
   */
  private async *pages(
    filter: ExecutionFilter,
    limit: number,
    read: (request: ChangeRead) => Promise<ChangePage | null>,
    upTo?: Snapshot,
    from?: ChangeRead['after'],
  ): AsyncGenerator<FeedBatch> {
    let upper = upTo;
    let after = from;
    for (;;) {
      const page = await read({ filter, limit, upTo: upper, after });
      if (!page) return;
      upper ??= page.position;
      const final = page.changes.length < limit;
      after = page.changes.at(-1);
      yield { upper, changes: page.changes, through: final ? upper.xmax : after!.writer };
      if (final) return;
    }
  }

  /**
   * A subscriber's first read gives up on an engine's refusal (EngineError: a malformed token, say)
   * and on a database error that waiting will not mend (a missing table, a permission denied):
   * the subscriber is told (an unexpected error, logged) rather than kept waiting in silence.
   */
  private readonly final = (error: unknown): boolean => error instanceof EngineError || !this.engine.isTransient(error);

  /**
   * A subscriber's first read (untilRead, `final`), its value wrapped (`row` may be null); null: the
   * subscriber left or the hub closed. Not `patient` (a subscription over SSE, whose response
   * starts only once it has subscribed: a proxy's timeout would cut it in silence): any error is
   * final, a database out of reach answered at once (503, as a query's).
   */
  private firstRead<T>(read: () => Promise<T>, wanted: () => boolean, patient = true): Promise<{ row: T } | null> {
    return this.reread(read, () => !wanted(), patient ? this.final : () => true);
  }

  /** `read` tried until it succeeds (untilRead), its value wrapped (`row` may be null); null: `stopped`, or the hub closed. */
  private reread<T>(read: () => Promise<T>, stopped: () => boolean, final?: (error: unknown) => boolean): Promise<{ row: T } | null> {
    return this.untilRead(async () => ({ row: await read() }), stopped, final);
  }

  /** A read the subscriber depends on is tried until it succeeds (null: the subscriber left), unless `final` says an error is for good. */
  private async untilRead<T>(read: () => Promise<T>, stopped: () => boolean, final: (error: unknown) => boolean = () => false): Promise<T | null> {
    for (let backoff = 250; ; backoff = Math.min(backoff * 2, 5000)) {
      if (stopped() || this.closed) return null;
      try {
        const value = await read();
        if (this.failedReads.loggedAt) {
          // the first read to succeed after failures says so, once
          this.logger.info({ failedReads: this.failedReads.count }, 'subscriptions read the database again');
          this.failedReads = { count: 0, since: 0, loggedAt: 0 };
        }
        return value;
      } catch (error) {
        if (final(error)) throw error;
        this.failedReads.count++;
        const now = Date.now();
        if (now - this.failedReads.loggedAt >= SUBSCRIPTION_READS_LOG_MS) {
          this.logger.warn(
            { err: toError(error), failedReads: this.failedReads.count, sinceMs: this.failedReads.since ? now - this.failedReads.since : 0 },
            'subscriptions could not read the database; each tries again (failedReads: since the last such line)',
          );
          this.failedReads = { count: 0, since: this.failedReads.since || now, loggedAt: now };
        }
        await sleep(backoff);
      }
    }
  }
}
