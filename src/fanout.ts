/**
 * Fan-out: one event, many subscribers, without paying per subscriber for what they share. An
 * event's selection set is executed once per distinct (document, operation, variables, viewer)
 * and the result object is handed to every subscriber that shares them; the hub hands
 * subscribers that are in step the same event object, so sharing needs no copy. A result is
 * turned into JSON once for all the subscribers it is handed to (serializedOnce). A socket's
 * messages of one turn of the event loop leave in one write (coalescingWrites).
 */
import { createSourceEventStream, execute, print, type DocumentNode, type ExecutionArgs, type ExecutionResult, type GraphQLError } from 'graphql';
import { createGraphQLError, type Plugin } from 'graphql-yoga';
import type { Socket } from 'node:net';
import WebSocket from 'ws';
import { callerRoles, isAdmin, ownerFilter, type Principal } from './auth/principal.js';

/** What a subscriber may see of an event: subscribers with equal viewers may share one result. */
function viewerOf(context: unknown): string | null {
  const principal = (context as { principal?: Principal } | null)?.principal;
  if (!principal) return null;
  // every input a resolver may decide by: who may see everything, whose work, which roles
  return JSON.stringify([isAdmin(principal), ownerFilter(principal), [...(callerRoles(principal) ?? [])].sort()]);
}

/** What yoga lets through its masking as an aborted request: a DOMException named AbortError or TimeoutError, nothing else. */
function isAbortError(error: unknown): boolean {
  const e = error as { constructor?: { name?: string }; name?: string } | null;
  return e?.constructor?.name === 'DOMException' && (e.name === 'AbortError' || e.name === 'TimeoutError');
}

function isAsyncIterable(value: unknown): value is AsyncIterable<unknown> {
  return typeof value === 'object' && value !== null && Symbol.asyncIterator in value;
}

/**
 * `source` with each value mapped; `return` reaches the source at once, also while a `next` waits.
 * An error that ends the stream (the source's, or the map's) is thrown as `fail` makes it.
 * A class, not closures: a subscriber holds one of these all its life.
 */
class MappedEvents<T, U> implements AsyncGenerator<U> {
  private readonly iterator: AsyncIterator<T>;
  constructor(
    source: AsyncIterable<T>,
    private readonly map: (value: T) => U | Promise<U>,
    private readonly fail: (error: unknown) => unknown = (error) => error,
    /** Called when the stream ends, however it ends. */
    private readonly ended?: () => void,
  ) {
    this.iterator = source[Symbol.asyncIterator]();
  }

  [Symbol.asyncIterator](): this {
    return this;
  }

  /** Set by endAfterThis: the value being mapped is the last one. */
  private ending = false;

  /** End after the value being mapped (the map's result is still delivered). */
  endAfterThis(): void {
    this.ending = true;
  }

  /** Set by stopWith: the stream's last value, delivered in place of its next event. */
  private last: { value: U } | null = null;

  /** Deliver `value` now, a `next` waiting for an event included, as the stream's last value. */
  stopWith(value: U): void {
    if (this.ending || this.last) return;
    this.last = { value };
    // a waiting next() is answered by the source's end, and delivers `value` instead
    void this.iterator.return?.();
  }

  async next(): Promise<IteratorResult<U>> {
    if (this.ending) {
      await this.close();
      return { done: true, value: undefined };
    }
    if (this.last) return this.lastValue();
    let step: IteratorResult<T>;
    try {
      step = await this.iterator.next();
    } catch (error) {
      if (this.last) return this.lastValue();
      this.ended?.();
      throw this.fail(error);
    }
    if (this.last) return this.lastValue();
    if (step.done) {
      this.ended?.();
      return { done: true, value: undefined };
    }
    try {
      return { done: false, value: await this.map(step.value) };
    } catch (error) {
      await this.close();
      throw this.fail(error);
    }
  }

  async return(): Promise<IteratorResult<U>> {
    await this.close();
    return { done: true, value: undefined };
  }

  async throw(error: unknown): Promise<IteratorResult<U>> {
    await this.close();
    throw error;
  }

  private lastValue(): IteratorResult<U> {
    this.ending = true;
    return { done: false, value: this.last!.value };
  }

  private async close(): Promise<void> {
    this.ended?.();
    await this.iterator.return?.();
  }
}

