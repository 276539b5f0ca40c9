/**
 * Fan-out: one event, many subscribers, without paying per subscriber for what they share.
 *
 * - An event's selection set is executed once per distinct (document, operation, variables,
 *   viewer) and the result object is handed to every subscriber that shares them; the hub hands
 *   subscribers that are in step the same event object, so sharing needs no copy.
 * - A socket's messages of one turn of the event loop leave in one write, and a send does not
 *   wait for the kernel: graphql-ws would otherwise write one message per subscriber at a time.
 * - What replaces waiting is a bound: a subscriber whose socket holds more than its backlog
 *   limit is told SLOW_CONSUMER (resume from the last cursor with `after`) and its
 *   subscription ends, so it neither slows the others nor grows the server's memory.
 */
import { createSourceEventStream, execute, GraphQLError, print, type DocumentNode, type ExecutionArgs, type ExecutionResult } from 'graphql';
import type { Plugin } from 'graphql-yoga';
import type { Socket } from 'node:net';
import WebSocket from 'ws';
import { isAdmin, ownerFilter, type Principal } from './auth/principal.js';

/** What a subscriber may see of an event: subscribers with equal viewers may share one result. */
function viewerOf(context: unknown): string | null {
  const principal = (context as { principal?: Principal } | null)?.principal;
  if (!principal) return null;
  return JSON.stringify([isAdmin(principal), ownerFilter(principal)]);
}

function isAsyncIterable(value: unknown): value is AsyncIterable<unknown> {
  return typeof value === 'object' && value !== null && Symbol.asyncIterator in value;
}

/** `source` with each value mapped; `return` reaches the source at once, also while a `next` waits. */
function mapEvents<T, U>(source: AsyncIterable<T>, map: (value: T) => U | Promise<U>): AsyncGenerator<U> {
  const iterator = source[Symbol.asyncIterator]();
  const close = async () => (await iterator.return?.()) ?? { done: true as const, value: undefined };
  const mapped: AsyncGenerator<U> = {
    [Symbol.asyncIterator]: () => mapped,
    async next() {
      const step = await iterator.next();
      if (step.done) return { done: true, value: undefined };
      try {
        return { done: false, value: await map(step.value) };
      } catch (error) {
        await close();
        throw error;
      }
    },
    return: async () => (await close(), { done: true, value: undefined }),
    throw: async (error) => {
      await close();
      throw error;
    },
  };
  return mapped;
}

/**
 * Subscriptions execute each event once per (document, operation, variables, viewer): a
 * subscriber whose event object another subscriber of the same shape already executed gets that
 * result. Results are kept with the event object (a WeakMap), so they live as long as it does.
 */
export function useSharedEventExecution(): Plugin {
  const printed = new WeakMap<DocumentNode, string>();
  const results = new WeakMap<object, Map<string, Promise<ExecutionResult> | ExecutionResult>>();
  const shapeOf = (args: ExecutionArgs): string | null => {
    const viewer = viewerOf(args.contextValue);
    if (viewer === null) return null;
    let text = printed.get(args.document);
    if (text === undefined) printed.set(args.document, (text = print(args.document)));
    return JSON.stringify([viewer, args.operationName ?? null, args.variableValues ?? null, text]);
  };
  return {
    onSubscribe({ setSubscribeFn }) {
      setSubscribeFn(async (args: ExecutionArgs) => {
        const source = await createSourceEventStream(args);
        if (!isAsyncIterable(source)) return source;
        const shape = shapeOf(args);
        return mapEvents(source, (event) => {
          const run = () => execute({ ...args, rootValue: event });
          if (shape === null || typeof event !== 'object' || event === null) return run();
          let byShape = results.get(event);
          if (!byShape) results.set(event, (byShape = new Map()));
          let result = byShape.get(shape);
          if (result === undefined) byShape.set(shape, (result = run()));
          return result;
        });
      });
    },
  };
}

const SENT_EARLY = Symbol('bytes queued this turn of the event loop');

/**
 * The WebSocket class with coalesced writes: the first send of a turn corks the TCP socket and
 * the next turn uncorks it, so what was sent in between leaves in one write. A send's callback
 * runs once the message is queued, not written: back-pressure is `backlog` and its bound.
 */
