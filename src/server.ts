import { createServer as createHttpServer, type IncomingMessage, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { GraphQLError } from 'graphql';
import { createGraphQLError, createYoga, maskError, type Plugin } from 'graphql-yoga';
import { useServer } from 'graphql-ws/use/ws';
import { WebSocketServer } from 'ws';
import type { CompletionHub } from './completionHub.js';
import { EngineError, type Engine } from './engine.js';
import { renderGraphiQL, useGraphiQLAssets } from './graphiql.js';
import type { Logger } from './logger.js';
import { schema, type Context, type Limits } from './schema/index.js';

export interface ServerOptions {
  engine: Engine;
  hub: CompletionHub;
  logger: Logger;
  limits: Limits;
  /** Largest request body (HTTP) or message (WebSocket), in bytes. @default 1 MiB */
  maxBodyBytes?: number;
  /** @default true */
  graphiql?: boolean;
}

export interface RunningServer {
  server: Server;
  url: string;
  port: number;
  close(): Promise<void>;
}

const USER_HEADER = 'x-asyncproc-user';

/** Refuse a request whose declared body is larger than the limit, before it is read. */
function useBodyLimit(maxBytes: number): Plugin {
  return {
    onRequest({ request, endResponse, fetchAPI }) {
      const length = Number(request.headers.get('content-length') ?? '0');
      if (length > maxBytes) {
        endResponse(
          new fetchAPI.Response(
            JSON.stringify({
              errors: [{ message: `request body exceeds ${maxBytes} bytes`, extensions: { code: 'PAYLOAD_TOO_LARGE' } }],
            }),
            { status: 413, headers: { 'content-type': 'application/json' } },
          ),
        );
      }
    },
  };
}

export function createYogaApp(options: ServerOptions) {
  const { engine, hub, limits, logger } = options;
  return createYoga<{ req?: IncomingMessage }, Context>({
    schema,
    graphqlEndpoint: '/graphql',
    landingPage: false,
    graphiql: options.graphiql === false ? false : { title: 'asyncproc', subscriptionsProtocol: 'WS' },
    renderGraphiQL,
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
      maskError(error, message, isDev) {
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
        return maskError(error, message, isDev);
      },
    },
    plugins: [useBodyLimit(options.maxBodyBytes ?? 1024 * 1024), useGraphiQLAssets(options.graphiql !== false)],
  });
}

/** The HTTP server: queries, mutations and SSE subscriptions on /graphql, graphql-ws on the same port and path. */
export async function startServer(options: ServerOptions & { port: number; host?: string }): Promise<RunningServer> {
  const yoga = createYogaApp(options);
  const server = createHttpServer(yoga);
  const wss = new WebSocketServer({ server, path: yoga.graphqlEndpoint, maxPayload: options.maxBodyBytes ?? 1024 * 1024 });
  const wsServer = useServer(
    {
      execute: (args: any) => args.rootValue.execute(args),
      subscribe: (args: any) => args.rootValue.subscribe(args),
      onSubscribe: async (ctx, _id, params) => {
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
