import pg from 'pg';
import { ENGINE_TYPES } from './types.js';

/**
 * Settings every connection the engine owns starts with (pool, workers, listener,
 * notifier), sent in the startup packet so they hold before the first statement and
 * cost no round trip.
 *
 * - READ COMMITTED: the batch settle and the claim rely on it. Under a database default
 *   of REPEATABLE READ a stage-2 member stayed WAITING for ever (the settle's snapshot
 *   predates the last member's commit); under SERIALIZABLE, 40001 errors failed calls
 *   that had succeeded.
 * - TCP keepalives, both ways: a half-open connection (a network cut) is noticed in
 *   about idle + interval × count = 25 s, not the kernel's two hours, so the server ends
 *   a lost worker's session and releases its locks, and recover starts its call again.
 * - Output formats of the values a call's outcome is made of (to_jsonb in the worker's
 *   session): a database default of extra_float_digits = -15 turned 2469.1356 into 2000,
 *   bytea_output = escape and IntervalStyle = sql_standard changed the text of bytea and
 *   interval results. Pinned to PostgreSQL's defaults, so an outcome does not depend on them.
 */
export const SESSION_SETTINGS: Readonly<Record<string, string>> = {
  default_transaction_isolation: 'read committed',
  tcp_keepalives_idle: '10',
  tcp_keepalives_interval: '5',
  tcp_keepalives_count: '3',
  extra_float_digits: '1',
  bytea_output: 'hex',
  IntervalStyle: 'postgres',
};

/**
 * Session limits a DBA may set as defaults that would cut the engine's own connections, turned
 * off on each of them right after it connects (both are settable by any user), where the server
 * knows them: an unknown name in the startup packet would refuse the connection on an older
 * server. idle_session_timeout (PostgreSQL 14+) ended the listener's and the pool's idle
 * sessions every few seconds (a reconnect, two warnings, a query on a killed connection);
 * transaction_timeout (17+) ended a worker's session in any call longer than it (FATAL 25P04),
 * and the call was recovered and run again, five times, then failed as lost.
 */
const LIFT_SESSION_LIMITS = `select set_config(s.name, '0', false) from pg_settings s where s.name in ('idle_session_timeout', 'transaction_timeout')`;

export async function liftSessionLimits(client: Pick<pg.Client, 'query'>): Promise<void> {
  await client.query(LIFT_SESSION_LIMITS);
}

/**
 * For the connections whose timestamps the service reads as text (the engine's pool): dates and
 * times written in ISO 8601, the only style the driver parses. A database default of
 * DateStyle = 'SQL, DMY' made every read of a time fail (and the activator's housekeeping with
 * it). The order of a date's fields (DMY, MDY, YMD) stays the database's: it decides how a date
 * written like 01/02/2024 is read, in a call's arguments at submit among others. It cannot be set in
 * the startup packet: 'ISO' alone there takes the server's order, not the database's. Worker
 * sessions keep the database's style whole: what a procedure writes as text is its own.
 */
const ISO_DATES = `select set_config('DateStyle', 'ISO, ' || split_part(current_setting('DateStyle'), ', ', 2), false)`;

export async function isoDates(client: Pick<pg.Client, 'query'>): Promise<void> {
  await client.query(ISO_DATES);
}

/**
 * Ends a client whose connection may still be on its way (a stop while it reconnects). pg's end()
 * on a connection the server has not answered yet sends its goodbye and waits for the server,
 * up to the connect timeout; the socket is destroyed instead, as pg's own connect timeout does,
 * and the client's connect() fails at once.
 */
export function cutShort(client: pg.Client): void {
  client.connection.stream.destroy();
}

/**
 * A client class for a pool whose connections on their way can be cut short (cutShort): each is
 * in `opening` while it connects. pg-pool gives no handle on a connect it has begun, and a stop
 * waited for one to a database that does not answer for the whole connect timeout.
 */
export function trackedClient(opening: Set<pg.Client>): typeof pg.Client {
  return class TrackedClient extends pg.Client {
    // pg-pool connects with a callback; the promise form is kept for anyone else
    override connect(): Promise<pg.Client>;
    override connect(callback: (err: Error) => void): void;
    override connect(callback?: (err: Error) => void): Promise<pg.Client> | void {
      opening.add(this);
      if (callback) {
        super.connect((err: Error) => {
          opening.delete(this);
          callback(err);
        });
        return;
      }
      return super.connect().finally(() => opening.delete(this));
    }
  };
}

/** Client side of the keepalive: the first probe after this long idle. */
const KEEPALIVE_INITIAL_DELAY_MS = 10_000;

type ConnectionConfig = Pick<pg.ClientConfig, 'connectionString' | 'options' | 'keepAlive' | 'keepAliveInitialDelayMillis' | 'types' | 'connectionTimeoutMillis'>;

/**
 * How long a connection may take to open (a pool's: also to be handed out). Without it, a
 * server that accepts the TCP connection and never answers (a hung host, a proxy in front of
 * nothing, a port of something else) held the service's start, and every statement after it,
 * for ever.
 */
const CONNECT_TIMEOUT_MS = 30_000;

/**
 * Connection options for a client or pool of the engine: SESSION_SETTINGS plus `extra`
 * (a worker adds statement_timeout = 0), after any `options` the URL carries. pg lets a
 * URL's `options` replace the config's, so they are taken out of the URL and merged.
 */
export function connectionConfig(connectionString: string, extra: Readonly<Record<string, string>> = {}): ConnectionConfig {
  const { url, options } = takeOptions(connectionString);
  const settings = Object.entries({ ...SESSION_SETTINGS, ...extra }).map(([name, value]) => `-c ${name}=${escapeOption(value)}`);
  return {
    connectionString: url,
    options: [options, ...settings].filter(Boolean).join(' '),
    keepAlive: true,
    keepAliveInitialDelayMillis: KEEPALIVE_INITIAL_DELAY_MS,
    types: ENGINE_TYPES,
    connectionTimeoutMillis: connectTimeout(connectionString),
  };
}

/** The URL's `connect_timeout` (seconds, as libpq reads it; 0: none), or CONNECT_TIMEOUT_MS. */
export function connectTimeout(connectionString: string): number {
  let seconds: string | null = null;
  try {
    seconds = new URL(connectionString).searchParams.get('connect_timeout');
  } catch {
    // not a URL (a key=value string): the default
  }
  const value = Number(seconds);
  return seconds !== null && seconds.trim() !== '' && Number.isFinite(value) && value >= 0 ? Math.round(value * 1000) : CONNECT_TIMEOUT_MS;
}

/** Spaces and backslashes in an `options` value are escaped with a backslash (libpq's rule). */
const escapeOption = (value: string) => value.replace(/[\\ ]/g, '\\$&');

function takeOptions(connectionString: string): { url: string; options: string | null } {
  let url: URL;
  try {
    url = new URL(connectionString);
  } catch {
    return { url: connectionString, options: null };
  }
  const options = url.searchParams.get('options');
  if (options === null) return { url: connectionString, options: null };
  url.searchParams.delete('options');
  return { url: url.toString(), options };
}
