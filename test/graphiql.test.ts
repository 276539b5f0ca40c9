/** GraphiQL in a real headless Chromium that may talk to the service only: no CDN, queries, subscriptions over graphql-ws. */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import type { Browser, Page } from 'playwright-core';
import { Authenticator } from '../src/auth/authenticate.js';
import { GRAPHIQL_ASSETS_PATH } from '../src/graphiql.js';
import { silentLogger } from '../src/logger.js';
import { createYogaApp } from '../src/server.js';
import { startTestApp, type TestApp } from './support/app.js';
import { launchChromium } from './support/browser.js';
import { startTestCluster, waitFor, type TestCluster } from './support/database.js';

let cluster: TestCluster;
let t: TestApp;
let browser: Browser;
let origin: string;

before(async () => {
  cluster = await startTestCluster();
  t = await startTestApp(await cluster.createDatabase());
  origin = new URL(t.url).origin;
  browser = await launchChromium();
});
after(async () => {
  await browser?.close();
  await t?.stop();
  await cluster?.stop();
});

const QUERY_EDITOR = '.graphiql-query-editor .monaco-editor';

interface GraphiQLPage {
  page: Page;
  /** Every URL the page (and its workers) requested, WebSockets included. */
  requested: string[];
  /** Frames the page sent over WebSockets, parsed. */
  wsSent: { type: string; id?: string; payload?: any }[];
  errors: string[];
}

/** A fresh browser profile on GraphiQL; anything not addressed to the service is recorded and refused, as on an offline machine. */
async function openGraphiQL(): Promise<GraphiQLPage> {
  const context = await browser.newContext();
  const page = await context.newPage();
  const opened: GraphiQLPage = { page, requested: [], wsSent: [], errors: [] };
  page.on('request', (request) => opened.requested.push(request.url()));
  page.on('pageerror', (error) => opened.errors.push(error.message));
  page.on('websocket', (socket) => {
    opened.requested.push(socket.url());
    socket.on('framesent', (frame) => opened.wsSent.push(JSON.parse(String(frame.payload))));
  });
  let refused: (url: string) => void;
  const leftTheService = new Promise<never>((_, reject) => {
    refused = (url) => reject(new Error(`GraphiQL requested ${url}, which is not the service (refused, as offline)`));
  });
  leftTheService.catch(() => {}); // may reject during goto, before the race below awaits it
  await context.route('**/*', (route) => {
    if (new URL(route.request().url()).origin === origin) return route.continue();
    refused(route.request().url());
    return route.abort('internetdisconnected');
  });
  await page.goto(t.url, { timeout: 60_000 });
  // fail at the first request that leaves the service, not after a minute of "Loading…"
  await Promise.race([page.locator(QUERY_EDITOR).waitFor({ timeout: 60_000 }), leftTheService]);
  return opened;
}

/** Replace a Monaco editor's text, as a person would: click, select all, type (inserted whole, so auto-closing brackets don't double). */
async function typeInto(page: Page, editor: string, text: string) {
  await page.locator(editor).click();
  await page.keyboard.press('ControlOrMeta+A');
  await page.keyboard.press('Delete');
  await page.keyboard.insertText(text);
}

async function typeHeaders(page: Page, headers: Record<string, string>) {
  await page.getByRole('button', { name: 'Headers', exact: true }).click();
  await typeInto(page, '.monaco-editor[data-uri$="-request-headers.json"]', JSON.stringify(headers));
}

async function run(page: Page) {
  await page.getByRole('button', { name: /^Execute query/ }).click();
}

/** What the result pane shows, as text (Monaco renders spaces as no-break spaces). */
async function resultText(page: Page): Promise<string> {
  return (await page.locator('.result-window').innerText()).replace(/\u00a0/g, ' ');
}

async function resultShows(page: Page, ...parts: string[]): Promise<string> {
  return waitFor(
    async () => {
      const text = await resultText(page);
      return parts.every((part) => text.includes(part)) && text;
    },
    30_000,
    `result pane showing ${parts.join(', ')}`,
  ).catch(async (error) => {
    throw new Error(`${error.message}; it shows: ${await resultText(page)}`, { cause: error });
  });
}

