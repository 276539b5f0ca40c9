/**
 * What a browser app relies on: docs/spa.md's code, bundled with graphql-ws and graphql-sse and
 * run in headless Chromium from another origin (CORS as a deployer configures it), signed in with
 * a JWT, following a call to its outcome across a dropped connection; and the Relay `Node`
 * contract normalised caches key objects by, with the visibility rules of execution(token).
 */
import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { fileURLToPath } from 'node:url';
import { after, before, describe, it } from 'node:test';
import { build } from 'esbuild';
import { SignJWT } from 'jose';
import type pg from 'pg';
import type { Browser, Page } from 'playwright-core';
import { collect, startTestApp, type TestApp } from './support/app.js';
import { launchChromium } from './support/browser.js';
import { startTestCluster, waitFor, type TestCluster } from './support/database.js';
import { startProxy, type Proxy } from './support/proxy.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const SECRET = 'a-test-secret-of-at-least-thirty-two-characters';
/** The placeholder URL in docs/spa.md, replaced by the service's (through the proxy that drops connections). */
const DOC_URL = "'https://jobs.example.com/graphql'";
/** spa.gate() runs until the test lets go of this advisory lock: a call held RUNNING for as long as needed. */
const GATE = 4242;

const jwt = (sub: string, roles: string[] = []) =>
  new SignJWT({ roles }).setProtectedHeader({ alg: 'HS256' }).setSubject(sub).setExpirationTime('10m').sign(new TextEncoder().encode(SECRET));

let cluster: TestCluster;
let databaseUrl: string;
let t: TestApp;
let sql: pg.Client;
let proxy: Proxy;
let site: Server;
let siteOrigin: string;
let browser: Browser;
const tokens: Record<'alice' | 'bob' | 'admin', string> = { alice: '', bob: '', admin: '' };
const as = (who: keyof typeof tokens) => ({ authorization: `Bearer ${tokens[who]}` });

/** docs/spa.md's `js` blocks, one module, for the service at `url`. */
async function docModule(url: string): Promise<string> {
  const doc = await readFile(new URL('../docs/spa.md', import.meta.url), 'utf8');
  const code = [...doc.matchAll(/^```js\n([\s\S]*?)^```$/gm)].map((m) => m[1]).join('\n');
  assert.ok(code.includes(DOC_URL), `docs/spa.md names the service as ${DOC_URL}`);
  return code.replace(DOC_URL, JSON.stringify(url));
}

before(async () => {
  cluster = await startTestCluster();
  databaseUrl = await cluster.createDatabase();
  // the app's own origin, as a real deployment has: its HTML and its bundle, nothing from a CDN
  let bundle = '';
  site = createServer((req, res) => {
    if (req.url === '/spa.js') return void res.writeHead(200, { 'content-type': 'text/javascript' }).end(bundle);
    res.writeHead(200, { 'content-type': 'text/html' }).end(`<!doctype html><meta charset="utf-8"><title>spa</title>
<script type="module">import * as spa from '/spa.js'; window.spa = spa;</script>`);
  });
  await new Promise<void>((resolve) => site.listen(0, '127.0.0.1', resolve));
  siteOrigin = `http://127.0.0.1:${(site.address() as AddressInfo).port}`;
  t = await startTestApp(databaseUrl, { ASYNCPROC_JWT_SECRET: SECRET, ASYNCPROC_CORS_ORIGINS: siteOrigin, ASYNCPROC_RATE_LIMIT: '1000' });
  proxy = await startProxy(t.app.server!.port);
  const built = await build({
    stdin: { contents: await docModule(t.url.replace(`:${t.app.server!.port}/`, `:${proxy.port}/`)), resolveDir: ROOT, loader: 'js' },
    bundle: true,
    format: 'esm',
    platform: 'browser',
    target: 'es2022',
    write: false,
    logLevel: 'silent',
  });
  bundle = built.outputFiles[0].text;
  sql = await cluster.connect(databaseUrl);
  await sql.query(`create schema spa;
    create procedure spa.gate() language plpgsql as $$ begin perform pg_advisory_xact_lock(${GATE}); end $$;
    select asyncproc.register('spa.gate');`);
  for (const [who, roles] of [['alice'], ['bob'], ['admin', ['admin']]] as const) tokens[who] = await jwt(who, roles ? [...roles] : []);
  browser = await launchChromium();
});
after(async () => {
  await browser?.close();
  await sql?.end();
  await proxy?.close();
  await t?.stop();
  await new Promise((resolve) => site?.close(resolve));
  await cluster?.stop();
});

