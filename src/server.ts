import { createServer as createHttpServer, type IncomingMessage, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { GraphQLError } from 'graphql';
import { createGraphQLError, createYoga, maskError } from 'graphql-yoga';
import { useServer } from 'graphql-ws/use/ws';
import { WebSocketServer } from 'ws';
import type { CompletionHub } from './completionHub.js';
import { useBodyLimit } from './edge/bodyLimit.js';
import { corsOptions, useCrossSiteRequestPrevention } from './edge/crossSite.js';
import { useInputHygiene } from './edge/inputHygiene.js';
import { DEFAULT_OPERATION_LIMITS, useOperationLimits, type OperationLimits } from './edge/operationLimits.js';
import { hideSuggestions, useSchemaPrivacy } from './edge/schemaPrivacy.js';
import { refuseBeyondSubscriptionLimit } from './edge/subscriptionLimit.js';
import { socketClass } from './edge/webSocketLimits.js';
import { EngineError, type Engine } from './engine.js';
import type { Logger } from './logger.js';
import { schema, type Context, type Limits } from './schema/index.js';

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
  /** Schema introspection. @default !authRequired */
  introspection?: boolean;
  /** "Did you mean …?" in error messages. @default !authRequired */
  suggestions?: boolean;
  /** Origins allowed cross-origin (`*`: any). @default closed when authRequired, yoga's default otherwise */
  corsOrigins?: string[];
  /** Depth, alias, token, directive and cost limits of every operation. */
  operationLimits?: Partial<OperationLimits>;
  /** Subscriptions one graphql-ws connection may hold. @default 100 */
  maxSubscriptionsPerConnection?: number;
}

export interface RunningServer {
  server: Server;
  url: string;
  port: number;
  close(): Promise<void>;
}

const USER_HEADER = 'x-asyncproc-user';

export function createYogaApp(options: ServerOptions) {
  const { engine, hub, limits, logger } = options;
  const open = !options.authRequired;
  const suggestions = options.suggestions ?? open;
  return createYoga<{ req?: IncomingMessage }, Context>({
    schema,
    graphqlEndpoint: '/graphql',
    landingPage: false,
    graphiql: (options.graphiql ?? open) ? { title: 'asyncproc', subscriptionsProtocol: 'WS' } : false,
    cors: corsOptions(options.corsOrigins, !open),
    logging: {
      debug: (...args) => logger.debug(args.join(' ')),
      info: (...args) => logger.info(args.join(' ')),
      warn: (...args) => logger.warn(args.join(' ')),
      error: (...args) => logger.error(args.map(String).join(' ')),
    },
    context: ({ request, req }) => ({
      engine,
      hub,
      limits,
      user: request?.headers.get(USER_HEADER) ?? (req?.headers[USER_HEADER] as string | undefined) ?? null,
    }),
    maskedErrors: {
      // never in development mode: stack and SQL text stay in the server's log
      isDev: false,
      maskError(error, message) {
        if (!suggestions) hideSuggestions(error);
        const original = error instanceof GraphQLError ? error.originalError : error;
        if (original instanceof EngineError) {
          return createGraphQLError(original.message, {
            extensions: { code: original.code },
            path: error instanceof GraphQLError ? error.path : undefined,
          });
        }
        if (!(original instanceof GraphQLError) && original !== undefined) {
          logger.error({ err: original }, 'unexpected error (masked)');
        }
        return maskError(error, message, false);
      },
    },
    plugins: [
      useBodyLimit(options.maxBodyBytes ?? 1024 * 1024),
      useCrossSiteRequestPrevention(),
      useOperationLimits({ ...DEFAULT_OPERATION_LIMITS, ...options.operationLimits }),
      useSchemaPrivacy({ introspection: options.introspection ?? open, suggestions }),
      useInputHygiene(),
    ],
  });
}

/** The HTTP server: queries, mutations and SSE subscriptions on /graphql, graphql-ws on the same port and path. */
export async function startServer(options: ServerOptions & { port: number; host?: string }): Promise<RunningServer> {
  const yoga = createYogaApp(options);
  const server = createHttpServer(yoga);
  const wss = new WebSocketServer({
    server,
    path: yoga.graphqlEndpoint,
    maxPayload: options.maxBodyBytes ?? 1024 * 1024,
    WebSocket: socketClass(options.logger),
  });
  const wsServer = useServer(
    {
      execute: (args: any) => args.rootValue.execute(args),
      subscribe: (args: any) => args.rootValue.subscribe(args),
      onSubscribe: async (ctx, _id, params) => {
        const refused = refuseBeyondSubscriptionLimit(ctx, options.maxSubscriptionsPerConnection ?? 100);
        if (refused) return refused;
        const { schema, execute, subscribe, contextFactory, parse, validate } = yoga.getEnveloped({
          ...ctx,
          req: ctx.extra.request,
          socket: ctx.extra.socket,
          params,
        });
        let document;
        try {
          document = parse(params.query);
        } catch (error) {
          return [error as GraphQLError];
        }
        const errors = validate(schema, document);
        if (errors.length) return errors;
        return {
          schema,
          operationName: params.operationName,
          document,
          variableValues: params.variables,
          contextValue: await contextFactory(),
          rootValue: { execute, subscribe },
        };
      },
    },
    wss,
  );

  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(options.port, options.host ?? '0.0.0.0', () => resolve());
  });
  const port = (server.address() as AddressInfo).port;
  return {
    server,
    port,
    url: `http://127.0.0.1:${port}${yoga.graphqlEndpoint}`,
    close: async () => {
      await wsServer.dispose();
      wss.close();
      server.closeAllConnections();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}
