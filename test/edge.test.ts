/** The GraphQL edge against abuse: operation limits, body size, cross-site requests, subscriptions per socket, odd input, production defaults. */
import assert from 'node:assert/strict';
import { request as httpRequest } from 'node:http';
import { connect } from 'node:net';
import { after, before, describe, it } from 'node:test';
import WebSocket from 'ws';
import { Authenticator } from '../src/auth/authenticate.js';
import { startServer, type RunningServer } from '../src/server.js';
import { collect, startTestApp, type TestApp } from './support/app.js';
import { startTestCluster, waitFor, type TestCluster } from './support/database.js';
import { capturingLogger } from './support/logs.js';

let cluster: TestCluster;
let t: TestApp;
const log = capturingLogger();

before(async () => {
  cluster = await startTestCluster();
  t = await startTestApp(await cluster.createDatabase(), { ASYNCPROC_MAX_SUBSCRIPTIONS_PER_CONNECTION: '3' }, log.logger);
});
after(async () => {
  await t?.stop();
  await cluster?.stop();
});

async function total(procedure?: string): Promise<number> {
  const { body } = await t.gql(`query($f: ExecutionFilter) { executions(filter: $f) { totalCount } }`, { f: procedure ? { procedure } : {} });
  return body.data.executions.totalCount;
}

/** The promise's value, or a failure after `ms`: a refusal that never comes fails the test instead of stalling the run. */
function within<T>(promise: Promise<T>, ms = 10_000): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`no answer within ${ms} ms`)), ms)));
  return Promise.race([promise, late]).finally(() => clearTimeout(timer));
}

const errorWith = (body: any, code: string) => body.errors?.find((e: any) => e.extensions?.code === code);

/** A query 2·`pairs` + 2 levels deep through Execution.batch → Batch.executions: 2^pairs leaves over a 2-call batch. */
function batchBomb(token: string, pairs: number, root = `execution(token: "${token}")`): string {
  let inner = 'token';
  for (let i = 0; i < pairs; i++) inner = `batch { executions(first: 100) { nodes { ${inner} } } }`;
  return `{ ${root} { ${inner} } }`;
}

/** POST a raw body over HTTP/1.1, chunked when no content-length is given. */
function rawPost(url: string, headers: Record<string, string>, chunks: (string | Buffer)[]): Promise<{ status: number; text: string }> {
  return new Promise((resolve, reject) => {
    const req = httpRequest(url, { method: 'POST', headers }, (res) => {
      let text = '';
      res.on('data', (d) => (text += d));
      res.on('end', () => resolve({ status: res.statusCode!, text }));
    });
    req.on('error', (error: NodeJS.ErrnoException) => {
      // the server may close while we still write; the answer came first
      if (error.code !== 'EPIPE' && error.code !== 'ECONNRESET') reject(error);
    });
    const write = (i: number): void => {
      if (i === chunks.length) return void req.end();
      if (req.destroyed) return;
      req.write(chunks[i], () => setImmediate(() => write(i + 1)));
    };
    write(0);
  });
}