/** Query as a caller, directly (not through the proxy); fails on errors. */
async function gql(who: keyof typeof tokens, query: string, variables: Record<string, unknown> = {}) {
  const { body } = await t.gql(query, variables, as(who));
  assert.equal(body.errors, undefined, JSON.stringify(body.errors));
  return body.data;
}

const globalId = (typename: string, id: string) => Buffer.from(`${typename}:${id}`).toString('base64url');

interface AppPage {
  page: Page;
  /** console lines of the page. */
  logs: string[];
  /** WebSockets the page opened. */
  sockets: string[];
  /** SSE requests the page made (POST, Accept: text/event-stream). */
  streams: string[];
}

/** The app in a fresh profile, signed in as alice; anything but the app's origin and the service is refused, as offline. */
async function openApp(): Promise<AppPage> {
  const context = await browser.newContext();
  const allowed = [siteOrigin, `http://127.0.0.1:${proxy.port}`];
  await context.route('**/*', (route) => (allowed.includes(new URL(route.request().url()).origin) ? route.continue() : route.abort('internetdisconnected')));
  await context.addInitScript(`window.getToken = () => ${JSON.stringify(tokens.alice)};`);
  const page = await context.newPage();
  const opened: AppPage = { page, logs: [], sockets: [], streams: [] };
  page.on('console', (message) => opened.logs.push(message.text()));
  page.on('pageerror', (error) => opened.logs.push(`pageerror: ${error.message}`));
  page.on('websocket', (socket) => opened.sockets.push(socket.url()));
  page.on('request', (request) => void (request.headers().accept?.includes('text/event-stream') && opened.streams.push(request.url())));
  await page.goto(siteOrigin);
  return opened;
}

describe("docs/spa.md's code in Chromium, from another origin", () => {
  it("signs in with a JWT, invokes, and prints the outcome (the doc's example)", async () => {
    const { page, logs } = await openApp();
    const line = await waitFor(async () => logs.find((l) => l.startsWith('SUCCEEDED') || l.startsWith('pageerror')), 60_000, 'the example to print');
    assert.equal(line, 'SUCCEEDED {"total":42}', logs.join('\n'));
    await page.context().close();
  });

  for (const transport of ['ws', 'sse'] as const) {
    it(`over ${transport === 'ws' ? 'graphql-ws' : 'SSE'}: a call that ends while the connection is down is heard after it comes back, events resume after the last one seen`, async () => {
      const app = await openApp();
      const { page } = app;
      await page.waitForFunction(() => 'spa' in window);
      const socketsBefore = app.sockets.length;
      const gate = await cluster.connect(databaseUrl);
      try {
        await page.evaluate(async (transport) => {
          const w = window as any;
          w.events = [];
          w.ended = null;
          await w.spa.watch({ procedure: 'spa.gate' }, (execution: unknown) => w.events.push(execution), w.spa[transport]);
        }, transport);
        const invoke = () => page.evaluate(() => (window as any).spa.invoke('spa.gate', {}) as Promise<{ id: string; token: string }>);
        const heard = ({ token }: { token: string }, status: string) =>
          page.evaluate(([token, status]) => (window as any).events.filter((e: any) => e.token === token && e.status === status).length, [token, status]);
        // one call seen to its end before the drop: a resume from an older cursor would deliver it again
        const earlier = await invoke();
        await waitFor(async () => (await heard(earlier, 'SUCCEEDED')) > 0, 30_000, 'the page to hear the first call end');
        await gate.query('select pg_advisory_lock($1)', [GATE]);
        const submitted = await invoke();
        await page.evaluate(
          ([token, transport]) => {
            const w = window as any;
            w.spa.outcome(token, w.spa[transport]).then(
              (execution: unknown) => (w.ended = execution),
              (error: unknown) => (w.ended = { error: String(error) }),
            );
          },
          [submitted.token, transport],
        );
        await waitFor(async () => (await heard(submitted, 'RUNNING')) > 0, 30_000, 'the page to hear the call RUNNING');

        proxy.cut();
        await gate.query('select pg_advisory_unlock($1)', [GATE]);
        await waitFor(async () => (await gql('alice', `query($t: ID!) { execution(token: $t) { status } }`, { t: submitted.token })).execution.status === 'SUCCEEDED', 30_000, 'the call to end');
        assert.equal(await page.evaluate(() => (window as any).ended), null, 'the page could not have heard it: the link is down');
        proxy.restore();

        const ended = await waitFor(() => page.evaluate(() => (window as any).ended), 60_000, 'the outcome after the reconnect');
        assert.equal(ended.status, 'SUCCEEDED', JSON.stringify(ended));
        assert.equal(ended.id, submitted.id, 'the same global id as the invoke answered');
        await waitFor(async () => (await heard(submitted, 'SUCCEEDED')) > 0, 30_000, 'the SUCCEEDED event after the reconnect');
        assert.equal(await heard(earlier, 'SUCCEEDED'), 1, 'resumed after the last event seen, not from the first cursor');
        assert.equal(await heard(submitted, 'RUNNING'), 1);
        if (transport === 'ws') assert.ok(app.sockets.length - socketsBefore >= 2, `the client reconnected: ${app.sockets.join(' ')}`);
        else {
          assert.equal(app.sockets.length, socketsBefore, 'no WebSocket over SSE');
          // the page's request events reach this process on their own, after what the page itself answered
          await waitFor(async () => app.streams.length >= 4 || null, 10_000, `two streams, each opened again after the cut (${app.streams.length} so far)`);
        }
        assert.deepEqual(app.logs.filter((l) => l.startsWith('pageerror')), []);
      } finally {
        await gate.end();
        await page.context().close();
      }
    });
  }
});

