/**
 * The live feed: one `executionEvents` stream for the whole dashboard, started from `changeCursor` and
 * resumed from the cursor of the last event it delivered (after a dropped socket as after a refused
 * stream), and hooks that read a query again when an event concerns it. Nothing here polls.
 */
import { useCallback, useEffect, useRef, useState } from 'preact/hooks';
import { ApiError, gql, subscribe } from './api';
import { Store } from './store';

export type Status = 'WAITING' | 'PENDING' | 'RUNNING' | 'SUCCEEDED' | 'FAILED' | 'CANCELLED';
export const ENDED: readonly Status[] = ['SUCCEEDED', 'FAILED', 'CANCELLED'];

export interface ChangeEvent {
  cursor: string;
  status: Status;
  execution: { token: string; procedure: string; queue: string; submittedBy: string | null; finishedAt: string | null; batch: { id: string; batchId: string } | null };
}

const EVENTS = `subscription Events($after: String) {
  executionEvents(after: $after) {
    cursor status
    execution { token procedure queue submittedBy finishedAt batch { id batchId } }
  }
}`;

const listeners = new Set<(event: ChangeEvent) => void>();
/** The last event's cursor: where a resumed stream starts. */
export const feedCursor = new Store<string | null>(null);
export const feedError = new Store<string | null>(null);
let stopFeed: (() => void) | null = null;
let retry: ReturnType<typeof setTimeout> | undefined;

/** Start (or restart) the feed: from the last cursor seen, else from now. */
export async function startFeed() {
  stopFeed?.();
  clearTimeout(retry);
  const after = feedCursor.get() ?? (await gql<{ changeCursor: string }>('{ changeCursor }')).changeCursor;
  // one payload object: graphql-ws sends it again on reconnect, so it carries the newest cursor
  const payload = { query: EVENTS, variables: { after } };
  stopFeed = subscribe<{ executionEvents: ChangeEvent }>(payload, {
    next: ({ executionEvents: event }) => {
      payload.variables.after = event.cursor;
      feedCursor.set(event.cursor);
      feedError.set(null);
      for (const listener of [...listeners]) listener(event);
    },
    error: (error) => {
      feedError.set(error.message);
      if (error.code === 'UNAUTHENTICATED') return;
      // the database cannot resume from this cursor (it failed over and lost commits, or the
      // retention purged calls since): start from now
      if (error.code === 'CURSOR_AHEAD' || error.code === 'CURSOR_EXPIRED') feedCursor.set(null);
      // the stream ended (SLOW_CONSUMER, a restart of the service): take it up again where it stopped
      retry = setTimeout(() => void startFeed().catch((e: Error) => feedError.set(e.message)), 2000);
    },
  });
}

export function stopLiveFeed() {
  stopFeed?.();
  stopFeed = null;
  clearTimeout(retry);
  feedCursor.set(null);
}

/** Call `listener` for every change until the returned function is called. */
export function listen(listener: (event: ChangeEvent) => void): () => void {
  listeners.add(listener);
  return () => void listeners.delete(listener);
}

/** Call `listener` for every change while the view is shown. */
export function useEvents(listener: (event: ChangeEvent) => void) {
  const latest = useRef(listener);
  latest.current = listener;
  useEffect(() => listen((event) => latest.current(event)), []);
}

export interface Loaded<T> {
  data: T | null;
  error: ApiError | null;
  loading: boolean;
  /** Read again now. */
  reload(): void;
}

/**
 * A query read on mount, when its variables change, and again (at most every `debounceMs`) when an
 * event `concerns` it: counts follow the work without a request per event. `refreshMs`: read again
 * that often as well, for what changes without an event (a queue's settings, changed by another admin).
 */
export function useLiveQuery<T>(
  query: string,
  variables: Record<string, unknown> | undefined,
  concerns: ((event: ChangeEvent) => boolean) | null,
  debounceMs = 300,
  refreshMs?: number,
): Loaded<T> {
  const [state, setState] = useState<{ data: T | null; error: ApiError | null; loading: boolean }>({ data: null, error: null, loading: true });
  const key = JSON.stringify(variables ?? {});
  const generation = useRef(0);
  const timer = useRef<ReturnType<typeof setTimeout> | undefined>(undefined);
  const load = useCallback(() => {
    const mine = ++generation.current;
    gql<T>(query, variables).then(
      (data) => mine === generation.current && setState({ data, error: null, loading: false }),
      (error: ApiError) => mine === generation.current && setState((old) => ({ data: old.data, error, loading: false })),
    );
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [query, key]);
  useEffect(() => {
    setState((old) => ({ ...old, loading: true }));
    load();
    const refresh = refreshMs ? setInterval(load, refreshMs) : undefined;
    return () => (clearTimeout(timer.current), clearInterval(refresh));
  }, [load, refreshMs]);
  useEvents((event) => {
    if (!concerns || !concerns(event) || timer.current !== undefined) return;
    timer.current = setTimeout(() => {
      timer.current = undefined;
      load();
    }, debounceMs);
  });
  return { ...state, reload: load };
}

export interface Progress {
  percent: number;
  message: string | null;
  /** When the report was stored (the database's clock). */
  at: string;
}

const PROGRESS = 'subscription Progress($token: ID!) { executionProgress(token: $token) { progress { percent message at } } }';

/** A call's latest progress: `initial` (read with the call), then, while `follow`, each report of its executionProgress stream. */
export function useProgress(token: string, initial: Progress | null, follow: boolean): Progress | null {
  const [progress, setProgress] = useState(initial);
  // a newer read of the call wins over an older report, never the other way round
  useEffect(() => setProgress((shown) => (initial && (!shown || initial.at >= shown.at) ? initial : shown)), [initial?.at]);
  useEffect(() => {
    if (!follow) return;
    return subscribe<{ executionProgress: { progress: Progress | null } }>(
      { query: PROGRESS, variables: { token } },
      { next: ({ executionProgress }) => executionProgress.progress && setProgress(executionProgress.progress) },
    );
  }, [token, follow]);
  return progress;
}

/** What the signed-in caller may do, as the API's `viewer` says (the server checks every action anyway). */
export interface Capabilities {
  /** Admin (or anonymous development mode): queues, schedules, the registry. */
  admin: boolean;
  /** Admin or operator: sees and cancels everyone's work, reads schedules. */
  operator: boolean;
  /** Who the caller is (`submittedBy` of what it submits). */
  subject: string | null;
}

export const capabilities = new Store<Capabilities | null>(null);

export async function probeCapabilities(): Promise<Capabilities> {
  const { viewer } = await gql<{ viewer: { subject: string | null; isAdmin: boolean; seesEverything: boolean } }>('{ viewer { subject isAdmin seesEverything } }');
  const found = { admin: viewer.isAdmin, operator: viewer.seesEverything, subject: viewer.subject };
  capabilities.set(found);
  return found;
}
