import type sql from 'mssql';

/**
 * DATABASE_URL for SQL Server:
 *   mssql://user:password@host[:port]/database?encrypt=true&trustServerCertificate=false
 *   sqlserver://… (same)
 * Query options: encrypt, trustServerCertificate, instanceName, appName,
 * connectionTimeout, requestTimeout (ms), poolMax, poolMin, and allowKill (asyncproc's own:
 * cancelExecution may KILL the session running a call; see docs/mssql.md). User and password
 * are percent-decoded, so a password may hold any character.
 */
export interface MssqlUrl {
  config: sql.config;
  database: string;
  /** allowKill=true: cancelling a RUNNING call KILLs the session that runs it. @default false */
  allowKill: boolean;
}

const BOOLEAN = new Map([
  ['true', true],
  ['1', true],
  ['yes', true],
  ['false', false],
  ['0', false],
  ['no', false],
]);

function bool(name: string, value: string): boolean {
  const parsed = BOOLEAN.get(value.toLowerCase());
  if (parsed === undefined) throw new Error(`DATABASE_URL: ${name} must be true or false, not "${value}"`);
  return parsed;
}

function int(name: string, value: string, min: number): number {
  if (!/^\d+$/.test(value) || Number(value) < min) throw new Error(`DATABASE_URL: ${name} must be an integer ≥ ${min}, not "${value}"`);
  return Number(value);
}

export function parseMssqlUrl(text: string): MssqlUrl {
  let url: URL;
  try {
    url = new URL(text);
  } catch (error) {
    throw new Error('DATABASE_URL: not a valid URL (mssql://user:password@host:1433/database)', { cause: error });
  }
  const scheme = url.protocol.replace(/:$/, '').toLowerCase();
  if (scheme !== 'mssql' && scheme !== 'sqlserver') throw new Error(`DATABASE_URL: expected mssql:// or sqlserver://, not ${scheme}://`);
  if (!url.hostname) throw new Error('DATABASE_URL: the host is missing');

  const database = decodeURIComponent(url.pathname.replace(/^\//, ''));
  if (!database || database.includes('/')) throw new Error('DATABASE_URL: name exactly one database in the path (mssql://…/asyncproc)');

  const options: NonNullable<sql.config['options']> = {
    encrypt: true,
    trustServerCertificate: false,
    appName: 'asyncproc',
    // tedious leaves CURSOR_CLOSE_ON_COMMIT to the database's option unless told: with it ON a
    // commit closes the cursors open on the connection, and the listener ends dialogs one by one
    // (each END its own commit) inside a cursor loop, whose next FETCH would then fail (16917)
    enableCursorCloseOnCommit: false,
  };
  const config: sql.config = {
    server: url.hostname.replace(/^\[(.*)\]$/, '$1'), // IPv6 literals come bracketed
    database,
    options,
  };
  if (url.port) config.port = int('port', url.port, 1);
  if (url.username) config.user = decodeURIComponent(url.username);
  if (url.password) config.password = decodeURIComponent(url.password);

  const pool: NonNullable<sql.config['pool']> = {};
  let allowKill = false;
  for (const [key, value] of url.searchParams) {
    switch (key) {
      case 'encrypt':
        options.encrypt = bool(key, value);
        break;
      case 'trustServerCertificate':
        options.trustServerCertificate = bool(key, value);
        break;
      case 'instanceName':
        options.instanceName = value;
        break;
      case 'appName':
        options.appName = value;
        break;
      case 'connectionTimeout':
        config.connectionTimeout = int(key, value, 1);
        break;
      case 'requestTimeout':
        config.requestTimeout = int(key, value, 0);
        break;
      case 'poolMax':
        pool.max = int(key, value, 1);
        break;
      case 'poolMin':
        pool.min = int(key, value, 0);
        break;
      case 'allowKill':
        allowKill = bool(key, value);
        break;
      default:
        throw new Error(`DATABASE_URL: unknown option "${key}"`);
    }
  }
  // a named instance is found through the SQL Browser, not by port
  if (options.instanceName && config.port !== undefined) throw new Error('DATABASE_URL: give either a port or instanceName, not both');
  if (Object.keys(pool).length) config.pool = pool;
  return { config, database, allowKill };
}