describe('query cost: depth, aliases, tokens, directives, cost', () => {
  let token: string;
  before(async () => {
    const { body } = await t.gql(`mutation { submitBatch(input: { stages: [[{ procedure: "demo.noop" }, { procedure: "demo.noop" }]] }) { batch { id } } }`);
    const id = body.data.submitBatch.batch.id;
    const read = await t.gql(`query($id: ID!) { batch(id: $id) { executions { nodes { token } } } }`, { id });
    token = read.body.data.batch.executions.nodes[0].token;
  });

  it('the status of a refusal follows what the client accepts, as the README says: 400 for application/graphql-response+json, 200 for application/json alone', async () => {
    const query = `{ ${Array.from({ length: 60 }, (_, i) => `a${i}: changeCursor`).join(' ')} }`;
    for (const [accept, expected] of [['application/graphql-response+json', 400], ['application/graphql-response+json, application/json', 400], ['application/json', 200]] as const) {
      const response = await fetch(t.url, { method: 'POST', headers: { 'content-type': 'application/json', accept }, body: JSON.stringify({ query }) });
      const body = (await response.json()) as { data?: unknown; errors?: { extensions?: { code?: string; limit?: string } }[] };
      assert.equal(response.status, expected, accept);
      assert.deepEqual(body.errors?.map((e) => [e.extensions?.code, e.extensions?.limit]), [['QUERY_TOO_COMPLEX', 'aliases']], accept);
      assert.equal(body.data, undefined, 'nothing executed');
    }
  });

  it('a 44-level query through Execution.batch → Batch.executions is refused in milliseconds (HTTP, graphql-ws, SSE)', async () => {
    const query = batchBomb(token, 21);
    const started = performance.now();
    const { status, body } = await t.gql(query);
    const ms = performance.now() - started;
    assert.equal(status, 400, JSON.stringify(body));
    assert.ok(
      body.errors!.some((e: any) => e.extensions?.code === 'QUERY_TOO_COMPLEX' && e.extensions.limit === 'depth'),
      JSON.stringify(body),
    );
    assert.equal(body.data, undefined, 'nothing executed');
    assert.ok(ms < 1000, `refused in ${ms} ms`);
    console.log(`# 44-level query refused over HTTP in ${ms.toFixed(1)} ms`);

    const subscription = batchBomb(token, 21, 'executionCompleted(token: "' + token + '")').replace(/^\{/, 'subscription {');
    for (const [transport, client] of [['graphql-ws', t.ws()], ['SSE', t.sse()]] as const) {
      const wsStarted = performance.now();
      const errors = await within(
        new Promise<any>((resolve) => {
          client.subscribe({ query: subscription }, { next: (r: any) => resolve(r.errors), error: resolve, complete: () => resolve('completed') });
        }),
      );
      assert.ok(Array.isArray(errors), JSON.stringify(errors));
      assert.ok(
        errors.some((e: any) => e.extensions?.code === 'QUERY_TOO_COMPLEX' && e.extensions.limit === 'depth'),
        JSON.stringify(errors),
      );
      console.log(`# 44-level subscription refused over ${transport} in ${(performance.now() - wsStarted).toFixed(1)} ms`);
    }
  });

  it('5,000 aliases are refused in milliseconds; so are 51 and too many directives or too high a cost', async () => {
    const bomb = `{ ${Array.from({ length: 5000 }, (_, i) => `a${i}: procedures { name parameters { name type } }`).join(' ')} }`;
    const started = performance.now();
    const { status, body } = await t.gql(bomb);
    const ms = performance.now() - started;
    assert.equal(status, 400);
    assert.ok(errorWith(body, 'QUERY_TOO_COMPLEX'), JSON.stringify(body).slice(0, 500));
    assert.ok(ms < 1000, `refused in ${ms} ms`);
    console.log(`# 5,000-alias query (${bomb.length} bytes) refused in ${ms.toFixed(1)} ms`);

    const aliases = await t.gql(`{ ${Array.from({ length: 51 }, (_, i) => `a${i}: changeCursor`).join(' ')} }`);
    assert.equal(errorWith(aliases.body, 'QUERY_TOO_COMPLEX')?.extensions.limit, 'aliases', JSON.stringify(aliases.body));
    const directives = await t.gql(`{ changeCursor ${'@include(if: true) '.repeat(21)} }`);
    assert.equal(errorWith(directives.body, 'QUERY_TOO_COMPLEX')?.extensions.limit, 'directives', JSON.stringify(directives.body));
    const fanOut = `{ executions(first: 500) { edges { node { token status arguments history { number status worker error { message } } batch { id status stages { stage total } } } } } }`;
    const cost = await t.gql(fanOut);
    assert.equal(errorWith(cost.body, 'QUERY_TOO_COMPLEX')?.extensions.limit, 'cost', JSON.stringify(cost.body));
    const tokens = await t.gql(`{ changeCursor ${'__typename '.repeat(5000)} }`);
    assert.equal(errorWith(tokens.body, 'QUERY_TOO_COMPLEX')?.extensions.limit, 'tokens', JSON.stringify(tokens.body));
  });

  it('a document nested a few thousand levels (within the token limit) is refused before it is parsed, on every transport, and the socket lives on', async () => {
    const selections = `{${'viewer{'.repeat(2000)}${'}'.repeat(2000)}}`;
    const list = `mutation { invoke(input: { procedure: "demo.record", arguments: { tag: ${'['.repeat(2000)}"x"${']'.repeat(2000)} } }) { execution { token } } }`;
    const before = await t.gql('{ executions { totalCount } }');
    for (const query of [selections, list]) {
      const { status, body } = await t.gql(query);
      assert.equal(status, 400, JSON.stringify(body).slice(0, 300));
      const error = errorWith(body, 'QUERY_TOO_COMPLEX');
      assert.equal(error?.extensions.limit, 'nesting', JSON.stringify(body).slice(0, 300));
    }
    assert.equal((await t.gql('{ executions { totalCount } }')).body.data.executions.totalCount, before.body.data.executions.totalCount, 'nothing submitted');
    const deep = `subscription { executionCompleted(token: ${'['.repeat(2000)}"x"${']'.repeat(2000)}) { status } }`;
    const ws = t.ws();
    for (const [transport, client] of [['graphql-ws', ws], ['SSE', t.sse()]] as const) {
      const errors = await within(
        new Promise<any>((resolve) => {
          client.subscribe({ query: deep }, { next: (r: any) => resolve(r.errors), error: resolve, complete: () => resolve('completed') });
        }),
      );
      if (transport === 'SSE') {
        // refused while parsing, as an HTTP request is: a 400 with the refusal, which graphql-sse's client hands over as its NetworkError
        assert.equal(errors?.response?.status, 400, JSON.stringify(errors));
        const body = await errors.response.text();
        assert.match(body, /"code":"QUERY_TOO_COMPLEX","limit":"nesting"/, body);
        continue;
      }
      assert.ok(Array.isArray(errors), `${transport}: ${JSON.stringify(errors)}`);
      assert.equal(errors[0]?.extensions?.code, 'QUERY_TOO_COMPLEX', `${transport}: ${JSON.stringify(errors)}`);
      assert.equal(errors[0]?.extensions?.limit, 'nesting');
    }
    // the graphql-ws socket was not closed: it serves the next operation
    const next = await within(
      new Promise<any>((resolve) => ws.subscribe({ query: '{ changeCursor }' }, { next: (r: any) => resolve(r), error: resolve, complete: () => undefined })),
    );
    assert.equal(typeof next.data?.changeCursor, 'string', JSON.stringify(next));
    // strings, block strings and comments do not count: their brackets are text
    const text = await t.gql(`mutation { invoke(input: { procedure: "demo.record", arguments: { tag: "${'['.repeat(300)}" } }) { execution { token } } }`);
    assert.equal(text.body.errors, undefined, JSON.stringify(text.body.errors));
    const block = await t.gql(`# ${'{'.repeat(300)}\nmutation { invoke(input: { procedure: "demo.record", arguments: { tag: ${'"'.repeat(3)} \\${'"'.repeat(3)} ${'('.repeat(300)} ${'"'.repeat(3)} } }) { execution { token } } }`);
    assert.equal(block.body.errors, undefined, JSON.stringify(block.body.errors));
  });

  it('ordinary queries pass: a page of executions with their batches, introspection', async () => {
    const { body } = await t.gql(`{ executions(first: 50) { totalCount edges { cursor node { token status batch { id executions(first: 10) { nodes { token status } } } history { number status } } } } }`);
    assert.equal(body.errors, undefined, JSON.stringify(body.errors));
    const introspection = await t.gql(`{ __schema { types { name fields { name type { name ofType { name ofType { name ofType { name } } } } } } } }`);
    assert.equal(introspection.body.errors, undefined, JSON.stringify(introspection.body.errors));
  });
});

describe('request size', () => {
  it('a 5 MB chunked body (no Content-Length) is refused with 413 after 1 MiB is read; nothing runs', async () => {
    const before = await total('demo.record');
    const head = `{"query":"mutation($t: String!) { invoke(input: { procedure: \\"demo.record\\", arguments: { tag: $t } }) { execution { token } } }","variables":{"t":"`;
    const chunk = Buffer.alloc(64 * 1024, 'x');
    const chunks = [head, ...Array.from({ length: 80 }, () => chunk), '"}}'];
    const { status, text } = await rawPost(t.url, { 'content-type': 'application/json', 'transfer-encoding': 'chunked' }, chunks);
    assert.equal(status, 413, text);
    assert.equal(JSON.parse(text).errors[0].extensions.code, 'PAYLOAD_TOO_LARGE');
    assert.equal(await total('demo.record'), before, 'nothing enqueued');
  });

  it('a body longer than its Content-Length is cut at it, and a Content-Length beside Transfer-Encoding is refused: nothing runs', async () => {
    // the declared length is the whole body (the server no longer counts bytes when a length is declared)
    const before = await total('demo.record');
    const body = JSON.stringify({ query: 'mutation($t: String!) { invoke(input: { procedure: "demo.record", arguments: { tag: $t } }) { execution { token } } }', variables: { t: 'x'.repeat(3 * 1024 * 1024) } });
    const { host, hostname, port } = new URL(t.url);
    const raw = (head: string, payload: string) =>
      new Promise<string>((resolve, reject) => {
        const socket = connect(Number(port), hostname, () => {
          socket.write(head);
          socket.end(payload);
        });
        let text = '';
        socket.on('data', (d) => (text += d));
        socket.on('close', () => resolve(text));
        socket.on('error', (error: NodeJS.ErrnoException) => (error.code === 'ECONNRESET' || error.code === 'EPIPE' ? resolve(text) : reject(error)));
      });
    const short = await raw(`POST /graphql HTTP/1.1\r\nhost: ${host}\r\ncontent-type: application/json\r\ncontent-length: 200\r\nconnection: close\r\n\r\n`, body);
    assert.match(short, /^HTTP\/1\.1 400/, short.slice(0, 200));
    const both = await raw(`POST /graphql HTTP/1.1\r\nhost: ${host}\r\ncontent-type: application/json\r\ncontent-length: 10\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n`, `${body.length.toString(16)}\r\n${body}\r\n0\r\n\r\n`);
    assert.match(both, /^HTTP\/1\.1 400/, both.slice(0, 200));
    assert.equal(await total('demo.record'), before, 'nothing enqueued');
  });

  it('a small chunked body is read whole and runs', async () => {
    const query = JSON.stringify({ query: '{ changeCursor }' });
    const { status, text } = await rawPost(t.url, { 'content-type': 'application/json', 'transfer-encoding': 'chunked' }, [query.slice(0, 5), query.slice(5)]);
    assert.equal(status, 200, text);
    assert.ok(JSON.parse(text).data.changeCursor);
  });

  it('a WebSocket message over the limit closes the socket (1009), runs nothing and prints no stack', async (context) => {
    const consoleErrors = context.mock.method(console, 'error', () => undefined);
    const before = await total('demo.record');
    const socket = new WebSocket(t.url.replace(/^http/, 'ws'), 'graphql-transport-ws');
    const messages: any[] = [];
    socket.on('message', (data) => messages.push(JSON.parse(String(data))));
    await new Promise((resolve) => socket.once('open', resolve));
    socket.send(JSON.stringify({ type: 'connection_init' }));
    await waitFor(async () => messages.some((m) => m.type === 'connection_ack'));
    const closed = new Promise<number>((resolve) => socket.once('close', (code) => resolve(code)));
    const query = 'mutation($t: String!) { invoke(input: { procedure: "demo.record", arguments: { tag: $t } }) { execution { token } } }';
    socket.send(JSON.stringify({ id: '1', type: 'subscribe', payload: { query, variables: { t: 'x'.repeat(1024 * 1024 + 1) } } }));
    const code = await within(closed).finally(() => socket.terminate());
    assert.equal(code, 1009);
    assert.deepEqual(messages.map((m) => m.type), ['connection_ack']);
    assert.equal(consoleErrors.mock.callCount(), 0);
    assert.equal(await total('demo.record'), before, 'nothing enqueued');
  });

  it('a socket that never sends connection_init, nor answers the close, is ended about 2 s after its 4408 (not 30 s)', async () => {
    const { connect } = await import('node:net');
    const { port } = new URL(t.url);
    const opened = Date.now();
    // the upgrade by hand, then silence: no frame read, no close answered
    const raw = connect(Number(port), '127.0.0.1');
    raw.on('error', () => undefined);
    let heard = '';
    raw.on('data', (chunk) => (heard += chunk.toString('latin1')));
    raw.write(
      `GET /graphql HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n` +
        `Sec-WebSocket-Key: ${Buffer.from('0123456789abcdef').toString('base64')}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: graphql-transport-ws\r\n\r\n`,
    );
    const ended = await within(new Promise<number>((resolve) => raw.once('close', () => resolve(Date.now() - opened))), 20_000);
    assert.match(heard, /^HTTP\/1\.1 101/);
    assert.ok(heard.includes('Connection initialisation timeout'), 'told 4408 first');
    assert.ok(ended < 10_000, `the connection lasted ${ended} ms`);
  });
});

describe('cross-site requests', () => {
  const mutation = 'mutation { invoke(input: { procedure: "demo.record", arguments: { tag: "csrf" } }) { execution { token } } }';

  it('a form POST (urlencoded, multipart, text/plain) running demo.record is refused and enqueues nothing', async () => {
    const before = await total('demo.record');
    const form = new FormData();
    form.set('operations', JSON.stringify({ query: mutation }));
    form.set('map', '{}');
    const bodies: RequestInit[] = [
      { body: new URLSearchParams({ query: mutation }) },
      { body: form },
      { body: JSON.stringify({ query: mutation }), headers: { 'content-type': 'text/plain' } },
    ];
    for (const init of bodies) {
      const response = await fetch(t.url, { method: 'POST', ...init });
      const body = await response.json();
      assert.equal(response.status, 403, JSON.stringify(body));
      assert.equal(body.errors[0].extensions.code, 'CSRF_HEADER_REQUIRED');
    }
    assert.equal(await total('demo.record'), before, 'nothing enqueued');
  });

  it('JSON POSTs, graphql-sse and a GET with the CSRF header pass; a bare GET does not', async () => {
    assert.equal((await t.gql('{ changeCursor }')).status, 200);
    const [event] = await collect(t.sse().iterate({ query: '{ changeCursor }' }), 1);
    assert.ok(event.data?.changeCursor);
    const url = `${t.url}?query=${encodeURIComponent('{ changeCursor }')}`;
    assert.equal((await fetch(url, { headers: { accept: 'application/json' } })).status, 403);
    assert.equal((await fetch(url, { headers: { accept: 'application/json', 'x-asyncproc-csrf': '1' } })).status, 200);
  });

  /** A graphql-ws upgrade with these headers: acknowledged, or refused (the HTTP status of a refused upgrade, or a close code). */
  const upgrade = (url: string, headers: Record<string, string>, payload: Record<string, unknown> = {}) =>
    new Promise<{ ack: boolean; status?: number; code?: number }>((resolve) => {
      const socket = new WebSocket(url.replace(/^http/, 'ws'), 'graphql-transport-ws', { headers });
      socket.on('unexpected-response', (_req, res) => (resolve({ ack: false, status: res.statusCode }), socket.terminate()));
      socket.on('error', () => undefined);
      socket.on('open', () => socket.send(JSON.stringify({ type: 'connection_init', payload })));
      socket.on('message', (data) => JSON.parse(String(data)).type === 'connection_ack' && (resolve({ ack: true }), socket.close()));
      socket.on('close', (code) => resolve({ ack: false, code }));
    });

  it('with authentication off, a page of another site can neither read an answer (no CORS) nor open a socket; the service\'s own page and non-browser clients can', async () => {
    const preflight = await fetch(t.url, { method: 'OPTIONS', headers: { origin: 'https://evil.example', 'access-control-request-method': 'POST', 'access-control-request-headers': 'content-type' } });
    assert.equal(preflight.headers.get('access-control-allow-origin'), null);
    assert.equal(preflight.headers.get('access-control-allow-credentials'), null);
    const before = await total('demo.record');
    assert.deepEqual(await upgrade(t.url, { origin: 'https://evil.example' }), { ack: false, status: 403 });
    assert.deepEqual(await upgrade(t.url, { origin: 'null' }), { ack: false, status: 403 }, 'an opaque origin (sandboxed frame, data: URL)');
    assert.equal(await total('demo.record'), before);
    const own = new URL(t.url);
    assert.deepEqual(await upgrade(t.url, { origin: own.origin }), { ack: true }, "the service's own pages (dashboard, GraphiQL)");
    assert.deepEqual(await upgrade(t.url, { origin: 'https://asyncproc.example.com', 'x-forwarded-host': 'asyncproc.example.com' }), { ack: true }, 'behind a proxy that names the host it was asked for');
    assert.deepEqual(await upgrade(t.url, {}), { ack: true }, 'a client that is not a browser sends no Origin');
  });

  /** A JSON POST of `query` to `url` naming `host` in its Host header (what a browser sends after a rebinding of that name). */
  const postAs = (url: string, host: string, query: string, headers: Record<string, string> = {}) =>
    new Promise<{ status: number; body: any }>((resolve, reject) => {
      const body = JSON.stringify({ query });
      const req = httpRequest(url, { method: 'POST', headers: { host, 'content-type': 'application/json', origin: `http://${host}`, ...headers } }, (res) => {
        let text = '';
        res.on('data', (chunk) => (text += chunk));
        res.on('end', () => resolve({ status: res.statusCode!, body: JSON.parse(text) }));
      });
      req.on('error', reject);
      req.end(body);
    });

  it('with authentication off, a host name another site could point at the service (DNS rebinding) is refused over HTTP and graphql-ws and changes nothing; IP addresses, localhost and listed names are served', async () => {
    const port = new URL(t.url).port;
    const before = await total('demo.record');
    for (const host of [`evil.example:${port}`, `EVIL.example:${port}`, 'evil.example', `127.0.0.1.nip.io:${port}`]) {
      const { status, body } = await postAs(t.url, host, mutation);
      assert.equal(status, 403, `${host}: ${JSON.stringify(body)}`);
      assert.equal(body.errors[0].extensions.code, 'HOST_NOT_ALLOWED', host);
      // the page's own origin, as it is after the rebinding
      assert.deepEqual(await upgrade(t.url, { host, origin: `http://${host}` }), { ack: false, status: 403 }, host);
    }
    assert.equal(await total('demo.record'), before, 'nothing enqueued');
    // a container's probes may name the service as they like: liveness and readiness tell nothing of the work
    for (const path of ['/health', '/ready']) {
      const status = await new Promise<number>((resolve, reject) =>
        httpRequest(new URL(path, t.url), { headers: { host: 'asyncproc:4000' } }, (res) => (res.resume(), resolve(res.statusCode!))).on('error', reject).end(),
      );
      assert.equal(status, 200, path);
    }
    for (const host of [`127.0.0.1:${port}`, `localhost:${port}`, `app.localhost:${port}`, `[::1]:${port}`, `10.1.2.3:${port}`]) {
      assert.equal((await postAs(t.url, host, '{ changeCursor }')).status, 200, host);
      assert.deepEqual(await upgrade(t.url, { host, origin: `http://${host}` }), { ack: true }, host);
    }
    const listed = await startTestApp(await cluster.createDatabase(), { ASYNCPROC_ALLOWED_HOSTS: 'devbox.internal, Other.Example' }, log.logger);
    const secured = await startTestApp(await cluster.createDatabase(), { ASYNCPROC_JWT_SECRET: 'x'.repeat(40) }, log.logger);
    try {
      for (const host of ['devbox.internal', `other.example:${new URL(listed.url).port}`]) assert.equal((await postAs(listed.url, host, '{ changeCursor }')).status, 200, host);
      assert.equal((await postAs(listed.url, 'evil.example', '{ changeCursor }')).status, 403, 'a name not listed');
      // with authentication on, a rebound page has no credentials of the user's to send: any name is served
      const anonymous = await postAs(secured.url, 'evil.example', '{ changeCursor }');
      assert.equal(anonymous.body.errors?.[0]?.extensions?.code, 'UNAUTHENTICATED', JSON.stringify(anonymous.body));
    } finally {
      await listed.stop();
      await secured.stop();
    }
  });
});

describe('subscriptions per graphql-ws connection', () => {
  it('beyond ASYNCPROC_MAX_SUBSCRIPTIONS_PER_CONNECTION a subscribe gets TOO_MANY_SUBSCRIPTIONS; the socket stays up', async () => {
    const client = t.ws();
    const open = Array.from({ length: 3 }, () => client.iterate({ query: 'subscription { executionEvents { cursor } }' }));
    // a subscription is registered when its first pull sends `subscribe`
    const pulls = open.map((iterator) => iterator.next());
    await new Promise((resolve) => setTimeout(resolve, 300));
    let dispose = () => {};
    const refused = await within(
      new Promise<any>((resolve) => {
        dispose = client.subscribe({ query: 'subscription { executionEvents { cursor } }' }, { next: (r) => resolve(r.errors), error: resolve, complete: () => resolve('completed') });
      }),
      3000,
    ).finally(() => dispose());
    assert.ok(Array.isArray(refused), JSON.stringify(refused));
    assert.equal(refused[0].extensions?.code, 'TOO_MANY_SUBSCRIPTIONS');
    await open[0].return?.();
    void pulls;
    await new Promise((resolve) => setTimeout(resolve, 100));
    const [again] = await collect(client.iterate({ query: '{ changeCursor }' }), 1);
    assert.ok(again.data?.changeCursor, JSON.stringify(again));
    for (const iterator of open.slice(1)) await iterator.return?.();
  });

  it('an id completed and subscribed again while its first operation is still being set up closes the socket 4409, and leaves no stream behind', async () => {
    const hubSize = t.app.hub!.size;
    const socket = new WebSocket(t.url.replace(/^http/, 'ws'), 'graphql-transport-ws');
    const closed = new Promise<number>((resolve) => socket.on('close', (code) => resolve(code)));
    await new Promise<void>((resolve) => {
      socket.on('open', () => socket.send(JSON.stringify({ type: 'connection_init', payload: {} })));
      socket.on('message', (data) => JSON.parse(String(data)).type === 'connection_ack' && resolve());
    });
    const subscribe = { id: 'x', type: 'subscribe', payload: { query: 'subscription { executionEvents { cursor } }' } };
    // all in one go: every later message arrives while the first subscribe is being set up
    for (let i = 0; i < 20; i++) {
      socket.send(JSON.stringify(subscribe));
      socket.send(JSON.stringify({ id: 'x', type: 'complete' }));
    }
    socket.send(JSON.stringify(subscribe));
    assert.equal(await within(closed, 5000), 4409);
    // what was set up for the socket is let go with it (before: streams held by no one, streaming for good)
    // (at most as many as before: an earlier test's subscriptions may end meanwhile)
    await waitFor(async () => t.app.hub!.size <= hubSize, 5000, `the hub back to ${hubSize} (it holds ${t.app.hub!.size})`);
  });
});

describe('SSE subscribers that hang up at once', () => {
  it('leave nothing watched in the hub, also when they go during the first read', async () => {
    // a call that will not end for a long time, and a batch like it: whatever watches them stays until let go
    const { body } = await t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { token } } }`, {
      i: { procedure: 'demo.noop', runAt: new Date(Date.now() + 86_400_000).toISOString() },
    });
    const token = body.data.invoke.execution.token;
    const batch = await t.gql(`mutation($s: [[InvokeInput!]!]!) { submitBatch(input: { stages: $s }) { batch { id } } }`, {
      s: [[{ procedure: 'demo.noop', runAt: new Date(Date.now() + 86_400_000).toISOString() }]],
    });
    const batchId = batch.body.data.submitBatch.batch.id;
    const hubSize = t.app.hub!.size;
    const queries = [
      { query: 'subscription($t: ID!) { executionCompleted(token: $t) { status } }', variables: { t: token } },
      { query: 'subscription($b: ID!) { batchCompleted(id: $b) { status } }', variables: { b: batchId } },
    ];
    const url = new URL(t.url);
    /** An SSE request written whole, then its socket destroyed `afterMs` later: while the subscription makes its first read. */
    const hangUp = (body: string, afterMs: number) =>
      new Promise<void>((resolve) => {
        const request = httpRequest({
          host: url.hostname, port: url.port, path: url.pathname, method: 'POST', agent: false,
          headers: { 'content-type': 'application/json', accept: 'text/event-stream', 'content-length': Buffer.byteLength(body) },
        });
        request.on('error', () => undefined);
        request.once('finish', () => setTimeout(() => (request.destroy(), resolve()), afterMs));
        request.end(body);
      });
    for (let i = 0; i < 300; i += 20) {
      await Promise.all(Array.from({ length: 20 }, (_, j) => hangUp(JSON.stringify(queries[j % 2]), (i + j) % 4)));
    }
    await waitFor(async () => t.app.hub!.size <= hubSize, 10_000, `the hub back to ${hubSize} (it holds ${t.app.hub!.size})`);
  });
});

describe('odd input is bad input: a code, nothing changed, no stack in the log', () => {
  const invoke = (input: Record<string, unknown>) => t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { token } } }`, { i: input });
  const deep = (n: number) => '{"a":'.repeat(n) + '1' + '}'.repeat(n);
  const cases: [string, () => Promise<{ status: number; body: any }>][] = [
    ['NUL in an argument value', () => invoke({ procedure: 'demo.record', arguments: { tag: 'a\u0000b' } })],
    ['NUL in an argument key', () => invoke({ procedure: 'demo.record', arguments: { 'tag\u0000': 'x' } })],
    ['NUL nested in an argument', () => invoke({ procedure: 'demo.record', arguments: { tag: { x: [{ y: '\u0000' }] } } })],
    ['NUL in the procedure', () => invoke({ procedure: 'demo.record\u0000', arguments: { tag: 'x' } })],
    ['NUL in the queue', () => invoke({ procedure: 'demo.record', arguments: { tag: 'x' }, queue: 'default\u0000' })],
    ['NUL in a filter', () => t.gql(`query($f: ExecutionFilter) { executions(filter: $f) { totalCount } }`, { f: { procedure: 'demo\u0000' } })],
    ['NUL in a string literal', () => t.gql(`{ executions(filter: { queue: "a\\u0000" }) { totalCount } }`)],
    ['NUL in a queue name', () => t.gql(`mutation($i: ConfigureQueueInput!) { configureQueue(input: $i) { queue { name } } }`, { i: { name: 'q\u0000', concurrency: 1 } })],
    ['a lone surrogate in variables', () => invoke({ procedure: 'demo.record', arguments: { tag: 'a\ud800b' } })],
    ['a lone low surrogate in a filter', () => t.gql(`query($f: ExecutionFilter) { executions(filter: $f) { totalCount } }`, { f: { queue: '\udc00' } })],
    ['runAt in year 0000', () => invoke({ procedure: 'demo.record', arguments: { tag: 'x' }, runAt: '0000-01-01T00:00:00Z' })],
    ['runAt before 1970', () => invoke({ procedure: 'demo.record', arguments: { tag: 'x' }, runAt: '1900-01-01T00:00:00Z' })],
    ['a page cursor past the bigint range', () => t.gql(`{ executions(after: "9999999999999999999") { totalCount } }`)],
    ['a before cursor past the bigint range', () => t.gql(`{ executions(before: "9223372036854775808") { totalCount } }`)],
    [
      'arguments nested 20,000 deep',
      async () => {
        const query = 'mutation($i: InvokeInput!) { invoke(input: $i) { execution { token } } }';
        const body = `{"query":${JSON.stringify(query)},"variables":{"i":{"procedure":"demo.record","arguments":{"tag":${deep(20_000)}}}}}`;
        const response = await fetch(t.url, { method: 'POST', headers: { 'content-type': 'application/json' }, body });
        return { status: response.status, body: await response.json() };
      },
    ],
  ];

  it('a document is checked again until it passes: the same bad literal twice is refused twice', async () => {
    for (let i = 0; i < 2; i++) {
      const { body } = await t.gql(`{ executions(filter: { queue: "b\\u0000" }) { totalCount } }`);
      assert.equal(body.errors?.[0]?.extensions?.code, 'BAD_USER_INPUT', JSON.stringify(body));
    }
  });

  for (const [name, run] of cases) {
    it(name, async () => {
      const before = await total();
      const queues = (await t.gql('{ queues { name } }')).body.data.queues.length;
      const logged = log.lines.length;
      const { status, body } = await run();
      assert.ok(status < 500, `HTTP ${status}`);
      assert.ok(['BAD_USER_INPUT', 'INVALID_ARGUMENTS'].includes(body.errors?.[0]?.extensions?.code), JSON.stringify(body));
      assert.equal(await total(), before, 'nothing enqueued');
      assert.equal((await t.gql('{ queues { name } }')).body.data.queues.length, queues, 'no queue created');
      const problems = log.lines.slice(logged).filter((line) => line.level >= 50 || line.msg === 'unexpected error (masked)' || JSON.stringify(line).includes('stack'));
      assert.deepEqual(problems, []);
    });
  }

  it('over graphql-ws too', async () => {
    const [result] = await collect(t.ws().iterate({ query: 'subscription($f: ExecutionFilter) { executionEvents(filter: $f) { cursor } }', variables: { f: { procedure: 'x\u0000' } } }), 1).catch((errors) => [{ errors }]);
    assert.equal(result.errors?.[0]?.extensions?.code, 'BAD_USER_INPUT', JSON.stringify(result));
  });

  it('a runAt within range still delays the call', async () => {
    const runAt = new Date(Date.now() + 60_000).toISOString();
    const { body } = await t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { status runAt } } }`, { i: { procedure: 'demo.noop', runAt } });
    assert.deepEqual(body.data.invoke.execution, { status: 'WAITING', runAt });
  });
});

describe('production defaults', () => {
  let closed: RunningServer;
  let open: RunningServer;
  let base: Parameters<typeof startServer>[0];
  const post = async (server: RunningServer, query: string, variables?: unknown) => {
    const response = await fetch(server.url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ query, variables }) });
    return { status: response.status, text: await response.text() };
  };
  before(async () => {
    // the defaults follow authRequired; the requests themselves need no credentials here
    const auth = new Authenticator({ mode: 'none', jwt: null }, t.app.engine, log.logger);
    base = { engine: t.app.engine, hub: t.app.hub!, logger: log.logger, limits: { maxCalls: 10, maxArgumentBytes: 1000 }, port: 0, host: '127.0.0.1', auth };
    closed = await startServer({ ...base, authRequired: true });
    open = await startServer({ ...base, authRequired: true, introspection: true, suggestions: true, graphiql: true, corsOrigins: ['https://app.example.com'] });
  });
  after(async () => {
    await closed?.close();
    await open?.close();
  });

  it('with auth required: no introspection, no field suggestions, no GraphiQL, no CORS', async () => {
    const introspection = JSON.parse((await post(closed, '{ __schema { types { name } } }')).text);
    assert.match(introspection.errors[0].message, /introspection/i);
    assert.equal(introspection.data, undefined);
    const typo = JSON.parse((await post(closed, '{ executionz { totalCount } }')).text);
    assert.doesNotMatch(typo.errors[0].message, /Did you mean/);
    const variable = JSON.parse((await post(closed, 'query($f: ExecutionFilter) { executions(filter: $f) { totalCount } }', { f: { procedur: 'x' } })).text);
    assert.ok(variable.errors[0].message.includes('procedur'));
    assert.doesNotMatch(variable.errors[0].message, /Did you mean/);
    const page = await fetch(closed.url, { headers: { accept: 'text/html' } });
    assert.doesNotMatch(await page.text(), /graphiql/i);
    const preflight = await fetch(closed.url, {
      method: 'OPTIONS',
      headers: { origin: 'https://evil.example', 'access-control-request-method': 'POST', 'access-control-request-headers': 'content-type' },
    });
    assert.equal(preflight.headers.get('access-control-allow-origin'), null);
  });

  it('each can be turned on; CORS admits the configured origins only', async () => {
    assert.equal(JSON.parse((await post(open, '{ __schema { queryType { name } } }')).text).data.__schema.queryType.name, 'Query');
    assert.match(JSON.parse((await post(open, '{ executionz { totalCount } }')).text).errors[0].message, /Did you mean "execution" or "executions"\?/);
    const page = await (await fetch(open.url, { headers: { accept: 'text/html' } })).text();
    assert.match(page, /graphiql/i);
    // with authentication on, its subscriptions go over SSE (the typed headers ride on the request) and it keeps no header
    assert.match(page, /"subscriptionsProtocol":"SSE"/);
    assert.match(page, /"shouldPersistHeaders":false/);
    const preflight = (origin: string) =>
      fetch(open.url, { method: 'OPTIONS', headers: { origin, 'access-control-request-method': 'POST', 'access-control-request-headers': 'content-type' } });
    assert.equal((await preflight('https://app.example.com')).headers.get('access-control-allow-origin'), 'https://app.example.com');
    assert.notEqual((await preflight('https://evil.example')).headers.get('access-control-allow-origin'), 'https://evil.example');
  });

  it('with several origins listed, an unlisted one (and the opaque origin "null") gets no CORS headers at all; a listed one gets its own, with credentials', async () => {
    const several = await startServer({ ...base, authRequired: true, corsOrigins: ['https://app.example.com', 'https://admin.example.com'] });
    try {
      const preflight = (origin: string) =>
        fetch(several.url, { method: 'OPTIONS', headers: { origin, 'access-control-request-method': 'POST', 'access-control-request-headers': 'content-type, authorization' } });
      for (const origin of ['null', 'https://evil.example']) {
        const answer = await preflight(origin);
        assert.equal(answer.headers.get('access-control-allow-origin'), null, origin);
        assert.equal(answer.headers.get('access-control-allow-credentials'), null, origin);
      }
      const admin = await preflight('https://admin.example.com');
      assert.equal(admin.headers.get('access-control-allow-origin'), 'https://admin.example.com');
      assert.equal(admin.headers.get('access-control-allow-credentials'), 'true');
    } finally {
      await several.close();
    }
  });

  it('a page of an unlisted origin cannot open a socket even with credentials on its upgrade (a proxy that turns a cookie into Authorization); a listed one can', async () => {
    const cookieProxy = { authorization: `ApiKey apk_${'x'.repeat(43)}` };
    const refused = await new Promise<number | undefined>((resolve) => {
      const socket = new WebSocket(open.url.replace(/^http/, 'ws'), 'graphql-transport-ws', { headers: { origin: 'https://sibling.example.com', ...cookieProxy } });
      socket.on('unexpected-response', (_req, res) => (resolve(res.statusCode), socket.terminate()));
      socket.on('error', () => undefined);
      socket.on('open', () => (resolve(undefined), socket.close()));
    });
    assert.equal(refused, 403);
    const listed = await new Promise<boolean>((resolve) => {
      const socket = new WebSocket(open.url.replace(/^http/, 'ws'), 'graphql-transport-ws', { headers: { origin: 'https://app.example.com' } });
      socket.on('unexpected-response', () => (resolve(false), socket.terminate()));
      socket.on('error', () => undefined);
      socket.on('open', () => (resolve(true), socket.close()));
    });
    assert.equal(listed, true, 'the upgrade of a listed origin is accepted (its credentials are checked at connection_init)');
  });

  it('in development mode too, an unexpected error carries no stack or SQL text; the log keeps it', async () => {
    const previous = process.env.NODE_ENV;
    process.env.NODE_ENV = 'development';
    const url = await cluster.createDatabase();
    const app = await startTestApp(url, { ASYNCPROC_ACTIVATOR: 'false' }, log.logger);
    const db = await cluster.connect(url);
    try {
      await db.query('alter table asyncproc.queues rename to queues_gone');
      const logged = log.lines.length;
      const { body } = await app.gql('{ queues { name } }');
      const text = JSON.stringify(body);
      assert.equal(body.errors![0].message, 'Unexpected error.');
      assert.doesNotMatch(text, /originalError|stack|queues_gone|asyncproc\.queues|select/i);
      assert.ok(log.lines.slice(logged).some((line) => line.msg === 'unexpected error (masked)' && JSON.stringify(line.err).includes('asyncproc.queues')));
    } finally {
      process.env.NODE_ENV = previous;
      await db.query('alter table asyncproc.queues_gone rename to queues').catch(() => undefined);
      await app.stop();
      await db.end();
    }
  });
});

describe('a hostile HTTP peer (a probe with the code open)', () => {
  it('a GET whose variables or extensions is not JSON gets 400 BAD_REQUEST, not a 500 and a stack in the log; also before credentials are checked', async () => {
    const secured = await startTestApp(await cluster.createDatabase(), { ASYNCPROC_JWT_SECRET: 'x'.repeat(40) }, log.logger);
    try {
      for (const [app, headers] of [[t, { 'x-asyncproc-csrf': '1' }], [secured, { authorization: 'Bearer not-a-token' }]] as const) {
        for (const name of ['variables', 'extensions']) {
          const before = log.lines.filter((l) => /unexpected/.test(l.msg)).length;
          const response = await fetch(`${app.url}?query=${encodeURIComponent('{ __typename }')}&${name}=%7Bbad`, { headers });
          assert.equal(response.status, 400, name);
          assert.equal((await response.json()).errors[0].extensions.code, 'BAD_REQUEST');
          assert.equal(log.lines.filter((l) => /unexpected/.test(l.msg)).length, before, 'nothing unexpected logged');
        }
      }
    } finally {
      await secured.stop();
    }
  });

  it('a subscription over HTTP that does not accept a stream is refused before it subscribes: nothing stays in the hub', async () => {
    const { body } = await t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { token } } }`, {
      i: { procedure: 'demo.noop', runAt: new Date(Date.now() + 86_400_000).toISOString() },
    });
    const size = t.app.hub!.size;
    // the last three name the stream in a form yoga does not serve (another charset, another type): they were made, then answered 406 with no body
    const accepts = ['application/json', 'application/graphql-response+json', 'text/html', 'text/event-stream; charset=latin1', 'x-text/event-stream', 'multipart/mixed, text/event-stream;charset=iso-8859-1'];
    for (const accept of accepts) {
      for (const query of ['subscription { executionEvents { cursor } }', `subscription { executionCompleted(token: "${body.data.invoke.execution.token}") { status } }`]) {
        const response = await fetch(t.url, { method: 'POST', headers: { 'content-type': 'application/json', accept }, body: JSON.stringify({ query }) });
        assert.equal(response.status, 406, `${accept}: ${query}`);
        // a body only in a type the request accepts (406: none of them is JSON, for the others)
        const text = await response.text();
        if (/json/.test(accept)) assert.equal(JSON.parse(text).errors?.[0]?.extensions?.code, 'BAD_REQUEST', `${accept}: ${query}`);
      }
    }
    await new Promise((resolve) => setTimeout(resolve, 200));
    assert.equal(t.app.hub!.size, size, 'no subscription was left behind');
  });

  it('pages asked for by variables or left to their default count as literal ones do (nodes): a nesting of executions and batches is refused, with its variables', async () => {
    const nested = (first: string) => {
      const list = first ? `executions(${first})` : 'executions';
      // four levels: the probe's shape (a page of 20 left to its default is 20^4 items at the bottom)
      return `${first.includes('$n') ? 'query($n: Int)' : 'query'} { ${list} { nodes { batch { ${list} { nodes { batch { ${list} { nodes { batch { ${list} { nodes { token } } } } } } } } } } } }`;
    };
    for (const [query, variables] of [[nested('first: $n'), { n: 30 }], [nested(''), {}], [nested('first: 30'), {}]] as const) {
      const { status, body } = await t.gql(query, variables);
      assert.equal(status, 400, JSON.stringify(body).slice(0, 300));
      assert.ok(body.errors?.some((e: any) => e.extensions?.code === 'QUERY_TOO_COMPLEX'), JSON.stringify(body).slice(0, 300));
    }
    // over graphql-ws too
    const errors = await within(
      new Promise<any>((resolve) => {
        t.ws().subscribe({ query: nested('first: $n'), variables: { n: 30 } }, { next: (r: any) => resolve(r.errors), error: resolve, complete: () => resolve('completed') });
      }),
    );
    assert.ok(Array.isArray(errors) && errors.some((e: any) => e.extensions?.code === 'QUERY_TOO_COMPLEX' && e.extensions.limit === 'nodes'), JSON.stringify(errors));
    // a large page alone is fine
    const { status, body } = await t.gql(`query($n: Int) { executions(first: $n) { nodes { token } } }`, { n: 500 });
    assert.equal(status, 200, JSON.stringify(body.errors));
  });

  it('a bare word inside a JSON literal is refused, not dropped (the call was refused for a missing argument instead)', async () => {
    const before = await total();
    const { body } = await t.gql('mutation { invoke(input: { procedure: "demo.record", arguments: { tag: FOO } }) { execution { token } } }');
    assert.equal(body.errors?.[0]?.extensions?.code, 'GRAPHQL_VALIDATION_FAILED', JSON.stringify(body));
    assert.match(body.errors[0].message, /bare word/);
    assert.equal(await total(), before, 'nothing enqueued');
  });

  it('a body that is not JSON gets 400, and its answer does not quote the body back', async () => {
    const response = await fetch(t.url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: `{"query": "${'A'.repeat(60_000)}", oops` });
    const text = await response.text();
    assert.equal(response.status, 400);
    assert.equal(JSON.parse(text).errors[0].extensions.code, 'BAD_REQUEST');
    assert.ok(text.length < 1000, `${text.length} characters answered`);
  });

  it('estimateNodes counts each page as asked (a literal, a variable, the default when left out, the larger of first and last), times the pages around it, through fragments', async () => {
    const { buildSchema, parse } = await import('graphql');
    const { readFile } = await import('node:fs/promises');
    const { estimateNodes } = await import('../src/edge/httpOperations.js');
    const schema = buildSchema(await readFile(new URL('../schema/schema.graphql', import.meta.url), 'utf8'));
    const nodes = (query: string, variables: Record<string, unknown> = {}) => estimateNodes(schema, parse(query), null, variables);
    assert.equal(nodes('{ executions(first: 5) { nodes { token } } }'), 5);
    assert.equal(nodes('{ executions(first: 5, last: 3) { nodes { token } } }'), 5);
    assert.equal(nodes('{ executions(last: 7) { nodes { token } } }'), 7);
    assert.equal(nodes('{ executions { nodes { token } } }'), 20);
    assert.equal(nodes('query($n: Int) { executions(first: $n) { nodes { token } } }', { n: 40 }), 40);
    assert.equal(nodes('query($n: Int) { executions(first: $n) { nodes { token } } }'), 20, 'a variable not given: the default');
    assert.equal(nodes('{ executions(first: 10) { nodes { batch { executions(first: 3) { nodes { token } } } } } }'), 10 + 30);
    assert.equal(nodes('{ executions(first: 10) { ...page } } fragment page on ExecutionConnection { nodes { batch { executions(first: 3) { nodes { token } } } } }'), 40);
    assert.equal(nodes('{ procedures { name } }'), 0, 'a list that does not page counts nothing');
  });

  it('SSE subscriptions per caller are limited (ASYNCPROC_MAX_SSE_STREAMS_PER_CALLER), and a closed one gives its place back', async () => {
    const { SignJWT } = await import('jose');
    const secret = 'y'.repeat(40);
    const limited = await startTestApp(await cluster.createDatabase(), { ASYNCPROC_JWT_SECRET: secret, ASYNCPROC_MAX_SSE_STREAMS_PER_CALLER: '3' }, log.logger);
    const jwt = await new SignJWT({ roles: [] }).setProtectedHeader({ alg: 'HS256' }).setSubject('sse-caller').setExpirationTime('10m').sign(new TextEncoder().encode(secret));
    const headers = { 'content-type': 'application/json', accept: 'text/event-stream', authorization: `Bearer ${jwt}` };
    const body = JSON.stringify({ query: 'subscription { executionEvents { cursor } }' });
    const open = () => {
      const controller = new AbortController();
      return { controller, response: fetch(limited.url, { method: 'POST', headers, body, signal: controller.signal }) };
    };
    try {
      const streams = [open(), open(), open()];
      for (const s of streams) assert.equal((await s.response).status, 200);
      const fourth = await open().response;
      // refused, it ends at once; let through, it would stream for ever
      const text = await within(fourth.text(), 5_000);
      assert.ok(fourth.status === 429 || /TOO_MANY_SUBSCRIPTIONS/.test(text), `${fourth.status} ${text}`);
      assert.match(text, /TOO_MANY_SUBSCRIPTIONS/);
      streams[0].controller.abort();
      await waitFor(async () => {
        const again = open();
        const response = await again.response;
        const ok = response.status === 200 && !/TOO_MANY_SUBSCRIPTIONS/.test(await Promise.race([response.text(), new Promise<string>((r) => setTimeout(() => r(''), 300))]));
        again.controller.abort();
        return ok;
      }, 10_000, 'a place to come free');
      for (const s of streams) s.controller.abort();
    } finally {
      await limited.stop();
    }
  });

  it('an SSE request its client leaves while the subscription is being set up gives its place back and leaves no stream behind, signed in or not', async () => {
    const { SignJWT } = await import('jose');
    const secret = 'z'.repeat(40);
    const limited = await startTestApp(await cluster.createDatabase(), { ASYNCPROC_JWT_SECRET: secret, ASYNCPROC_MAX_SSE_STREAMS_PER_CALLER: '3' }, log.logger);
    const open = await startTestApp(await cluster.createDatabase(), {}, log.logger);
    const jwt = await new SignJWT({ roles: [] }).setProtectedHeader({ alg: 'HS256' }).setSubject('leaving-caller').setExpirationTime('10m').sign(new TextEncoder().encode(secret));
    const signedIn = { 'content-type': 'application/json', accept: 'text/event-stream', authorization: `Bearer ${jwt}` };
    /** A tab that navigates away: each request left 0–12 ms after it was sent, while its stream is being made. */
    const leave = async (app: TestApp, headers: Record<string, string>) => {
      const hub = app.app.hub!;
      const before = hub.size;
      for (let round = 0; round < 12; round++) {
        await Promise.all(
          Array.from({ length: 8 }, async () => {
            const controller = new AbortController();
            const body = JSON.stringify({ query: 'subscription { executionEvents(filter: { procedure: "demo.none" }) { cursor } }' });
            const response = fetch(app.url, { method: 'POST', headers, body, signal: controller.signal }).catch(() => null);
            setTimeout(() => controller.abort(), (round % 7) * 2);
            await response;
          }),
        );
      }
      await waitFor(async () => hub.size === before, 10_000, 'the hub to let every left stream go').catch((error: Error) => {
        throw new Error(`${error.message}: ${hub.size - before} streams stayed`);
      });
    };
    try {
      await leave(open, { 'content-type': 'application/json', accept: 'text/event-stream' });
      await leave(limited, signedIn);
      // the caller's three places are all free again
      const streams = Array.from({ length: 3 }, () => {
        const controller = new AbortController();
        const body = JSON.stringify({ query: 'subscription { executionEvents { cursor } }' });
        return { controller, response: fetch(limited.url, { method: 'POST', headers: signedIn, body, signal: controller.signal }) };
      });
      for (const s of streams) {
        const response = await s.response;
        const first = await Promise.race([response.body!.getReader().read().then((r) => new TextDecoder().decode(r.value)), new Promise<string>((r) => setTimeout(() => r(''), 500))]);
        assert.ok(response.status === 200 && !/TOO_MANY_SUBSCRIPTIONS/.test(first), `${response.status} ${first}`);
      }
      for (const s of streams) s.controller.abort();
    } finally {
      await limited.stop();
      await open.stop();
    }
  });
});
