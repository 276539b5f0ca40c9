import { createServer as createHttpServer, type IncomingMessage, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { GraphQLError, type ExecutionArgs, type ExecutionResult } from 'graphql';
import { createGraphQLError, createYoga, maskError } from 'graphql-yoga';
import type { Context as WsContext, SubscribePayload } from 'graphql-ws';
import { useServer } from 'graphql-ws/use/ws';
import { WebSocketServer, type WebSocket } from 'ws';
import { AuthenticationError, authorizationParam, RECHECK_MS, USER_HEADER, type Authenticator } from './auth/authenticate.js';
import type { Principal } from './auth/principal.js';
import { useMutationRateLimit, type RateLimiter } from './auth/rateLimit.js';
import type { CompletionHub } from './completionHub.js';
import { useBodyLimit } from './edge/bodyLimit.js';
import { corsOptions, HOST_REFUSED, hostAllowed, useCrossSiteRequestPrevention, webSocketOriginAllowed } from './edge/crossSite.js';
import { useInputHygiene } from './edge/inputHygiene.js';
import { useOneSubmissionPerOperation } from './edge/oneSubmission.js';
import { useGetParameterCheck, useHttpOperations, useShortParserErrors } from './edge/httpOperations.js';
import { DEFAULT_OPERATION_LIMITS, useOperationLimits, type OperationLimits } from './edge/operationLimits.js';
import { hideSuggestions, useSchemaPrivacy } from './edge/schemaPrivacy.js';
import { refuseBeyondSubscriptionLimit } from './edge/subscriptionLimit.js';
import { socketClass } from './edge/webSocketLimits.js';
import { useDashboard } from './dashboard.js';
import { EngineError, type Engine } from './engine.js';
import { coalescingWrites, eventsOf, holdEvents, serializedOnce, useSharedEventExecution } from './fanout.js';
import { renderGraphiQL, useGraphiQLAssets } from './graphiql.js';
import type { Logger } from './logger.js';
import { ServiceMetrics } from './metrics.js';
import { Readiness, useReadiness, type ReadinessOptions } from './readiness.js';
import { schema, type Context, type Limits } from './schema/index.js';
import { createLoaders } from './schema/loaders.js';

export interface ServerOptions {
  engine: Engine;
  hub: CompletionHub;
  logger: Logger;
  limits: Limits;
  /** Largest request body (HTTP) or message (WebSocket), in bytes. @default 1 MiB */
  maxBodyBytes?: number;
  /** Callers must authenticate; turns the defaults below to closed. @default false */
  authRequired?: boolean;
  /** @default !authRequired */
  graphiql?: boolean;
  /** Verifies credentials (or, with auth off, takes the caller at its word). */
  auth: Authenticator;
  /** Per-caller limit on mutations; none when absent. */
  rateLimit?: RateLimiter | null;
  /** Open graphql-ws connections one caller may hold. @default 20 */
  maxConnectionsPerCaller?: number;
  /** Schema introspection. @default !authRequired */
  introspection?: boolean;
  /** "Did you mean …?" in error messages. @default !authRequired */
  suggestions?: boolean;
  /** Origins allowed cross-origin (`*`: any). @default closed when authRequired, yoga's default otherwise */
  corsOrigins?: string[];
  /** With authentication off, the host names served besides IP addresses and localhost (`*`: any; hostAllowed). */
  allowedHosts?: string[];
  /** Depth, alias, token, directive and cost limits of every operation. */
  operationLimits?: Partial<OperationLimits>;
  /** Subscriptions one graphql-ws connection may hold. @default 100 */
  maxSubscriptionsPerConnection?: number;
  /** List items an operation may ask for, its variables' values counted (estimateNodes). @default 10000 */
  maxNodes?: number;
  /** Open SSE subscriptions one caller may hold (authentication required). @default 100 */
  maxSseStreamsPerCaller?: number;
  /** The dashboard at /dashboard/ (`/` redirects there). @default true */
  dashboard?: boolean;
  /** Prometheus metrics at /metrics. @default true */
  metrics?: boolean;
  /** Thresholds of /ready. */
  readiness?: Pick<ReadinessOptions, 'timeoutMs' | 'listenerStaleMs' | 'cacheMs'>;
}

export interface RunningServer {
  server: Server;
  url: string;
  port: number;
  close(): Promise<void>;
}

/** What yoga's context factory starts from: the HTTP request, or a graphql-ws socket's verified principal. */
interface ServerContext {
  req?: IncomingMessage;
  principal?: Principal;
  /** graphql-ws: whether the subscription is still wanted (its client neither completed it nor left). */
  wanted?: () => boolean;
}

function unauthenticated(error: AuthenticationError) {
  return createGraphQLError(error.message, {
    extensions: { code: 'UNAUTHENTICATED', http: { status: 401, headers: { 'WWW-Authenticate': 'Bearer, ApiKey' } } },
  });
}

function headerOf(req: IncomingMessage | undefined, name: string): string | null {
  const value = req?.headers[name];
  return typeof value === 'string' ? value : null;
}

/** `metrics`: the service's metrics, served and fed by the app (none: /metrics is not served). */
export function createYogaApp(options: ServerOptions, metrics?: ServiceMetrics) {
  const { engine, hub, limits, logger, auth } = options;
  const open = !options.authRequired;
  const suggestions = options.suggestions ?? open;
  const graphiql = options.graphiql ?? open;
  /**
   * Errors masking logged itself (at the level they deserve): yoga logs every error it masked
   * once more, at error level, so a database restarting read as a bug in the log too.
   */
  const logged = new WeakSet<object>();
  /** An error as a client may see it: an engine's refusal by its code, anything unexpected as "Unexpected error." (logged). */
  const masking = (error: unknown, message: string): Error => {
    if (!suggestions) hideSuggestions(error);
    const original = error instanceof GraphQLError ? error.originalError : error;
    const path = error instanceof GraphQLError ? error.path : undefined;
    if (original instanceof EngineError) return createGraphQLError(original.message, { extensions: { code: original.code }, path });
    if (!(original instanceof GraphQLError) && original !== undefined) {
      if (typeof error === 'object' && error !== null) logged.add(error);
      // the database out of reach or restarting, a connection cut: no bug, and the client may try
      // again (it was "Unexpected error.", which a client cannot tell from one)
      if (engine.isTransient(original)) {
        logger.warn({ err: original }, 'database unavailable for a request');
        return createGraphQLError(
          'the database could not answer just now (unreachable, restarting, or the connection was cut): try again shortly; ' +
            'a mutation answered so may or may not have been committed, so look for what it made before sending it again',
          { extensions: { code: 'SERVICE_UNAVAILABLE', http: { status: 503 } }, path },
        );
      }
      logger.error({ err: original }, 'unexpected error (masked)');
    }
    return maskError(error, message, false);
  };
  return createYoga<ServerContext, Context>({
    schema,
    graphqlEndpoint: '/graphql',
    landingPage: false,
    // useBodyLimit below is the limit (and the cheaper one)
    maxRequestBodySize: false,
    // headers typed in (a JWT, an API key) stay in the tab's memory, never in localStorage (yoga's
    // page persists them unless told not to); with authentication on, subscriptions go over SSE,
    // which carries those headers on its HTTP request (graphql-ws would send them only in each
    // subscribe message, after a connection_init without credentials, which is refused 4401)
    graphiql: graphiql ? { title: 'asyncproc', subscriptionsProtocol: open ? 'WS' : 'SSE', shouldPersistHeaders: false } : false,
    renderGraphiQL,
    cors: corsOptions(options.corsOrigins),
    logging: {
      debug: (...args) => logger.debug(args.join(' ')),
      info: (...args) => logger.info(args.join(' ')),
      warn: (...args) => logger.warn(args.join(' ')),
      error: (...args) => {
        if (!args.some((arg) => typeof arg === 'object' && arg !== null && logged.has(arg))) logger.error(args.map(String).join(' '));
      },
    },
    context: async ({ request, req, principal, wanted }) => {
      if (!principal) {
        try {
          principal = await auth.authenticate(
            request?.headers.get('authorization') ?? headerOf(req, 'authorization'),
            request?.headers.get(USER_HEADER) ?? headerOf(req, USER_HEADER),
          );
        } catch (error) {
          throw error instanceof AuthenticationError ? unauthenticated(error) : error;
        }
      }
      // an HTTP request (SSE) is wanted until its client goes: the request's signal aborts then
      return {
        engine, hub, limits, principal, loaders: createLoaders(engine), logger,
        wanted: wanted ?? (() => !request?.signal.aborted),
        waitsForDatabase: wanted !== undefined,
        credentialsChanged: () => auth.forgetKeyChecks(),
      };
    },
    // never in development mode: stack and SQL text stay in the server's log
    maskedErrors: { isDev: false, maskError: masking },
    plugins: [
      useReadiness(new Readiness({ engine, hub, logger, ...options.readiness })),
      ...(metrics ? [metrics.plugin()] : []),
      useBodyLimit(options.maxBodyBytes ?? 1024 * 1024),
      useGetParameterCheck(),
      useShortParserErrors(),
      // GraphiQL's own files: plain GETs from the page, served before the checks GraphQL requests get
      useGraphiQLAssets(graphiql),
      ...(options.dashboard === false ? [] : [useDashboard(logger)]),
      useCrossSiteRequestPrevention(),
      useOperationLimits({ ...DEFAULT_OPERATION_LIMITS, ...options.operationLimits }),
      useHttpOperations({ maxNodes: options.maxNodes, maxSseStreamsPerCaller: options.maxSseStreamsPerCaller, countCallers: auth.required }),
      useSchemaPrivacy({ introspection: options.introspection ?? open, suggestions }),
      useInputHygiene(),
      useOneSubmissionPerOperation(),
      // each event's fields read afresh (a shared result is executed once per event and shape)
      useSharedEventExecution({
        eventContext: (context) => ({ ...(context as object), loaders: createLoaders(engine) }),
        // as yoga masks an error (its own message for the unexpected), once per shared result
        maskError: (error) => masking(error, 'Unexpected error.') as GraphQLError,
        // a running stream ends when its credentials lapse (a revoked API key, a JWT past its exp)
        admit: (context) => auth.stillValid((context as Context).principal),
        // also while no event comes (credentials that can lapse: authentication required, as closeLapsed)
        recheckMs: auth.required ? RECHECK_MS : undefined,
      }),
      ...(options.rateLimit ? [useMutationRateLimit(options.rateLimit)] : []),
    ],
  });
}

/** The HTTP server: queries, mutations and SSE subscriptions on /graphql, graphql-ws on the same port and path. */
export async function startServer(options: ServerOptions & { port: number; host?: string }): Promise<RunningServer> {
  const metrics = options.metrics === false ? undefined : new ServiceMetrics({ engine: options.engine, hub: options.hub, logger: options.logger });
  const yoga = createYogaApp(options, metrics);
  // with authentication off, only names no other site controls (hostAllowed); a probe of
  // liveness or readiness by any name (they act on nothing and tell nothing of the work)
  const served = (req: IncomingMessage) =>
    options.auth.required || hostAllowed(headerOf(req, 'host') ?? undefined, options.allowedHosts) || /^\/(health|ready)(\?|$)/.test(req.url ?? '');
  const server = createHttpServer((req, res) => {
    if (served(req)) return void yoga(req, res);
    res.writeHead(HOST_REFUSED.status, { 'content-type': 'application/json; charset=utf-8' });
    res.end(JSON.stringify({ errors: [{ message: HOST_REFUSED.message, extensions: { code: 'HOST_NOT_ALLOWED' } }] }));
  });
  // listen before the WebSocket server attaches: it would report a busy port as its own "internal error"
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(options.port, options.host ?? '0.0.0.0', () => {
      server.off('error', reject);
      resolve();
    });
  });
  const wss = new WebSocketServer({
    server,
    path: yoga.graphqlEndpoint,
    // a page of another site may not open a socket (webSocketOriginAllowed): 403 before any message
    verifyClient: ({ origin, req }: { origin?: string; req: IncomingMessage }, done: (allowed: boolean, status?: number, message?: string) => void) =>
      !served(req)
        ? done(false, HOST_REFUSED.status, HOST_REFUSED.message)
        : webSocketOriginAllowed(origin, [headerOf(req, 'host') ?? undefined, headerOf(req, 'x-forwarded-host') ?? undefined], options.corsOrigins)
          ? done(true)
          : done(false, 403, 'this origin may not open a socket here (ASYNCPROC_CORS_ORIGINS)'),
    maxPayload: options.maxBodyBytes ?? 1024 * 1024,
    WebSocket: coalescingWrites(socketClass(options.logger)),
  });
  metrics?.countWebSockets(() => wss.clients.size);
  const { auth } = options;
  const maxConnections = options.maxConnectionsPerCaller ?? 20;
  /** Open graphql-ws connections by caller (auth required only: anonymous callers are one). */
  const connections = new Map<string, number>();
  /** `request`: the upgrade request, until connection_init has been answered. */
  type Extra = { request: IncomingMessage; principal?: Principal; counted?: string; settingUp?: Set<string> };
  /** The socket of a graphql-ws connection (the ws adapter puts it in `extra`). */
  const socketOf = (ctx: { extra: Extra }) => (ctx.extra as Extra & { socket: WebSocket }).socket;
  /** An operation's context → the end of its setup (its id leaves the socket's settingUp). */
  const setupDone = new WeakMap<object, () => void>();
  /** Run an operation's execute or subscribe; its setup ends with it, whatever happens. */
  const setUp = async <T>(args: { contextValue?: unknown }, run: () => Promise<T>): Promise<T> => {
    try {
      return await run();
    } finally {
      if (args.contextValue) setupDone.get(args.contextValue as object)?.();
    }
  };
  /** Open sockets whose credentials can lapse (a JWT, an API key), checked every RECHECK_MS (closeLapsed). */
  const credentialed = new Map<WebSocket, Principal>();
  const lapsed = (socket: WebSocket) => {
    credentialed.delete(socket);
    // 4403: credentials refused; the client connects again with valid ones
    if (socket.readyState === socket.OPEN) socket.close(4403, 'credentials expired or revoked');
  };
  const closeLapsed = () => {
    for (const [socket, principal] of credentialed) {
      const valid = auth.stillValid(principal);
      if (valid !== true) void valid.then((yes) => yes || lapsed(socket));
    }
  };
  const recheck = auth.required ? setInterval(closeLapsed, RECHECK_MS) : null;
  recheck?.unref();
  const wsServer = useServer<Record<string, unknown>, Extra>(
    {
      execute: (args: any) => setUp(args, () => args.rootValue.execute(args)),
      // an event's result is turned into JSON once for every subscriber it goes to
      onNext: (_ctx, _id, _payload, _args, result) => serializedOnce(result as ExecutionResult),
      // a subscription's events as the shared execution hands them out, each masked once already (eventsOf)
      subscribe: (args: any) => setUp(args, async () => eventsOf(args.contextValue, await args.rootValue.subscribe(args))),
      // credentials are checked at connection_init (a bad or missing one closes the socket before any subscription),
      // then again while the socket lives: at each operation (prepare) and every RECHECK_MS (closeLapsed)
      onConnect: async (ctx) => {
        const { request: req } = ctx.extra;
        const socket = socketOf(ctx);
        let principal: Principal;
        try {
          const user = ctx.connectionParams?.[USER_HEADER];
          principal = await auth.authenticate(
            authorizationParam(ctx.connectionParams) ?? headerOf(req, 'authorization'),
            typeof user === 'string' ? user : headerOf(req, USER_HEADER),
          );
        } catch (error) {
          if (!(error instanceof AuthenticationError)) throw error;
          // 4401 Unauthorized: no credentials; 4403 Forbidden: credentials refused (reasons are limited to 123 bytes)
          socket.close(error.reason === 'missing' ? 4401 : 4403, error.message.slice(0, 120));
          return false;
        }
        // gone while its credentials were checked: graphql-ws has run onClose already, so nothing
        // counted or kept from here on would ever be given back (a caller locked out by 4429)
        if (socket.readyState !== socket.OPEN) return false;
        if (auth.required && principal.subject !== null) {
          const open = connections.get(principal.subject) ?? 0;
          if (open >= maxConnections) {
            socket.close(4429, `too many connections: at most ${maxConnections} per caller`);
            return false;
          }
          connections.set(principal.subject, open + 1);
          ctx.extra.counted = principal.subject;
        }
        ctx.extra.principal = principal;
        if (principal.via !== 'anonymous') credentialed.set(socket, principal);
        // the upgrade request (~2.5 KB with its headers and stream state) is not needed after the credentials:
        // graphql-ws would keep it for the socket's whole life
        // (undefined rather than delete: a deleted property turns the object into a ~280-byte dictionary)
        (ctx.extra as Partial<Extra>).request = undefined;
        return true;
      },
      onClose: (ctx) => {
        credentialed.delete(socketOf(ctx));
        const key = ctx.extra.counted;
        if (key === undefined) return;
        const open = (connections.get(key) ?? 1) - 1;
        if (open > 0) connections.set(key, open);
        else connections.delete(key);
      },
      onSubscribe: async (ctx, id, params) => {
        // An id whose operation is still being set up may not be used again (a complete, then a
        // subscribe of the same id, during the first one's setup): graphql-ws would install both
        // under the id, and the first would stream on after the socket closed, held by no one.
        // Closed as graphql-ws closes a subscribe of a live id.
        const settingUp = (ctx.extra.settingUp ??= new Set());
        if (settingUp.has(id)) {
          socketOf(ctx).close(4409, `Subscriber for ${id.slice(0, 80)} already exists`);
          return [createGraphQLError('this id is in use', { extensions: { code: 'BAD_USER_INPUT' } })];
        }
        settingUp.add(id);
        const prepared = await prepare(ctx, id, params);
        if (Array.isArray(prepared)) settingUp.delete(id);
        else setupDone.set((prepared as ExecutionArgs).contextValue as object, () => settingUp.delete(id));
        return prepared;
      },
    },
    wss,
  );

  /** onSubscribe's work once the id is reserved: the operation's arguments, or the errors that refuse it. */
  async function prepare(ctx: WsContext<Record<string, unknown>, Extra>, id: string, params: SubscribePayload): Promise<ExecutionArgs | readonly GraphQLError[]> {
    const refused = refuseBeyondSubscriptionLimit(ctx, options.maxSubscriptionsPerConnection ?? 100);
    if (refused) return refused;
    const principal = ctx.extra.principal!;
    if (principal.expiresAt && principal.expiresAt.getTime() <= Date.now()) {
      return [createGraphQLError('the token has expired: connect again with a new one', { extensions: { code: 'UNAUTHENTICATED' } })];
    }
    // an API key revoked since the socket opened (looked up again at most once every RECHECK_MS)
    const valid = auth.stillValid(principal);
    if (valid !== true && !(await valid)) {
      lapsed(socketOf(ctx));
      return [createGraphQLError('this API key was revoked', { extensions: { code: 'UNAUTHENTICATED' } })];
    }
    // what the context starts from: the verified principal and the operation (the socket's state stays with graphql-ws)
    // wanted while graphql-ws holds it: a `complete` from the client or the socket's close removes it
    const wanted = () => id in ctx.subscriptions;
    const { schema, execute, subscribe, contextFactory, parse, validate } = yoga.getEnveloped({ principal, params, wanted });
    let document;
    try {
      document = parse(params.query);
    } catch (error) {
      if (error instanceof GraphQLError) return [error];
      // anything else would be an invalid return value, which graphql-ws answers by closing the whole socket (4500)
      options.logger.error({ err: error }, 'unexpected error parsing a subscription (masked)');
      return [createGraphQLError('Unexpected error.', { extensions: { code: 'INTERNAL_SERVER_ERROR' } })];
    }
    const errors = validate(schema, document);
    if (errors.length) return errors;
    return {
      schema,
      operationName: params.operationName,
      document,
      variableValues: params.variables,
      contextValue: holdEvents(await contextFactory()),
      rootValue: { execute, subscribe },
    };
  }

  const port = (server.address() as AddressInfo).port;
  return {
    server,
    port,
    url: `http://127.0.0.1:${port}${yoga.graphqlEndpoint}`,
    close: async () => {
      if (recheck) clearInterval(recheck);
      await wsServer.dispose();
      wss.close();
      server.closeAllConnections();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}
