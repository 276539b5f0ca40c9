import pg from 'pg';
import { ConfigError } from '../../config.js';
import type { Logger } from '../../logger.js';
import { connectTimeout } from './connection.js';

/** The database behind DATABASE_URL cannot carry the service; the message names the fix (a ConfigError: no stack on the console). */
export class UnsuitableDatabaseError extends ConfigError {
  override name = 'UnsuitableDatabaseError';
}

const FIX = 'asyncproc needs a direct connection to the primary server, or one through a pooler in session mode (PgBouncer pool_mode = session)';

/**
 * Start-up checks for what PostgreSQL itself would only report later and obscurely:
 * a standby refuses every write, and a transaction-pooling proxy silently drops the
 * session-level advisory locks and LISTEN the workers and listener rely on.
 */
export async function checkDeployment(connectionString: string, logger: Logger): Promise<void> {
  const probe = await connect(connectionString);
  const other = await connect(connectionString).catch(async (error: unknown) => {
    await probe.end().catch(() => undefined);
    throw error;
  });
  try {
    const { rows } = await probe.query<{ standby: boolean; readOnly: string }>(
      `select pg_is_in_recovery() as standby, current_setting('default_transaction_read_only') as "readOnly"`,
    );
    if (rows[0].standby) {
      throw new UnsuitableDatabaseError(
        `DATABASE_URL points at a standby (pg_is_in_recovery() is true): asyncproc writes on every call and claim. ` +
          `Point DATABASE_URL at the primary; ${FIX}.`,
      );
    }
    if (rows[0].readOnly === 'on') {
      // left as the DBA set it (a database closed to writes for maintenance, say), but named
      throw new UnsuitableDatabaseError(
        `default_transaction_read_only is on for this database or login: asyncproc writes on every call and claim. ` +
          `Turn it off for the service (ALTER DATABASE … SET default_transaction_read_only = off, or ALTER ROLE … SET for its login).`,
      );
    }
    await checkOwnSession(probe, other, logger);
  } finally {
    await Promise.all([probe.end().catch(() => undefined), other.end().catch(() => undefined)]);
  }
}

async function connect(connectionString: string): Promise<pg.Client> {
  const client = new pg.Client({ connectionString, application_name: 'asyncproc-check', connectionTimeoutMillis: connectTimeout(connectionString) });
  client.on('error', () => undefined); // a failed probe surfaces through its query
  await client.connect();
  return client;
}

const backendPid = async (client: pg.Client) => (await client.query<{ pid: number }>('select pg_backend_pid() as pid')).rows[0].pid;

/**
 * A connection must keep its server session between statements. While `other` holds a
 * transaction, a transaction pooler has to serve `probe`'s next statement from another
 * server connection (or, LIFO as PgBouncer is by default, hand `other` the one `probe` just
 * used): either way the backend pid seen by one connection changes, which never happens
 * on a direct connection.
 */
async function checkOwnSession(probe: pg.Client, other: pg.Client, logger: Logger): Promise<void> {
  const first = await backendPid(probe);
  // the pid a server announces at connect differs from pg_backend_pid() behind any proxy:
  // then look harder, since a round-robin pooler may hand back the same session by chance
  const proxied = (probe as pg.Client & { processID?: number }).processID !== first;
  for (let round = 0; round < (proxied ? 5 : 1); round++) {
    await other.query('begin');
    let held: number;
    let next: number;
    try {
      held = await backendPid(other);
      next = held === first ? first : await backendPidOrWait(probe, other);
    } finally {
      await other.query('rollback').catch(() => undefined);
    }
    if (held === first || next !== first) {
      throw new UnsuitableDatabaseError(
        `DATABASE_URL goes through a transaction-pooling proxy (PgBouncer pool_mode = transaction or alike): ` +
          (held === first
            ? `server session ${first} (backend pid) served one connection and then another. `
            : `one connection's statements ran in server session ${first} and then ${next} (backend pids). `) +
          `Session advisory locks and LISTEN do not survive that. Fix: ${FIX}.`,
      );
    }
  }
  if (proxied) logger.info('PostgreSQL is reached through a proxy that keeps each session (session pooling): fine');
}

/** A pooler with every server connection taken makes `probe` wait for `other`'s: let `other` go after a while. */
async function backendPidOrWait(probe: pg.Client, other: pg.Client): Promise<number> {
  const answer = backendPid(probe);
  let timer: NodeJS.Timeout | undefined;
  const waited = new Promise<'waiting'>((resolve) => (timer = setTimeout(() => resolve('waiting'), 2000)));
  try {
    const first = await Promise.race([answer, waited]);
    if (first !== 'waiting') return first;
    await other.query('rollback');
    return await answer;
  } finally {
    clearTimeout(timer);
  }
}
