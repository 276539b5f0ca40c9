import { Client as SseClient, createClient as createSseClient } from 'graphql-sse';
import { createClient as createWsClient, type Client as WsClient } from 'graphql-ws';
import WebSocket from 'ws';
import { startApp, type App } from '../../src/app.js';
import { loadConfig } from '../../src/config.js';
import { silentLogger, type Logger } from '../../src/logger.js';

export interface TestApp {
  app: App;
  url: string;
  /** POST a GraphQL operation over real HTTP. */
  gql<T = any>(query: string, variables?: Record<string, unknown>, headers?: Record<string, string>): Promise<{ status: number; body: { data?: T; errors?: any[] } }>;
  /** A graphql-ws client; `connectionParams` carry credentials (`{ Authorization: 'Bearer …' }`). */
  ws(connectionParams?: Record<string, unknown>): WsClient;
  /** A graphql-sse client; `headers` carry credentials. */
  sse(headers?: Record<string, string>): SseClient<false>;
  stop(): Promise<void>;
}

/** The real service (HTTP + graphql-ws + SSE) on a free port, against `databaseUrl`. */
export async function startTestApp(databaseUrl: string, env: Record<string, string> = {}, logger: Logger = silentLogger): Promise<TestApp> {
  // anonymous access unless the test configures authentication
  const auth = Object.keys(env).some((key) => key === 'ASYNCPROC_AUTH' || key.startsWith('ASYNCPROC_JWT') || key === 'ASYNCPROC_JWKS_URL') ? {} : { ASYNCPROC_AUTH: 'none' };
  const config = loadConfig({ DATABASE_URL: databaseUrl, PORT: '0', HOST: '127.0.0.1', ASYNCPROC_DEMO: 'true', ...auth, ...env });
  const app = await startApp(config, logger);
  const url = app.server!.url;
  const clients: { dispose(): void | Promise<void> }[] = [];
  return {
    app,
    url,
    async gql(query, variables, headers = {}) {
      const response = await fetch(url, {
        method: 'POST',
        headers: { 'content-type': 'application/json', accept: 'application/graphql-response+json, application/json', ...headers },
        body: JSON.stringify({ query, variables }),
      });
      return { status: response.status, body: await response.json() };
    },
    ws(connectionParams) {
      const client = createWsClient({ url: url.replace(/^http/, 'ws'), webSocketImpl: WebSocket, retryAttempts: 0, connectionParams });
      clients.push(client);
      return client;
    },
    sse(headers) {
      const client = createSseClient({ url, retryAttempts: 0, headers });
      clients.push(client);
      return client;
    },
    async stop() {
      for (const client of clients) await client.dispose();
      await app.stop();
    },
  };
}

/**
 * Collect every result of a subscription until it completes (or `count` results arrived);
 * fails after `timeoutMs`, so "never delivered" is a failed test, not a stalled run.
 */
export async function collect<T>(iterator: AsyncIterableIterator<T>, count = Infinity, timeoutMs = 60_000): Promise<T[]> {
  const results: T[] = [];
  let timer: NodeJS.Timeout | undefined;
  const deadline = new Promise<never>((_, reject) => {
    timer = setTimeout(() => {
      void iterator.return?.();
      reject(new Error(`subscription delivered ${results.length} result(s) in ${timeoutMs} ms`));
    }, timeoutMs);
  });
  const reading = (async () => {
    for await (const result of iterator) {
      results.push(result);
      if (results.length >= count) break;
    }
    return results;
  })();
  try {
    return await Promise.race([reading, deadline]);
  } finally {
    clearTimeout(timer);
  }
}