/**
 * Where a subscription's context says graphql-ws may take its events straight from this plugin
 * (see eventsOf): set by the server on the context, which envelop copies (with this symbol
 * key) into the context a subscription runs with, so both share the holder.
 */
export const SHARED_EVENTS = Symbol('asyncproc.sharedEvents');
interface EventsHolder {
  events?: AsyncGenerator<ExecutionResult>;
}

/** Mark a subscription's context: its events, already masked, are then kept in it for eventsOf. */
export function holdEvents<T extends object>(context: T): T {
  (context as Record<symbol, EventsHolder>)[SHARED_EVENTS] = {};
  return context;
}

/**
 * The events of a subscription this plugin made, as they leave it (each result masked once),
 * when its context was marked by holdEvents; else `result`, as envelop returned it. Envelop wraps
 * every subscriber's stream once more for the error-masking plugin's per-event hook (a mapped
 * iterator and a few promises per event per subscriber: with 50 subscribers of one busy stream,
 * about a third of the service's CPU); the plugin masks each shared result once instead, so
 * graphql-ws can take the stream under the wrapper. Only a stream: an error result (the
 * subscription refused) is envelop's, masked by it. What the wrapper would add per event is the
 * masking plugin's (its onNext, and its onSubscribeError with yoga's for aborted requests), which
 * useSharedEventExecution applies itself (`maskError`); a plugin with per-event hooks of its own
 * (onSubscribeResult returning onNext or onEnd) would need the same here.
 */
export function eventsOf<T>(context: unknown, result: T): T | AsyncGenerator<ExecutionResult> {
  const events = (context as Record<symbol, EventsHolder> | null)?.[SHARED_EVENTS]?.events;
  return events && isAsyncIterable(result) ? events : result;
}

/**
 * Subscriptions execute each event once per (document, operation, variables, viewer): a
 * subscriber whose event object another subscriber of the same shape already executed gets that
 * result. Results are kept with the event object (a WeakMap), so they live as long as it does.
 */
export function useSharedEventExecution(options: {
  /**
   * The context one event is executed with. A subscription keeps its context for its whole
   * life: what a request may cache (dataloaders) must be made again for each event, or a later
   * event is served what was read for an earlier one.
   */
  eventContext?: (context: unknown) => unknown;
  /**
   * The service's error masking, applied to each executed result once (the result of an event
   * shared by many subscribers included), as envelop's masking plugin applies it per subscriber.
   */
  maskError?: (error: unknown) => GraphQLError;
  /**
   * Whether a subscriber's credentials still hold, asked before each of its events (true: at
   * once, without a promise). Refused: the subscriber gets one UNAUTHENTICATED error and its
   * stream ends, over either transport (a revoked API key, a JWT past its `exp`).
   */
  admit?: (context: unknown) => true | Promise<boolean>;
  /**
   * Also asked every this many milliseconds of every running stream: a stream whose credentials
   * lapse while no event comes (an idle SSE stream holds its caller's stream slot) ends then.
   */
  recheckMs?: number;
} = {}): Plugin {
  const { maskError } = options;
  const masked = (result: ExecutionResult): ExecutionResult =>
    withSharedJson(maskError && result.errors?.length ? { ...result, errors: result.errors.map((error) => maskError(error)) } : result);
  // an error that ends a stream, as envelop's masking plugin makes it; an aborted request's
  // (a DOMException AbortError or TimeoutError, yoga's own test) stays as it is
  const failure = (error: unknown): unknown => (maskError && !isAbortError(error) ? maskError(error) : error);
  /** Running streams, each with the check of its credentials that ends it when they lapse (recheckMs). */
  const running = new Map<MappedEvents<unknown, ExecutionResult>, () => void>();
  let recheck: NodeJS.Timeout | undefined;
  const watch = (events: MappedEvents<unknown, ExecutionResult>, check: () => void) => {
    running.set(events, check);
    if (!recheck && options.recheckMs) {
      recheck = setInterval(() => running.forEach((check) => check()), options.recheckMs);
      recheck.unref();
    }
  };
  const unwatch = (events: MappedEvents<unknown, ExecutionResult>) => {
    if (!running.delete(events) || running.size) return;
    clearInterval(recheck);
    recheck = undefined;
  };
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
        // worked out at the first event: a subscriber that waits long holds no shape string meanwhile
        let shape: string | null | undefined;
        const lapsed = (): ExecutionResult => ({
          errors: [createGraphQLError('your credentials have expired or were revoked: subscribe again with valid ones', { extensions: { code: 'UNAUTHENTICATED' } })],
        });
        const refused = (): ExecutionResult => {
          events.endAfterThis();
          return lapsed();
        };
        const deliver = (event: unknown) => {
          const run = async () =>
            masked(await execute({ ...args, rootValue: event, contextValue: options.eventContext ? options.eventContext(args.contextValue) : args.contextValue }));
          if (shape === undefined) shape = shapeOf(args);
          if (shape === null || typeof event !== 'object' || event === null) return run();
          let byShape = results.get(event);
          if (!byShape) results.set(event, (byShape = new Map()));
          let result = byShape.get(shape);
          if (result === undefined) byShape.set(shape, (result = run()));
          return result;
        };
        const events: MappedEvents<unknown, ExecutionResult> = new MappedEvents(
          source,
          (event) => {
            const admitted = options.admit?.(args.contextValue) ?? true;
            if (admitted === true) return deliver(event);
            return admitted.then((yes) => (yes ? deliver(event) : refused()));
          },
          failure,
          () => unwatch(events),
        );
        if (options.admit && options.recheckMs) {
          const { admit } = options;
          watch(events, () => {
            const admitted = admit(args.contextValue);
            if (admitted !== true) void admitted.then((yes) => yes || events.stopWith(lapsed()));
          });
        }
        const holder = (args.contextValue as Record<symbol, EventsHolder> | null)?.[SHARED_EVENTS];
        if (holder) holder.events = events;
        return events;
      });
    },
  };
}