export function coalescingWrites(Base: typeof WebSocket): typeof WebSocket {
  return class CoalescingSocket extends Base {
    [SENT_EARLY] = 0;

    override send(data: unknown, optionsOrCallback?: unknown, callback?: (error?: Error) => void): void {
      const cb = typeof optionsOrCallback === 'function' ? (optionsOrCallback as (error?: Error) => void) : callback;
      const options = typeof optionsOrCallback === 'function' ? {} : (optionsOrCallback ?? {});
      const raw = (this as unknown as { _socket?: Socket })._socket;
      if (this.readyState !== this.OPEN || !raw) {
        super.send(data as Buffer, options as object, cb);
        return;
      }
      if (this[SENT_EARLY] === 0) {
        raw.cork();
        setImmediate(() => {
          this[SENT_EARLY] = 0;
          raw.uncork();
        });
      }
      const before = raw.writableLength;
      // a failed write closes the socket; graphql-ws learns of it from 'close'
      super.send(data as Buffer, options as object, () => undefined);
      this[SENT_EARLY] += Math.max(1, raw.writableLength - before);
      if (cb) queueMicrotask(() => cb());
    }

    /** Bytes sent before this turn of the event loop that the peer has not taken yet. */
    get backlog(): number {
      return Math.max(0, this.bufferedAmount - this[SENT_EARLY]);
    }
  };
}

/** The bytes a socket holds that its peer has not taken (beyond what this turn sent). */
export function backlogOf(socket: WebSocket): number {
  const backlog = (socket as { backlog?: number }).backlog;
  return backlog ?? socket.bufferedAmount;
}

export function slowConsumerError(limit: number): GraphQLError {
  return new GraphQLError(
    `this subscriber fell more than ${limit} bytes behind and was stopped so the others are not held up; subscribe again with \`after\` set to the cursor of the last event received to get everything missed`,
    { extensions: { code: 'SLOW_CONSUMER' } },
  );
}

/**
 * A subscription's queue of events: the producer pushes without waiting, the subscriber pulls.
 * Cheaper per event than a Repeater (no promise per push), and its length is what the bound on
 * a slow subscriber counts. `fail` ends it after what is queued; `return` (the subscriber left) drops it.
 */
export class EventQueue<T> implements AsyncIterableIterator<T> {
  private readonly values: T[] = [];
  private head = 0;
  private waiting: ((step: IteratorResult<T>) => void) | null = null;
  private failed: ((error: unknown) => void) | null = null;
  private error: unknown = undefined;
  private ended = false;
  private room: (() => void) | null = null;
  /** Resolves once the subscriber has left (or the queue was ended). */
  readonly closed: Promise<void>;
  private close!: () => void;
  isClosed = false;

  constructor() {
    this.closed = new Promise((resolve) => (this.close = resolve));
  }

  get length(): number {
    return this.values.length - this.head;
  }

  push(value: T): void {
    if (this.isClosed || this.ended) return;
    if (this.waiting) {
      const resolve = this.waiting;
      this.waiting = this.failed = null;
      resolve({ done: false, value });
    } else this.values.push(value);
  }

  /** No more values: the subscriber gets what is queued, then `error` (or the end). */
  end(error?: unknown): void {
    if (this.ended) return;
    this.ended = true;
    this.error = error;
    this.isClosed = true;
    this.close();
    if (this.waiting) this.settle();
  }

  /** Resolves once no more than `n` values wait (or the queue closed). */
  async drained(n: number): Promise<void> {
    while (this.length > n && !this.isClosed) await new Promise<void>((resolve) => (this.room = resolve));
  }

  next(): Promise<IteratorResult<T>> {
    if (this.length) {
      const value = this.values[this.head];
      this.values[this.head++] = undefined as T;
      if (this.head > 1024 && this.head * 2 > this.values.length) this.values.splice(0, this.head), (this.head = 0);
      if (this.room) this.wake();
      return Promise.resolve({ done: false, value });
    }
    if (this.room) this.wake();
    return new Promise((resolve, reject) => {
      this.waiting = resolve;
      this.failed = reject;
      if (this.ended) this.settle();
    });
  }

  return(): Promise<IteratorResult<T>> {
    this.values.length = this.head = 0;
    this.ended = true;
    this.isClosed = true;
    this.close();
    this.wake();
    this.waiting?.({ done: true, value: undefined });
    this.waiting = this.failed = null;
    return Promise.resolve({ done: true, value: undefined });
  }

  throw(error: unknown): Promise<IteratorResult<T>> {
    void this.return();
    return Promise.reject(error);
  }

  [Symbol.asyncIterator](): this {
    return this;
  }

  private wake(): void {
    const room = this.room;
    this.room = null;
    room?.();
  }

  /** The queue has ended and is empty: the waiting `next` gets the error or the end, once. */
  private settle(): void {
    const [resolve, reject] = [this.waiting!, this.failed!];
    this.waiting = this.failed = null;
    const error = this.error;
    this.error = undefined;
    if (error !== undefined) reject(error);
    else resolve({ done: true, value: undefined });
  }
}
