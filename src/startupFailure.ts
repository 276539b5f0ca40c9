import { ConfigError, maskPassword, type Config } from './config.js';
import { EmbeddedPostgresError } from './embeddedPostgres.js';

/**
 * A start-up failure a person fixes by changing one setting: printed as one line (the
 * cause, the variable, the fix), without a stack.
 */
export class StartupError extends ConfigError {
  override name = 'StartupError';
}


const codeOf = (error: unknown): string | undefined => {
  for (let e = error as { code?: unknown; cause?: unknown } | undefined, depth = 0; e && depth < 5; e = e.cause as typeof e, depth++) {
    if (typeof e.code === 'string') return e.code;
    // AggregateError (connection attempts to several addresses)
    const inner = (e as { errors?: unknown[] }).errors?.[0] as typeof e | undefined;
    if (inner && typeof inner.code === 'string') return inner.code;
  }
  return undefined;
};

/** The HTTP port could not be opened. */
export function listenFailure(error: unknown, port: number, host: string): Error {
  switch (codeOf(error)) {
    case 'EADDRINUSE':
      return new StartupError(`port ${port} is in use (PORT=${port}): stop the other process or set PORT=…`, { cause: error });
    case 'EACCES':
      return new StartupError(`port ${port} needs privileges this user lacks (PORT=${port}): set PORT to 1024 or above`, { cause: error });
    case 'EADDRNOTAVAIL':
    case 'ENOTFOUND':
      return new StartupError(`HOST=${host} is not an address of this machine: set HOST=0.0.0.0 (every interface) or 127.0.0.1`, { cause: error });
    default:
      return error as Error;
  }
}

/**
 * The database did not answer, or refused us: one line naming DATABASE_URL (password
 * masked), or for `embedded` (the embedded PostgreSQL of a running `npm start`, reached by
 * `worker`, `api-key`, `sql`) ASYNCPROC_EMBEDDED_PORT. Anything else passes through.
 */
export function databaseFailure(error: unknown, url: string, embedded = false): Error {
  if (error instanceof ConfigError) return error;
  let target = url;
  try {
    const parsed = new URL(url);
    target = `${parsed.hostname}:${parsed.port || (parsed.protocol.startsWith('postgres') ? 5432 : 1433)}`;
  } catch {
    // the URL was already checked by the configuration; keep it whole
  }
  const variable = embedded ? 'ASYNCPROC_EMBEDDED_PORT' : 'DATABASE_URL';
  const where = embedded ? `ASYNCPROC_EMBEDDED_PORT=${target.split(':').pop()}` : `DATABASE_URL=${maskPassword(url)}`;
  const message = error instanceof Error ? error.message.split('\n')[0] : String(error);
  const code = codeOf(error);
  if (embedded && code === 'ECONNREFUSED') {
    return new StartupError(`no database: set DATABASE_URL, or start the service (npm start) so its embedded PostgreSQL answers on ${target} (${where})`, { cause: error });
  }
  switch (code) {
    case 'ECONNREFUSED':
      return new StartupError(`no database answers at ${target} (${where}): start it, or fix the host and port in ${variable}`, { cause: error });
    case 'ENOTFOUND':
    case 'EAI_AGAIN':
      return new StartupError(`the database host in ${target} cannot be resolved (${where}): fix the host name in ${variable}`, { cause: error });
    case 'ETIMEDOUT':
    case 'EHOSTUNREACH':
    case 'ENETUNREACH':
      return new StartupError(`the database at ${target} cannot be reached (${where}): check the host, the port and the network`, { cause: error });
    case '28P01':
    case '28000':
    case 'ELOGIN':
      return new StartupError(`the database refused the login: ${message} (${where}): fix the user and password in ${variable}`, { cause: error });
    case '3D000':
      return new StartupError(`${message} (${where}): create it, or fix the database name in ${variable}`, { cause: error });
    case 'ESOCKET':
      return new StartupError(`the database connection failed: ${message} (${where})`, { cause: error });
  }
  // pg's own errors, without a code
  if (/timeout exceeded when trying to connect|connection timeout|^timeout expired$/i.test(message)) {
    return new StartupError(`the database at ${target} did not answer (${where}): check that a PostgreSQL server listens there, and the network`, { cause: error });
  }
  if (/Connection terminated unexpectedly/i.test(message)) {
    return new StartupError(`the server at ${target} closed the connection (${where}): is it a PostgreSQL server? fix the host and port in ${variable}`, { cause: error });
  }
  return error as Error;
}

/** The embedded PostgreSQL did not start: name ASYNCPROC_EMBEDDED_PORT or ASYNCPROC_DATA_DIR. */
export function embeddedFailure(error: unknown, config: Pick<Config, 'ASYNCPROC_EMBEDDED_PORT' | 'ASYNCPROC_DATA_DIR'>): Error {
  if (!(error instanceof EmbeddedPostgresError)) return error as Error;
  const port = config.ASYNCPROC_EMBEDDED_PORT;
  if (error.setting === 'port') {
    return new StartupError(
      `embedded PostgreSQL: ${error.message} (ASYNCPROC_EMBEDDED_PORT=${port}): stop the other process (another npm start?) or set ASYNCPROC_EMBEDDED_PORT=…`,
      { cause: error },
    );
  }
  const dir = config.ASYNCPROC_DATA_DIR ?? '.data (the default)';
  return new StartupError(`embedded PostgreSQL: ${error.message} (ASYNCPROC_DATA_DIR=${dir}): fix that folder or set ASYNCPROC_DATA_DIR=…`, { cause: error });
}