/** A result's payload as JSON, made at its first subscriber's message, kept as long as the result. */
const payloads = new WeakMap<object, string>();

/**
 * An error's JSON without `extensions.http`: the status and headers yoga answers an HTTP request
 * with (429 and Retry-After for RATE_LIMITED), and strips from what it writes there. Over a
 * socket nothing reads them, and they are the service's own wiring. (Errors are written here only
 * for graphql-ws: a shared result with errors is not handed to yoga's SSE writer, see withSharedJson.)
 */
function withoutHttp(error: ReturnType<GraphQLError['toJSON']>): ReturnType<GraphQLError['toJSON']> {
  if (!error.extensions || !('http' in error.extensions)) return error;
  const { http: _http, ...extensions } = error.extensions;
  return { ...error, extensions };
}

/**
 * A result's payload as JSON, the one graphql-ws writes (the result, its errors by their
 * toJSON() without extensions.http, last), once per result object. Without errors it is the result's plain JSON, as
 * yoga's SSE writer makes it.
 */
function payloadJson(result: ExecutionResult): string {
  let json = payloads.get(result);
  if (json === undefined) {
    const { errors, ...rest } = result;
    json = JSON.stringify(errors ? { ...rest, errors: errors.map((e) => withoutHttp(e.toJSON())) } : rest);
    payloads.set(result, json);
  }
  return json;
}

/**
 * A shared result that yoga's SSE processor turns into JSON once for all its subscribers: it
 * calls a result's own `stringify`, when it has one, with the result (or, when the result
 * carries errors or HTTP extensions, with a sanitized copy, which is then turned into JSON on
 * its own). Not enumerable: no JSON and no copy of the result carries it.
 */
function withSharedJson(result: ExecutionResult): ExecutionResult {
  if (!result.errors?.length) Object.defineProperty(result, 'stringify', { value: payloadJson, enumerable: false });
  return result;
}
/** What a payload's toJSON() writes in graphql-ws's message, for the socket's send to replace with the payload's JSON. */
const PAYLOAD_MARK = '\u0000asyncproc:payload';
const MARKED_END = `"payload":${JSON.stringify(PAYLOAD_MARK)}}`;
/** The JSON of the payload whose toJSON() ran last: its message's send, which follows at once, takes it. */
let markedPayload: string | null = null;

/** A payload graphql-ws writes as the mark; the socket's send puts its JSON in its place. */
class SerializedPayload {
  constructor(private readonly json: string) {}
  toJSON(): string {
    markedPayload = this.json;
    return PAYLOAD_MARK;
  }
}

