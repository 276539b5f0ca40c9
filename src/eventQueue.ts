/**
 * A subscription's queue of events: the producer pushes without waiting, the subscriber pulls.
 * Cheaper per event than a Repeater (no promise per push), and its length is what the hub's
 * bound on a slow subscriber counts (graphql-ws waits for each write to reach the kernel, so a
 * subscriber that stops reading stops pulling). `end` ends it after what is queued (with an error
 * if given); `return` (the subscriber left) drops what is queued.
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
    // a producer waiting for room (drained) goes on, sees the queue closed, and lets go
    this.wake();
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