describe('Relay Node: one global id per object, read back with node(id), seen only by whom may see it', () => {
  const NODE = `query($id: ID!) { node(id: $id) { __typename id ... on Execution { token } ... on Batch { batchId } } }`;
  const invoke = async (who: keyof typeof tokens) =>
    (await gql(who, `mutation { invoke(input: { procedure: "demo.add", arguments: { a: 1, b: 2 } }) { execution { id token } } }`)).invoke.execution as { id: string; token: string };

  it('an execution: node(id) round trip; the same id from invoke, execution(token) and both subscriptions', async () => {
    const cursor = (await gql('alice', '{ changeCursor }')).changeCursor;
    const { id, token } = await invoke('alice');
    assert.equal(id, globalId('Execution', token), 'base64url: safe in a URL as it is');
    assert.deepEqual((await gql('alice', NODE, { id })).node, { __typename: 'Execution', id, token });
    assert.equal((await gql('alice', `query($t: ID!) { execution(token: $t) { id } }`, { t: token })).execution.id, id);
    assert.equal((await gql('alice', `query($t: ID!) { execution(token: $t) { token } }`, { t: id })).execution.token, token, 'execution(token:) takes the id too');
    const completed = await collect(t.ws({ Authorization: as('alice').authorization }).iterate({ query: `subscription { executionCompleted(token: "${token}") { id } }` }));
    assert.deepEqual(completed.map((r) => r.data), [{ executionCompleted: { id } }]);
    const [event] = await collect(
      t.sse(as('alice')).iterate({
        query: `subscription($after: String) { executionEvents(after: $after, filter: { status: [SUCCEEDED] }) { execution { id token } } }`,
        variables: { after: cursor },
      }),
      1,
    );
    assert.deepEqual((event.data as any).executionEvents.execution, { id, token }, 'an event carries the id a list query showed');
  });

  it("a batch: node(id) round trip; batch, cancelBatch and batchCompleted take the id or the batchId", async () => {
    const { batch } = (await gql('alice', `mutation { submitBatch(input: { stages: [[{ procedure: "demo.add", arguments: { a: 1, b: 1 } }]] }) { batch { id batchId } } }`)).submitBatch;
    assert.equal(batch.id, globalId('Batch', batch.batchId));
    assert.deepEqual((await gql('alice', NODE, { id: batch.id })).node, { __typename: 'Batch', ...batch });
    for (const given of [batch.id, batch.batchId]) {
      assert.deepEqual((await gql('alice', `query($id: ID!) { batch(id: $id) { id batchId } }`, { id: given })).batch, batch);
      const [ended] = await collect(t.ws({ Authorization: as('alice').authorization }).iterate({ query: `subscription($id: ID!) { batchCompleted(id: $id) { id } }`, variables: { id: given } }));
      assert.deepEqual(ended.data, { batchCompleted: { id: batch.id } });
    }
    const refused = await t.gql(`mutation($id: ID!) { cancelBatch(id: $id) { batch { id } } }`, { id: batch.id }, as('alice'));
    assert.equal(refused.body.errors?.[0].extensions.code, 'ALREADY_FINISHED', 'cancelBatch found it by its global id');
    const wrongType = await t.gql(`query($id: ID!) { batch(id: $id) { id } }`, { id: globalId('Execution', batch.batchId) }, as('alice'));
    assert.equal(wrongType.body.errors?.[0].extensions.code, 'BAD_USER_INPUT', "an Execution's id is not a batch id");
  });

  it("another caller's object, an unknown id and a malformed one answer null, without an error", async () => {
    const own = await invoke('alice');
    const theirs = await invoke('bob');
    const { batch } = (await gql('bob', `mutation { submitBatch(input: { stages: [[{ procedure: "demo.noop" }]] }) { batch { id } } }`)).submitBatch;
    const unknown = '00000000-0000-4000-8000-000000000000';
    const nulls = [
      theirs.id,
      batch.id,
      globalId('Execution', unknown),
      globalId('Batch', unknown),
      globalId('Batch', own.token), // a token is not a batch id
      globalId('Execution', 'not-a-uuid'),
      globalId('Procedure', own.token),
      own.token, // the raw token: node() takes global ids only
      'nope',
      '',
    ];
    for (const id of nulls) assert.equal((await gql('alice', NODE, { id })).node, null, `node(${JSON.stringify(id)})`);
    const { nodes } = await gql('alice', `query($ids: [ID!]!) { nodes(ids: $ids) { id } }`, { ids: [own.id, theirs.id, 'nope', own.id] });
    assert.deepEqual(nodes, [{ id: own.id }, null, null, { id: own.id }]);
    const tooMany = await t.gql(`query($ids: [ID!]!) { nodes(ids: $ids) { id } }`, { ids: Array(101).fill(own.id) }, as('alice'));
    assert.equal(tooMany.body.errors?.[0].extensions.code, 'BAD_USER_INPUT');
    assert.deepEqual((await gql('bob', NODE, { id: theirs.id })).node, { __typename: 'Execution', id: theirs.id, token: theirs.token }, 'its owner sees it');
    assert.equal((await gql('admin', NODE, { id: theirs.id })).node.id, theirs.id, 'an admin sees everything');
  });
});

