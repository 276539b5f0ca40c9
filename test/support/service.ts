/** The service's own processes (`serve`, `worker`) as child processes on a test database. */
import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { fileURLToPath } from 'node:url';

const ROOT = fileURLToPath(new URL('../..', import.meta.url));

export interface ServiceProcess {
  child: ChildProcess;
  /** The HTTP port (`serve` only). */
  port: number;
  /** Everything it wrote to stdout and stderr so far. */
  output(): string;
}

/**
 * `node src/cli.ts <command>` on `url`, anonymous access (ASYNCPROC_AUTH=none), logging at warn;
 * `serve` listens on `port`. `env` adds to or overrides that.
 */
export function startProcess(command: 'serve' | 'worker', url: string, port = 0, env: Record<string, string> = {}): ServiceProcess {
  const child = spawn(process.execPath, ['--import', 'tsx', 'src/cli.ts', command], {
    cwd: ROOT,
    env: { ...process.env, DATABASE_URL: url, PORT: String(port), LOG_LEVEL: 'warn', ASYNCPROC_AUTH: 'none', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  child.stdout!.on('data', (chunk) => (output += chunk));
  child.stderr!.on('data', (chunk) => (output += chunk));
  return { child, port, output: () => output };
}

/** Send `signal` and wait for the exit (nothing if it has exited already). */
export async function stopProcess(child: ChildProcess, signal: NodeJS.Signals): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = once(child, 'exit');
  child.kill(signal);
  await exited;
}

/** Whether `serve` on `port` answers /health now. */
export const healthy = (port: number): Promise<boolean> =>
  fetch(`http://127.0.0.1:${port}/health`, { signal: AbortSignal.timeout(1000) }).then(
    (response) => response.ok,
    () => false,
  );

/** POST a GraphQL operation to `serve` on `port`. */
export async function postGraphql(port: number, query: string, variables: Record<string, unknown> = {}): Promise<{ data?: any; errors?: unknown[] }> {
  const response = await fetch(`http://127.0.0.1:${port}/graphql`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ query, variables }),
  });
  return (await response.json()) as { data?: any; errors?: unknown[] };
}
