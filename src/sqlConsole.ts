import { spawn } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import pg from 'pg';
import { ENGINE_TYPES } from './engines/postgres/types.js';
import { ConfigError } from './config.js';
import { databaseFailure } from './startupFailure.js';

const INSTALL_PSQL =
  'psql is not installed: install it (Debian/Ubuntu: apt-get install postgresql-client; macOS: brew install libpq) ' +
  'or run a SQL file without it: npm run sql -- file.sql';

/** The URL without its password, and the password (percent-decoded, as libpq reads it). */
function withoutPassword(url: string): { url: string; password?: string } {
  try {
    const parsed = new URL(url);
    if (!parsed.password) return { url };
    const password = decodeURIComponent(parsed.password);
    parsed.password = '';
    return { url: parsed.toString(), password };
  } catch {
    return { url };
  }
}

/** psql on `url`, attached to this terminal; resolves with its exit code. */
export function openPsql(url: string, args: readonly string[]): Promise<number> {
  if (url.startsWith('mssql') || url.startsWith('sqlserver')) throw new ConfigError('DATABASE_URL is SQL Server: use sqlcmd or Azure Data Studio');
  return new Promise((resolve, reject) => {
    // the password through psql's environment (PGPASSWORD), not its command line, which `ps` shows every local user
    const { url: shown, password } = withoutPassword(url);
    const child = spawn('psql', [shown, ...args], { stdio: 'inherit', env: password === undefined ? process.env : { ...process.env, PGPASSWORD: password } });
    // Ctrl-C belongs to psql (it cancels the query); we only wait for it
    const ignore = () => undefined;
    process.on('SIGINT', ignore);
    child.once('error', (error: NodeJS.ErrnoException) => {
      process.off('SIGINT', ignore);
      reject(error.code === 'ENOENT' ? new ConfigError(INSTALL_PSQL) : error);
    });
    child.once('exit', (code, signal) => {
      process.off('SIGINT', ignore);
      resolve(code ?? (signal ? 1 : 0));
    });
  });
}

/** A result as psql prints it: aligned columns, then the row count; a command without rows by its tag. */
function format(result: pg.QueryResult): string {
  if (!result.fields?.length) return `${result.command ?? 'OK'}${result.rowCount != null && result.command !== 'SELECT' ? ` ${result.rowCount}` : ''}`;
  const names = result.fields.map((f) => f.name);
  const cell = (value: unknown) => (value === null || value === undefined ? '' : typeof value === 'object' && !(value instanceof Date) ? JSON.stringify(value) : value instanceof Date ? value.toISOString() : String(value));
  const rows = result.rows.map((row: unknown[]) => row.map(cell));
  const widths = names.map((name, i) => Math.max(name.length, ...rows.map((r) => r[i].length)));
  const line = (cells: string[]) => ` ${cells.map((c, i) => c.padEnd(widths[i])).join(' | ')}`.trimEnd();
  return [line(names), `-${widths.map((w) => '-'.repeat(w)).join('-+-')}-`, ...rows.map(line), `(${rows.length} row${rows.length === 1 ? '' : 's'})`].join('\n');
}

/** Run the statements of a SQL file (or standard input) in one round trip and print each result. */
export async function runSqlFile(url: string, file: string | undefined): Promise<void> {
  if (url.startsWith('mssql') || url.startsWith('sqlserver')) throw new ConfigError('DATABASE_URL is SQL Server: use sqlcmd or Azure Data Studio');
  const text = file && file !== '-' ? await readFile(file, 'utf8').catch((error: NodeJS.ErrnoException) => {
    throw new ConfigError(`cannot read ${file}: ${error.code === 'ENOENT' ? 'no such file' : error.message}`);
  }) : await readStdin();
  // values printed as the engine reads them (JSON numbers exact)
  const client = new pg.Client({ connectionString: url, application_name: 'asyncproc sql', types: ENGINE_TYPES });
  client.on('notice', (notice) => process.stderr.write(`${notice.severity ?? 'NOTICE'}:  ${notice.message}\n`));
  client.on('error', () => undefined);
  try {
    await client.connect();
  } catch (error) {
    throw databaseFailure(error, url, !process.env.DATABASE_URL);
  }
  try {
    const results = await client.query({ text, rowMode: 'array' } as pg.QueryConfig).catch((error: pg.DatabaseError) => {
      const line = error.position ? ` (line ${text.slice(0, Number(error.position)).split('\n').length})` : '';
      throw new ConfigError(`${error.severity ?? 'ERROR'}: ${error.message}${line}${error.code ? ` [SQLSTATE ${error.code}]` : ''}`);
    });
    for (const result of [results].flat() as pg.QueryResult[]) process.stdout.write(`${format(result)}\n`);
  } finally {
    await client.end();
  }
}

async function readStdin(): Promise<string> {
  if (process.stdin.isTTY) throw new ConfigError('give a SQL file: npm run sql -- file.sql (or pipe SQL in)');
  const chunks: Buffer[] = [];
  for await (const chunk of process.stdin) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks).toString('utf8');
}
