import { chmod, mkdtemp, rm } from 'node:fs/promises';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { startEmbeddedPostgres, type EmbeddedServer } from '../../src/embeddedPostgres.js';
import { createPostgresEngine, type PostgresEngine } from '../../src/engines/postgres/index.js';

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as { port: number };
      server.close(() => resolve(port));
    });
  });
}

export interface TestCluster {
  server: EmbeddedServer;
  /** A fresh, empty database on the cluster; returns its URL. */
  createDatabase(name?: string): Promise<string>;
  /** A client on the given URL (closed by the caller). */
  connect(url: string): Promise<pg.Client>;
  stop(): Promise<void>;
}

let counter = 0;

/** A real PostgreSQL cluster for one test file, in its own temporary folder, on a free port. */
export async function startTestCluster(): Promise<TestCluster> {
  const dir = await mkdtemp(path.join(tmpdir(), 'asyncproc-test-'));
  await chmod(dir, 0o755); // the server runs as `postgres` when tests run as root
  const server = await startEmbeddedPostgres({ dataDir: path.join(dir, 'data'), port: await freePort() });
  const connect = async (url: string) => {
    const client = new pg.Client({ connectionString: url });
    client.on('error', () => undefined);
    await client.connect();
    return client;
  };
  return {
    server,
    connect,
    async createDatabase(name = `t${process.pid}_${++counter}`) {
      const admin = await connect(server.url);
      try {
        await admin.query(`create database ${admin.escapeIdentifier(name)}`);
      } finally {
        await admin.end();
      }
      return server.url.replace(/\/postgres$/, `/${name}`);
    },
    async stop() {
      await server.stop();
      await rm(dir, { recursive: true, force: true });
    },
  };
}

export const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/** Poll until `check` returns a truthy value or the deadline passes. */
export async function waitFor<T>(check: () => Promise<T | null | undefined | false>, timeoutMs = 15_000, what = 'condition'): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await sleep(50);
  }
}

export interface DemoDatabase {
  cluster: TestCluster;
  url: string;
  /** Migrated, with the demo procedures installed. */
  engine: PostgresEngine;
  /** A plain client on the database, for setup and assertions. */
  sql: pg.Client;
}

/** A test cluster with one database made ready as the service would (migrations, demo). */
export async function startDemoDatabase(): Promise<DemoDatabase> {
  const cluster = await startTestCluster();
  const url = await cluster.createDatabase();
  const engine = createPostgresEngine({ connectionString: url });
  await engine.migrate();
  await engine.installDemo();
  return { cluster, url, engine, sql: await cluster.connect(url) };
}

/** The most executions that ran at the same moment, from their recorded start and finish times. */
export function peakConcurrency(rows: readonly { startedAt: Date | null; finishedAt: Date | null }[]): number {
  const edges = rows.flatMap((r) => [
    { at: r.startedAt!.getTime(), delta: 1 },
    { at: r.finishedAt!.getTime(), delta: -1 },
  ]);
  // a finish and a start at the same instant do not overlap
  edges.sort((a, b) => a.at - b.at || a.delta - b.delta);
  let running = 0;
  let peak = 0;
  for (const edge of edges) peak = Math.max(peak, (running += edge.delta));
  return peak;
}

/**
 * Teardown steps of a test file, each bounded: a step that does not end within `ms` is named on
 * stderr with what still keeps the process alive, and the next step runs. A test file whose
 * teardown hangs otherwise times out as a whole, after its tests passed, without saying why.
 */
export async function tearDown(steps: [string, () => Promise<unknown> | undefined][], ms = 20_000): Promise<void> {
  for (const [label, step] of steps) {
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<'late'>((resolve) => {
      timer = setTimeout(() => resolve('late'), ms);
    });
    const outcome = await Promise.race([Promise.resolve(step()).then(() => 'done' as const, (error: unknown) => error), late]);
    clearTimeout(timer);
    if (outcome === 'late') {
      process.stderr.write(`teardown: "${label}" did not end within ${ms} ms; alive: ${process.getActiveResourcesInfo().join(', ')}\n`);
    } else if (outcome !== 'done') {
      process.stderr.write(`teardown: "${label}" failed: ${String(outcome)}\n`);
    }
  }
  // something left open (a timer, a socket) keeps the file's process alive after its tests until
  // the file times out, naming nothing: say what it is
  const lingering = setTimeout(() => {
    process.stderr.write(`teardown: done 10 s ago, and the process is still alive; alive: ${process.getActiveResourcesInfo().join(', ')}\n`);
  }, 10_000);
  lingering.unref();
}