describe('GraphiQL with no internet', () => {
  it('renders from the service alone: every request goes to its own origin', async () => {
    const { page, requested, errors } = await openGraphiQL();
    await page.getByRole('button', { name: /^Execute query/ }).waitFor();
    assert.doesNotMatch(await page.locator('body').innerText(), /Loading/);
    const foreign = requested.filter((url) => new URL(url).host !== new URL(origin).host);
    assert.deepEqual(foreign, [], 'requests that left the service');
    assert.ok(
      requested.some((url) => url.startsWith(origin + GRAPHIQL_ASSETS_PATH) && url.endsWith('.js')),
      `GraphiQL loaded from ${GRAPHIQL_ASSETS_PATH}: ${requested.join(' ')}`,
    );
    assert.deepEqual(errors, []);
    await page.context().close();
    // no other site may frame it; its type is not sniffed; it is not kept
    const response = await fetch(`${origin}/graphql`, { headers: { accept: 'text/html' } });
    assert.match(response.headers.get('content-security-policy') ?? '', /frame-ancestors 'none'/);
    assert.equal(response.headers.get('x-frame-options'), 'DENY');
    assert.equal(response.headers.get('x-content-type-options'), 'nosniff');
    assert.equal(response.headers.get('cache-control'), 'no-store');
    // the dashboard keeps its own, stricter policy
    const dashboard = await fetch(`${origin}/dashboard/`);
    assert.match(dashboard.headers.get('content-security-policy') ?? '', /default-src 'none'/);
  });

  it('runs a typed query over HTTP with the headers typed in the headers editor', async () => {
    const { page } = await openGraphiQL();
    await typeHeaders(page, { Authorization: 'Bearer typed-in-graphiql' });
    await typeInto(page, QUERY_EDITOR, '{ procedures { name } }');
    const request = page.waitForRequest((r) => r.method() === 'POST' && /procedures\s*\{\s*name/.test(r.postData() ?? ''), {
      timeout: 30_000,
    });
    await run(page);
    assert.equal((await (await request).allHeaders()).authorization, 'Bearer typed-in-graphiql');
    await resultShows(page, '"procedures"', '"name": "demo.add"');
    // a credential typed in stays in the tab: nothing of it in localStorage, which outlives the tab
    // (GraphiQL saves its state a moment after an edit, and as the page goes)
    await page.waitForTimeout(1_000);
    await page.reload();
    await page.waitForSelector(QUERY_EDITOR, { timeout: 30_000 });
    const stored = await page.evaluate(() => JSON.stringify(Object.entries(localStorage)));
    assert.ok(stored.includes('graphiql'), 'GraphiQL keeps its tabs there');
    assert.ok(!stored.includes('typed-in-graphiql'), stored);
    await page.context().close();
  });

  it('shows a subscription event delivered over graphql-ws on the same path', async () => {
    const { page, requested, wsSent } = await openGraphiQL();
    await typeHeaders(page, { Authorization: 'Bearer typed-in-graphiql' });
    // from a cursor taken first, so the event cannot slip past before the subscription is live
    const { body: cursor } = await t.gql<{ changeCursor: string }>('{ changeCursor }');
    await typeInto(
      page,
      QUERY_EDITOR,
      `subscription { executionEvents(after: "${cursor.data!.changeCursor}", filter: { procedure: "demo.add", status: [SUCCEEDED] }) { status execution { token result { outputParameters } } } }`,
    );
    await run(page);
    await waitFor(async () => wsSent.some((m) => m.type === 'subscribe'), 30_000, 'a graphql-ws subscribe message');
    const { body } = await t.gql<{ invoke: { execution: { token: string } } }>(
      'mutation { invoke(input: { procedure: "demo.add", arguments: { a: 20, b: 22 } }) { execution { token } } }',
    );
    const token = body.data!.invoke.execution.token;
    await resultShows(page, '"status": "SUCCEEDED"', `"token": "${token}"`, '"total": 42');

    assert.ok(requested.includes(`${origin.replace(/^http/, 'ws')}/graphql`), `a WebSocket to /graphql: ${requested.join(' ')}`);
    // graphql-ws carries the typed headers in the subscribe message's extensions, not in connection_init's payload
    const init = wsSent.find((m) => m.type === 'connection_init');
    const subscribe = wsSent.find((m) => m.type === 'subscribe');
    assert.equal(subscribe?.payload.extensions?.headers?.Authorization, 'Bearer typed-in-graphiql', JSON.stringify(subscribe));
    assert.equal(init?.payload?.Authorization, undefined, JSON.stringify(init));
    await page.context().close();
  });

  it('serves its files with their content types, cached for good, gzipped on request; nothing when GraphiQL is off', async () => {
    const page = await fetch(t.url, { headers: { accept: 'text/html' } });
    assert.equal(page.status, 200);
    const html = await page.text();
    assert.ok(html.length < 5_000, `a small page that points at its files, not ${html.length} characters`);
    const files = [...html.matchAll(/["']([^"']*\/graphiql\/assets\/[^"']+)["']/g)].map((m) => m[1]!);
    assert.equal(new Set(files).size, 6, files.join(' '));
    const types = { js: 'text/javascript; charset=utf-8', css: 'text/css; charset=utf-8', ico: 'image/x-icon' };
    for (const file of files) {
      const response = await fetch(origin + file, { headers: { 'accept-encoding': 'gzip' } });
      assert.equal(response.status, 200, file);
      assert.equal(response.headers.get('content-type'), types[file.split('.').pop() as keyof typeof types], file);
      assert.equal(response.headers.get('cache-control'), 'public, max-age=31536000, immutable');
      if (!file.endsWith('.ico')) assert.equal(response.headers.get('content-encoding'), 'gzip', file);
      assert.ok((await response.arrayBuffer()).byteLength > 1000, file);
    }
    const plain = await fetch(origin + files.find((f) => f.endsWith('.css'))!, { headers: { 'accept-encoding': 'identity' } });
    assert.equal(plain.headers.get('content-encoding'), null);
    assert.match(await plain.text(), /graphiql/);
    assert.equal((await fetch(`${origin}${GRAPHIQL_ASSETS_PATH}graphiql-0000000000000000.js`)).status, 404);

    const off = createYogaApp({ engine: t.app.engine, hub: t.app.hub!, logger: silentLogger, limits: { maxCalls: 5, maxArgumentBytes: 1000 }, graphiql: false, auth: new Authenticator({ mode: 'none', jwt: null }, t.app.engine, silentLogger) });
    const offPage = await off.fetch('http://localhost/graphql', { headers: { accept: 'text/html' } });
    assert.doesNotMatch(offPage.headers.get('content-type') ?? '', /text\/html/);
    assert.equal((await off.fetch(`http://localhost${files[0]}`)).status, 404);
  });
});