describe('ExecutionFilter.schedule over GraphQL', () => {
  it("executions(filter: { schedule }) and executionEvents(filter: { schedule }) hold the schedule's calls only, replayed and live", async () => {
    const name = 'spa-every-second';
    const cursor = (await gql('admin', '{ changeCursor }')).changeCursor;
    const events: { token: string; schedule: string | null; status: string }[] = [];
    const stream = t.ws({ Authorization: as('admin').authorization }).iterate({
      query: `subscription($after: String, $name: String) { executionEvents(after: $after, filter: { schedule: $name }) { execution { token schedule status } } }`,
      variables: { after: cursor, name },
    });
    const reading = (async () => {
      for await (const result of stream) events.push((result.data as any).executionEvents.execution);
    })();
    const ended = (token: string) => waitFor(async () => events.find((e) => e.token === token && e.status === 'SUCCEEDED'), 30_000, `${token} to end`);
    await gql('admin', `mutation($name: String!) { createSchedule(input: { name: $name, procedure: "demo.record", arguments: { tag: "scheduled" }, cron: "* * * * * *" }) { schedule { name } } }`, { name });
    const first = await waitFor(async () => events.find((e) => e.status === 'SUCCEEDED'), 30_000, 'a fire to end');
    // a call of the same procedure submitted by a client, then a fire after it: the stream is live by now
    const manual = (await gql('admin', `mutation { invoke(input: { procedure: "demo.record", arguments: { tag: "by hand" } }) { execution { token } } }`)).invoke.execution.token;
    await waitFor(async () => (await gql('admin', `query($t: ID!) { execution(token: $t) { status } }`, { t: manual })).execution.status === 'SUCCEEDED');
    const seen = new Set(events.map((e) => e.token));
    const laterFire = await waitFor(async () => events.find((e) => !seen.has(e.token) && e.status === 'SUCCEEDED'), 30_000, 'a later fire to end');
    await ended(laterFire.token);
    await gql('admin', `mutation($name: String!) { pauseSchedule(name: $name) { schedule { name } } }`, { name });
    await stream.return?.();
    await reading;
    assert.ok(first.token !== laterFire.token);
    assert.deepEqual(events.filter((e) => e.token === manual || e.schedule !== name), [], "only the schedule's calls");

    const page = await gql('admin', `query($name: String!) { executions(first: 500, filter: { schedule: $name }) { totalCount nodes { token schedule } } }`, { name });
    const fired = await gql('admin', `query($name: String!) { schedule(name: $name) { executions { totalCount } } }`, { name });
    assert.ok(page.executions.totalCount >= 2);
    assert.equal(page.executions.totalCount, fired.schedule.executions.totalCount);
    assert.equal(page.executions.nodes.length, page.executions.totalCount);
    assert.ok(page.executions.nodes.every((e: { schedule: string }) => e.schedule === name));
    assert.ok(!page.executions.nodes.some((e: { token: string }) => e.token === manual));
    const manualRow = await gql('admin', `query($t: ID!) { execution(token: $t) { schedule } }`, { t: manual });
    assert.equal(manualRow.execution.schedule, null);
  });
});