/**
 * graphql-ws's `onNext`: the payload of a `next` message, turned into JSON once per result object
 * rather than once per subscriber (graphql-ws writes every message with JSON.stringify; with 50
 * subscribers of one stream, that was a tenth of the service's CPU). The JSON is the one
 * graphql-ws would write: the result, its errors by their toJSON(). graphql-ws stringifies the
 * message and hands it to the socket's send in the same synchronous step, where the mark that
 * ends it is replaced (coalescingWrites): the mark is the message's last property, after the
 * subscription id the client chose, so a client cannot make it appear anywhere else.
 */
export function serializedOnce(result: ExecutionResult): ExecutionResult {
  return new SerializedPayload(payloadJson(result)) as ExecutionResult;
}

/** A message graphql-ws wrote with a SerializedPayload, its mark replaced by the payload's JSON. */
function withPayload(data: unknown): unknown {
  const json = markedPayload;
  markedPayload = null;
  if (json === null || typeof data !== 'string' || !data.endsWith(MARKED_END)) return data;
  return `${data.slice(0, data.length - MARKED_END.length)}"payload":${json}}`;
}

/** Bytes a socket may hold unflushed before a send waits for the kernel to take them. */
const WRITE_AHEAD = 256 * 1024;
/**
 * Time the sends of one turn of the event loop may take with their callbacks run at once; later
 * sends of the turn wait for their write, so busy streams go on in the next turn. Every socket
 * shares the slice: the feed's reads, the worker's round trips and the other sockets' writes get
 * the event loop every SLICE_MS or so, instead of after a whole burst of a busy stream.
 */
const SLICE_MS = 10;
/** When this turn's first send was made (-1: none yet). */
let sliceStarted = -1;

/**
 * The WebSocket class with coalesced writes (and a `next` payload's JSON put in, see
 * serializedOnce). graphql-ws sends a subscription's next event only once the previous send's
 * callback ran, which `ws` calls once the bytes reached the kernel: one write system call per
 * event per subscriber. Here a socket's first message of a turn of the event loop is written at
 * once (an executionCompleted subscriber has one message to wait for, which would otherwise wait
 * for the rest of a turn busy with streams: 1,000 of them beside 50 busy streams heard their
 * call's end p50 26–28 ms after it rather than 43–49); its second corks the TCP socket and the
 * turn's end uncorks it, so the turn's later messages leave in one write; and a send's callback runs at once while the socket holds less than WRITE_AHEAD bytes,
 * so a subscriber's burst of events fills one write. Past WRITE_AHEAD the callback is the real
 * one: a peer that stops reading stops its subscription from pulling events, and the hub's bound
 * on what a stream may hold (ASYNCPROC_MAX_SUBSCRIBER_QUEUE) ends it with SLOW_CONSUMER.
 */
export function coalescingWrites(Base: typeof WebSocket): typeof WebSocket {
  return class CoalescingSocket extends Base {
    /** This turn of the event loop: nothing sent yet, one message sent (at once), or later ones corked. */
    private turn: 'idle' | 'sent' | 'corked' = 'idle';

    override send(message: unknown, optionsOrCallback?: unknown, callback?: (error?: Error) => void): void {
      const data = withPayload(message);
      const cb = typeof optionsOrCallback === 'function' ? (optionsOrCallback as (error?: Error) => void) : callback;
      const options = (typeof optionsOrCallback === 'function' ? {} : (optionsOrCallback ?? {})) as object;
      const raw = (this as unknown as { _socket?: Socket })._socket;
      if (this.readyState !== this.OPEN || !raw) return super.send(data as Buffer, options, cb);
      if (sliceStarted < 0) {
        sliceStarted = performance.now();
        setImmediate(() => (sliceStarted = -1));
      }
      if (this.turn === 'idle') {
        // the turn's first message leaves at once (an executionCompleted subscriber has one to wait for)
        this.turn = 'sent';
        setImmediate(() => {
          if (this.turn === 'corked') raw.uncork();
          this.turn = 'idle';
        });
      } else if (this.turn === 'sent') {
        // the turn's later ones leave together, when the turn ends
        this.turn = 'corked';
        raw.cork();
      }
      if (!cb || raw.writableLength >= WRITE_AHEAD || performance.now() - sliceStarted > SLICE_MS) return super.send(data as Buffer, options, cb);
      // a failed write closes the socket, and graphql-ws learns of it from 'close'
      super.send(data as Buffer, options, () => undefined);
      queueMicrotask(() => cb());
    }
  };
}
