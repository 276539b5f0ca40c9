/**
 * The dashboard in a real headless Chromium that may talk to the service only, against the service on
 * a real PostgreSQL: it follows work live (no reloads), steers it (invoke, cancel), signs in like any
 * client, and shows a plain caller no action the server would refuse.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { SignJWT } from 'jose';
import type pg from 'pg';
import type { Browser, BrowserContextOptions, Page } from 'playwright-core';
import { contentSecurityPolicy } from '../src/dashboard.js';
import { startTestApp, type TestApp } from './support/app.js';
import { launchChromium } from './support/browser.js';
import { ensureDashboardBuilt } from './support/dashboard.js';
import { sleep, startTestCluster, waitFor, type TestCluster } from './support/database.js';
import { startProxy } from './support/proxy.js';

let cluster: TestCluster;
let t: TestApp;
let browser: Browser;
let databaseUrl: string;

before(async () => {
  ensureDashboardBuilt();
  cluster = await startTestCluster();
  databaseUrl = await cluster.createDatabase();
  t = await startTestApp(databaseUrl);
  browser = await launchChromium();
});
after(async () => {
  await browser?.close();
  await t?.stop();
  await cluster?.stop();
});

interface Opened {
  page: Page;
  /** Every URL the page requested, WebSockets included. */
  requested: string[];
  /** Console errors and uncaught exceptions (a CSP violation is reported as a console error). */
  errors: string[];
}

/** A fresh profile on the dashboard of `app` (at `origin`, a proxy say); requests that leave it are refused, as offline. */
async function open(app: TestApp, hash = '', options: BrowserContextOptions = {}, origin = new URL(app.url).origin): Promise<Opened> {
  const context = await browser.newContext(options);
  const page = await context.newPage();
  const opened: Opened = { page, requested: [], errors: [] };
  page.on('request', (request) => opened.requested.push(request.url()));
  page.on('websocket', (socket) => opened.requested.push(socket.url()));
  page.on('console', (message) => message.type() === 'error' && opened.errors.push(message.text()));
  page.on('pageerror', (error) => opened.errors.push(error.message));
  // the browser's own record of what the policy refused, whether or not it reaches the console
  await page.addInitScript(() =>
    document.addEventListener('securitypolicyviolation', (e) => console.error(`CSP violation: ${e.violatedDirective} ${e.blockedURI}`)),
  );
  await context.route('**/*', (route) => (new URL(route.request().url()).origin === origin ? route.continue() : route.abort('internetdisconnected')));
  await page.goto(`${origin}/dashboard/${hash}`, { timeout: 60_000 });
  return opened;
}

async function gqlData<T = any>(app: TestApp, query: string, variables?: Record<string, unknown>, headers?: Record<string, string>): Promise<T> {
  const { body } = await app.gql<T>(query, variables, headers);
  assert.equal(body.errors, undefined, JSON.stringify(body.errors));
  return body.data!;
}

async function invoke(app: TestApp, input: Record<string, unknown>, headers?: Record<string, string>): Promise<string> {
  const data = await gqlData(app, 'mutation ($input: InvokeInput!) { invoke(input: $input) { execution { token } } }', { input }, headers);
  return data.invoke.execution.token;
}

async function cancel(app: TestApp, token: string, headers?: Record<string, string>) {
  return (await app.gql('mutation ($token: ID!) { cancelExecution(token: $token) { execution { status } } }', { token }, headers)).body;
}

async function statusOf(app: TestApp, token: string, headers?: Record<string, string>): Promise<string> {
  return (await gqlData(app, 'query ($token: ID!) { execution(token: $token) { status } }', { token }, headers)).execution.status;
}

/** Holds demo.ledger so that demo.record(tag) calls run until released: a call that is RUNNING for as long as the test wants. */
async function holdLedger(): Promise<{ release(): Promise<void> }> {
  const client: pg.Client = await cluster.connect(databaseUrl);
  await client.query('begin');
  await client.query('lock table demo.ledger in access exclusive mode');
  return {
    release: async () => {
      await client.query('commit');
      await client.end();
    },
  };
}

async function text(page: Page, selector: string): Promise<string> {
  return (await page.locator(selector).first().innerText()).trim();
}

/** Wait until the element's text matches (the page updating itself: nothing here reloads it). */
async function shows(page: Page, selector: string, expected: RegExp | string, timeoutMs = 30_000) {
  await page
    .locator(selector)
    .first()
    .filter({ hasText: expected })
    .waitFor({ timeout: timeoutMs })
    .catch(async (error: Error) => {
      const now = await page.locator(selector).first().innerText().catch(() => '(absent)');
      throw new Error(`${selector} never showed ${expected}; it shows: ${now}`, { cause: error });
    });
}

/** Marks the document; a reload or a navigation away from the page loses the mark. */
const mark = (page: Page) => page.evaluate(() => ((window as unknown as { mark: string }).mark = 'unchanged'));
const marked = (page: Page) => page.evaluate(() => (window as unknown as { mark?: string }).mark);

describe('the dashboard with no internet', () => {
  it('is served at /dashboard/ (/ redirects there) with its types, cache headers and a strict policy', async () => {
    const origin = new URL(t.url).origin;
    const home = await fetch(`${origin}/`, { redirect: 'manual' });
    assert.equal(home.status, 302);
    assert.equal(home.headers.get('location'), '/dashboard/');
    const page = await fetch(`${origin}/dashboard/`);
    assert.equal(page.status, 200);
    assert.equal(page.headers.get('content-type'), 'text/html; charset=utf-8');
    assert.equal(page.headers.get('cache-control'), 'no-cache');
    const policy = page.headers.get('content-security-policy')!;
    assert.equal(policy, contentSecurityPolicy(new URL(origin).host));
    assert.match(policy, /script-src 'self';/);
    assert.doesNotMatch(policy, /unsafe-inline|unsafe-eval|https?:/);
    assert.match(policy, new RegExp(`connect-src 'self' ws://${new URL(origin).host} wss://`));
    const html = await page.text();
    assert.doesNotMatch(html, /<script>|<script(?![^>]*\bsrc=)[^>]*>/, 'no inline script');
    const assets = [...html.matchAll(/(?:src|href)="(\/dashboard\/assets\/[^"]+)"/g)].map((m) => m[1]!);
    assert.ok(assets.some((a) => a.endsWith('.js')) && assets.some((a) => a.endsWith('.css')), assets.join(' '));
    for (const asset of assets) {
      const response = await fetch(origin + asset, { headers: { 'accept-encoding': 'gzip' } });
      assert.equal(response.status, 200, asset);
      assert.equal(response.headers.get('content-encoding'), 'gzip', asset);
      const plain = await fetch(origin + asset, { headers: { 'accept-encoding': 'identity' } });
      assert.equal(plain.headers.get('content-encoding'), null);
      assert.equal((await plain.arrayBuffer()).byteLength, Number(plain.headers.get('content-length')));
      assert.equal(response.headers.get('content-type'), asset.endsWith('.js') ? 'text/javascript; charset=utf-8' : 'text/css; charset=utf-8');
      assert.equal(response.headers.get('cache-control'), 'public, max-age=31536000, immutable');
    }
    assert.equal((await fetch(`${origin}/dashboard/assets/nothing-here.js`)).status, 404);
    // a forged Host header never widens the policy
    assert.equal(contentSecurityPolicy("evil.test; script-src 'unsafe-inline'"), contentSecurityPolicy(null));
  });

  it('is not served with ASYNCPROC_DASHBOARD=false', async () => {
    const off = await startTestApp(databaseUrl, { ASYNCPROC_DASHBOARD: 'false' });
    try {
      const origin = new URL(off.url).origin;
      assert.equal((await fetch(`${origin}/dashboard/`)).status, 404);
      assert.notEqual((await fetch(`${origin}/`, { redirect: 'manual' })).status, 302);
    } finally {
      await off.stop();
    }
  });

  it('loads every view from the service alone, with no policy violation', async () => {
    const { page, requested, errors } = await open(t);
    await page.locator('[data-queue="default"]').waitFor({ timeout: 60_000 });
    for (const view of ['running', 'executions', 'batches', 'procedures', 'queues', 'schedules', 'procedure/demo.add']) {
      await page.goto(`${new URL(t.url).origin}/dashboard/#/${view}`);
      await page.locator('main.page .card, main.page .note').first().waitFor();
    }
    const origin = new URL(t.url).origin;
    const foreign = requested.filter((url) => new URL(url).host !== new URL(origin).host);
    assert.deepEqual(foreign, [], 'requests that left the service');
    assert.ok(requested.includes(`${origin.replace(/^http/, 'ws')}/graphql`), `a graphql-ws socket: ${requested.join(' ')}`);
    assert.deepEqual(errors, []);
    await page.context().close();
  });

  it('a link cut short in its percent-encoding still shows a page (the menu and a view), not a blank one', async () => {
    const { page, errors } = await open(t, '#/execution/%E0%A4%A');
    await page.locator('main.page .card, main.page .note').first().waitFor({ timeout: 30_000 });
    await page.getByRole('link', { name: /executions/i }).first().waitFor();
    assert.deepEqual(errors, []);
    await page.context().close();
  });
});

describe('following work live', () => {
  it('the overview counts a call the moment it ends, also one that ends in a 10 s bucket its clock has not ticked into', async () => {
    // The charts' clock ticks every bucket (10 s). A page opened before a bucket starts and a call
    // ending just after it: the call is counted at once, not at the page's next tick (it was up to 10 s late).
    const BUCKET_MS = 10_000;
    const total = '[data-testid="succeeded-total"]';
    for (let attempt = 1; ; attempt++) {
      // open the page about 4 s before a bucket starts
      await sleep((6_000 - (Date.now() % BUCKET_MS) + BUCKET_MS) % BUCKET_MS);
      const openedAt = Date.now();
      const bucketStart = Math.ceil(openedAt / BUCKET_MS) * BUCKET_MS;
      const { page, errors } = await open(t);
      await shows(page, total, /^\d+$/);
      const before = Number(await text(page, total));
      // the page must have read its clock before the bucket starts, and the call must end before its
      // first tick (openedAt + 10 s at the earliest); on a machine too slow for that, try again
      const ready = Date.now() < bucketStart - 300;
      if (ready) await sleep(bucketStart + 300 - Date.now());
      const token = ready ? await invoke(t, { procedure: 'demo.add', arguments: { a: 40, b: 2 } }) : null;
      if (token) await waitFor(async () => (await statusOf(t, token)) === 'SUCCEEDED', 30_000, 'the call');
      // the page is given at least 3 s to show it (the event's way to the page included) before its tick
      const deadline = openedAt + BUCKET_MS - 500;
      if (token && Date.now() < deadline - 3_000) {
        await page
          .waitForFunction(([selector, count]) => Number(document.querySelector(selector as string)?.textContent) > (count as number), [total, before] as const, {
            timeout: deadline - Date.now(),
          })
          .catch(async () => assert.fail(`the call that ended ${Date.now() - bucketStart} ms into a new bucket was not counted before the page's next tick: it shows ${await text(page, total)}, as before`));
        assert.deepEqual(errors, []);
        await page.context().close();
        return;
      }
      await page.context().close();
      assert.ok(attempt < 3, 'three tries, each too slow to open the page and end a call within a bucket');
    }
  });

  it("the overview shows a queue's counts change while calls run", async () => {
    await gqlData(t, 'mutation { configureQueue(input: { name: "dash", concurrency: 2 }) { queue { name } } }');
    const { page, errors } = await open(t);
    const cell = (count: string) => `[data-queue="dash"] [data-count="${count}"]`;
    await shows(page, cell('running'), /^0/);
    const tokens: string[] = [];
    try {
      for (let i = 0; i < 3; i++) tokens.push(await invoke(t, { procedure: 'demo.sleep', arguments: { seconds: 600 }, queue: 'dash' }));
      await shows(page, cell('running'), /^2/);
      await shows(page, cell('pending'), /^1$/);
    } finally {
      for (const token of tokens) await cancel(t, token);
    }
    await shows(page, cell('running'), /^0/);
    await shows(page, cell('pending'), /^0$/);
    assert.deepEqual(errors, []);
    await page.context().close();
  });

  it('invoking from the procedure form leads to the execution page, which turns SUCCEEDED without a reload', async () => {
    const ledger = await holdLedger();
    try {
      const { page, errors } = await open(t, '#/procedure/demo.record');
      await page.locator('input[name="tag"]').fill('from the form');
      await page.getByRole('button', { name: 'Invoke' }).click();
      await page.waitForURL(/#\/execution\/[0-9a-f-]{36}$/);
      const token = /execution\/([0-9a-f-]{36})$/.exec(page.url())![1]!;
      await shows(page, '.facts [data-status]', 'RUNNING');
      await mark(page);
      await ledger.release();
      await shows(page, '.facts [data-status]', 'SUCCEEDED');
      assert.equal(await marked(page), 'unchanged', 'the page updated itself');
      assert.equal(await statusOf(t, token), 'SUCCEEDED');
      assert.match(await text(page, 'table.kv'), /tag\s+"from the form"/);
      // run again: a new call with the same arguments, followed on its own page
      await page.getByRole('button', { name: 'Run again' }).click();
      await page.waitForURL((url) => /#\/execution\/[0-9a-f-]{36}$/.test(url.hash) && !url.hash.endsWith(token));
      await shows(page, '.facts [data-status]', 'SUCCEEDED');
      const again = /execution\/([0-9a-f-]{36})$/.exec(page.url())![1]!;
      const { execution } = await gqlData(t, 'query ($token: ID!) { execution(token: $token) { procedure arguments } }', { token: again });
      assert.deepEqual(execution, { procedure: 'demo.record', arguments: { tag: 'from the form' } });
      assert.deepEqual(errors, []);
      await page.context().close();
    } finally {
      await ledger.release().catch(() => {});
    }
  });

  it('a failing call shows its error and its history', async () => {
    await invoke(t, { procedure: 'demo.noop' });
    const token = await invoke(t, { procedure: 'demo.fail', arguments: { message: 'the ledger is closed' }, maxAttempts: 2 });
    const { page, errors } = await open(t, `#/execution/${token}`);
    await shows(page, '.facts [data-status]', 'FAILED');
    await shows(page, '[data-testid="execution-error"]', 'the ledger is closed');
    assert.match(await text(page, '[data-testid="execution-error"]'), /number\s+P0001/);
    const attempts = page.locator('[data-testid="history"] li');
    assert.equal(await attempts.count(), 2);
    for (let i = 0; i < 2; i++) {
      const attempt = await attempts.nth(i).innerText();
      assert.match(attempt, new RegExp(`attempt ${i + 1}\\s+FAILED`));
      assert.match(attempt, /the ledger is closed/);
    }
    // and in the list, where a failure stands out, and which filters by status
    await page.goto(`${new URL(t.url).origin}/dashboard/#/executions`);
    await page.locator(`tr.failed[data-token="${token}"]`).waitFor();
    assert.ok(await page.locator('tr[data-token]:not(.failed)').count(), 'other executions listed too');
    await page.getByRole('checkbox', { name: 'failed' }).check();
    await page.locator('tr[data-token]:not(.failed)').first().waitFor({ state: 'detached' });
    await page.locator(`tr.failed[data-token="${token}"]`).waitFor();
    // "submitted by" asks the service: another subject's list is empty, the development caller's (null) not
    await page.getByLabel('submitted by').fill('somebody-else');
    await page.locator('tr[data-token]').first().waitFor({ state: 'detached' });
    await page.getByLabel('submitted by').fill('');
    await page.locator(`tr.failed[data-token="${token}"]`).waitFor();
    assert.deepEqual(errors, []);
    await page.context().close();
  });

  it('cancelling a running call from the running view (confirmed) ends it CANCELLED', async () => {
    const token = await invoke(t, { procedure: 'demo.sleep', arguments: { seconds: 600 } });
    try {
      await waitFor(async () => (await statusOf(t, token)) === 'RUNNING', 30_000, 'the call running');
      const { page, errors } = await open(t, '#/running');
      const row = page.locator(`tr[data-token="${token}"]`);
      await row.getByRole('button', { name: 'Cancel' }).click();
      assert.equal(await statusOf(t, token), 'RUNNING', 'nothing happens before the confirmation');
      await row.getByRole('button', { name: 'Yes, cancel' }).click();
      await row.waitFor({ state: 'detached', timeout: 30_000 });
      await waitFor(async () => (await statusOf(t, token)) === 'CANCELLED', 30_000, 'the call cancelled');
      assert.deepEqual(errors, []);
      await page.context().close();
    } finally {
      await cancel(t, token);
    }
  });

  it("a batch's stage bars advance as its calls end", async () => {
    const ledger = await holdLedger();
    try {
      const { submitBatch } = await gqlData(
        t,
        `mutation { submitBatch(input: { stages: [[{ procedure: "demo.record", arguments: { tag: "stage one" } }, { procedure: "demo.add", arguments: { a: 1, b: 2 } }], [{ procedure: "demo.add", arguments: { a: 3, b: 4 } }]] }) { batch { id } } }`,
      );
      const { page, errors } = await open(t, `#/batch/${submitBatch.batch.id}`);
      const counts = (stage: number) => page.locator(`[aria-label="stage ${stage}"][role="progressbar"]`);
      const ended = async (stage: number) => (await counts(stage).getAttribute('aria-valuenow')) ?? '';
      await shows(page, '.stage-counts >> nth=0', /^1\/2 ended/);
      await shows(page, '.stage-counts >> nth=0', /1 running/);
      assert.equal(await ended(2), '0');
      await shows(page, '.stage-counts >> nth=1', /1 waiting/);
      await mark(page);
      await ledger.release();
      await shows(page, '.stage-counts >> nth=0', /^2\/2 ended/);
      await shows(page, '.stage-counts >> nth=1', /^1\/1 ended/);
      await shows(page, '.facts [data-status]', 'SUCCEEDED');
      assert.equal(await ended(1), '2');
      assert.equal(await marked(page), 'unchanged', 'the page updated itself');
      assert.deepEqual(errors, []);
      await page.context().close();
    } finally {
      await ledger.release().catch(() => {});
    }
  });
});

describe('steering', () => {
  it("an admin changes a queue's concurrency", async () => {
    await gqlData(t, 'mutation { configureQueue(input: { name: "tuned", concurrency: 3 }) { queue { name } } }');
    const { page, errors } = await open(t, '#/queues');
    const field = page.getByRole('spinbutton', { name: 'concurrency of tuned' });
    await field.fill('7');
    await page.locator('[data-queue="tuned"]').getByRole('button', { name: 'Save', exact: true }).click();
    await waitFor(async () => (await gqlData(t, '{ queues { name concurrency } }')).queues.some((q: { name: string; concurrency: number }) => q.name === 'tuned' && q.concurrency === 7), 30_000, 'concurrency 7');
    await field.fill('0');
    await page.locator('[data-queue="tuned"]').getByRole('button', { name: 'Save', exact: true }).click();
    // the browser refuses an out-of-range value before anything is sent
    assert.equal((await gqlData(t, '{ queues { name concurrency } }')).queues.find((q: { name: string }) => q.name === 'tuned').concurrency, 7);
    assert.deepEqual(errors, []);
    await page.context().close();
  });

  it("an admin sets a queue's grouped commits; a value the server refuses shows its message and changes nothing", async () => {
    await gqlData(t, 'mutation { configureQueue(input: { name: "grouped", concurrency: 3 }) { queue { name } } }');
    const settings = async () =>
      (await gqlData(t, '{ queues { name concurrency groupCommits { size maxMs } } }')).queues.find((q: { name: string }) => q.name === 'grouped');
    const { page, errors } = await open(t, '#/queues');
    const row = page.locator('[data-queue="grouped"]');
    const size = row.getByRole('spinbutton', { name: 'grouped calls of grouped' });
    const maxMs = row.getByRole('spinbutton', { name: 'group max ms of grouped' });
    const save = row.getByRole('button', { name: 'Save grouped commits of grouped' });
    assert.equal(await size.inputValue(), '1');
    assert.equal(await maxMs.inputValue(), '50');
    assert.ok(await save.isDisabled(), 'nothing to save yet');
    await size.fill('20');
    await maxMs.fill('75');
    await save.click();
    await waitFor(async () => (await settings()).groupCommits.size === 20, 30_000, 'grouped commits of 20 calls');
    assert.deepEqual(await settings(), { name: 'grouped', concurrency: 3, groupCommits: { size: 20, maxMs: 75 } });
    await waitFor(() => save.isDisabled(), 30_000, 'Save disabled once the page shows what was saved');
    // out of the API's range (1–1000): the server's own message, in the row, and the queue as it was
    for (const refused of ['0', '1001']) {
      await size.fill(refused);
      await save.click();
      await shows(page, '[data-queue="grouped"] [data-setting="groupCommits"] .error-text', `groupCommits.size must be a whole number from 1 to 1000, not ${refused}`);
      assert.deepEqual(await settings(), { name: 'grouped', concurrency: 3, groupCommits: { size: 20, maxMs: 75 } });
    }
    assert.deepEqual(errors, []);
    await page.context().close();
  });

  it('pauses a queue, after asking: its row says so, its calls wait; Resume runs them', async () => {
    await gqlData(t, 'mutation { configureQueue(input: { name: "held", concurrency: 2 }) { queue { name } } }');
    const paused = async () => (await gqlData(t, '{ queues { name paused } }')).queues.find((q: { name: string }) => q.name === 'held').paused as boolean;
    const { page, errors } = await open(t, '#/queues');
    const row = page.locator('[data-queue="held"]');
    await row.getByRole('button', { name: 'Pause' }).click();
    assert.equal(await paused(), false, 'nothing happens before the confirmation');
    await row.getByRole('button', { name: 'Yes, pause' }).click();
    await page.locator('tr.paused[data-queue="held"] .tag', { hasText: 'paused' }).waitFor();
    assert.equal(await paused(), true);
    const token = await invoke(t, { procedure: 'demo.noop', queue: 'held' });
    await shows(page, '[data-queue="held"] [data-count="pending"]', /^1$/);
    await sleep(1500);
    assert.equal(await statusOf(t, token), 'PENDING');
    await row.getByRole('button', { name: 'Resume' }).click();
    await row.getByRole('button', { name: 'Yes, resume' }).click();
    await page.locator('tr.paused[data-queue="held"]').waitFor({ state: 'detached' });
    await waitFor(async () => (await statusOf(t, token)) === 'SUCCEEDED', 30_000, 'the call run once resumed');
    assert.equal(await paused(), false);
    assert.deepEqual(errors, []);
    await page.context().close();
  });

  it('pauses and resumes a schedule, after asking', async () => {
    await gqlData(t, 'mutation { createSchedule(input: { name: "hourly", procedure: "demo.noop", cron: "0 * * * *" }) { schedule { name } } }');
    const paused = async () => (await gqlData(t, '{ schedule(name: "hourly") { paused } }')).schedule.paused as boolean;
    const { page, errors } = await open(t, '#/schedules');
    await page.getByRole('button', { name: 'Pause' }).click();
    assert.equal(await paused(), false, 'nothing happens before the confirmation');
    await page.getByRole('button', { name: 'Yes, pause' }).click();
    await page.locator('tr.paused').waitFor();
    assert.equal(await paused(), true);
    await page.getByRole('button', { name: 'Resume' }).click();
    await page.getByRole('button', { name: 'Yes, resume' }).click();
    await page.locator('tr.paused').waitFor({ state: 'detached' });
    assert.equal(await paused(), false);
    assert.deepEqual(errors, []);
    await page.context().close();
  });
});

describe('a user who makes mistakes (found by a hostile probe)', () => {
  const count = async (procedure: string) => Number((await gqlData(t, `{ executions(first: 1, filter: { procedure: "${procedure}" }) { totalCount } }`)).executions.totalCount);

  it('a "not before" the browser cannot turn into an instant is refused in the form, sends nothing, and the form goes on working', async () => {
    const before = await count('demo.noop');
    const { page, errors } = await open(t, '#/procedure/demo.noop');
    await page.locator('input[name="runAt"]').fill('275760-09-13T00:00');
    await page.getByRole('button', { name: 'Invoke' }).click();
    await shows(page, 'main.page', 'is not a date and time from year 1 to 9999');
    assert.equal(await count('demo.noop'), before, 'nothing sent');
    await page.locator('input[name="runAt"]').fill('');
    await page.getByRole('button', { name: 'Invoke' }).click();
    await page.waitForURL(/#\/execution\/[0-9a-f-]{36}$/);
    assert.equal(await count('demo.noop'), before + 1);
    assert.deepEqual(errors, []);
    await page.context().close();
  });

  it('"Run again" clicked twice quickly makes one call', async () => {
    const token = await invoke(t, { procedure: 'demo.add', arguments: { a: 7, b: 7 } });
    await waitFor(async () => (await statusOf(t, token)) === 'SUCCEEDED', 30_000, 'the call');
    const before = await count('demo.add');
    const { page, errors } = await open(t, `#/execution/${token}`);
    await page.getByRole('button', { name: 'Run again' }).dblclick();
    await page.waitForURL((url) => /#\/execution\/[0-9a-f-]{36}$/.test(url.hash) && !url.hash.endsWith(token));
    await sleep(500);
    assert.equal(await count('demo.add'), before + 1);
    assert.deepEqual(errors, []);
    await page.context().close();
  });

  it('a fresh overview counts every call that ended within its window, not only the newest hundred', async () => {
    await gqlData(t, 'mutation ($i: [InvokeInput!]!) { invokeMany(inputs: $i) { executions { token } } }', {
      i: Array.from({ length: 150 }, () => ({ procedure: 'demo.noop' })),
    });
    const client = await cluster.connect(databaseUrl);
    try {
      const unended = async () => Number((await client.query(`select count(*) as n from asyncproc.executions where status in ('PENDING', 'RUNNING')`)).rows[0].n);
      await waitFor(async () => (await unended()) === 0, 30_000, 'the 150 calls to end');
      const ended = async () => Number((await client.query(`select count(*) as n from asyncproc.executions where status = 'SUCCEEDED' and finished_at > now() - interval '9 minutes'`)).rows[0].n);
      const expected = await ended();
      assert.ok(expected >= 150, String(expected));
      const { page, errors } = await open(t);
      await shows(page, '[data-testid="succeeded-total"]', new RegExp(`^${expected}$`));
      assert.deepEqual(errors, []);
      await page.context().close();
    } finally {
      await client.end();
    }
  });

  it("a queue's form follows another admin's change, and New queue does not change a queue that exists", async () => {
    await gqlData(t, 'mutation { configureQueue(input: { name: "shared", concurrency: 3 }) { queue { name } } }');
    const concurrency = async () => (await gqlData(t, '{ queues { name concurrency } }')).queues.find((q: { name: string }) => q.name === 'shared').concurrency;
    const { page, errors } = await open(t, '#/queues');
    const field = page.getByRole('spinbutton', { name: 'concurrency of shared' });
    await waitFor(async () => (await field.inputValue()) === '3', 30_000, 'the field at 3');
    await gqlData(t, 'mutation { configureQueue(input: { name: "shared", concurrency: 7 }) { queue { name } } }');
    await waitFor(async () => (await field.inputValue()) === '7', 30_000, "the field showing the other admin's 7");
    assert.ok(await page.locator('[data-queue="shared"]').getByRole('button', { name: 'Save', exact: true }).isDisabled(), 'nothing to save');
    await page.getByRole('textbox', { name: 'queue name' }).fill('shared');
    await page.getByRole('spinbutton', { name: 'concurrency', exact: true }).fill('1');
    await page.getByRole('button', { name: 'Create' }).click();
    await shows(page, 'main.page', 'a queue named shared exists already');
    assert.equal(await concurrency(), 7);
    assert.deepEqual(errors, []);
    await page.context().close();
  });

  it('a 20,000-character error and argument wrap inside their cards: the page does not scroll sideways, on a phone either', async () => {
    const long = 'W'.repeat(20_000);
    const token = await invoke(t, { procedure: 'demo.fail', arguments: { message: long }, maxAttempts: 1 });
    await waitFor(async () => (await statusOf(t, token)) === 'FAILED', 30_000, 'the call to fail');
    for (const viewport of [{ width: 1280, height: 800 }, { width: 375, height: 700 }]) {
      const { page, errors } = await open(t, `#/execution/${token}`, { viewport });
      await shows(page, '[data-testid="execution-error"]', 'WWWW');
      const width = await page.evaluate(() => document.documentElement.scrollWidth);
      assert.ok(width <= viewport.width, `the page is ${width} px wide in a ${viewport.width} px viewport`);
      assert.deepEqual(errors, []);
      await page.context().close();
    }
  });

  it('a batch id typed with a slash opens the page of that id (refused as malformed), not of its first part', async () => {
    const { page, errors } = await open(t, '#/batches');
    await page.getByRole('textbox', { name: 'batch id' }).fill('not a batch / id');
    await page.getByRole('button', { name: 'Open' }).click();
    await shows(page, 'main.page', 'not a batch / id');
    assert.deepEqual(errors.filter((e) => !/status of 4\d\d/.test(e)), []);
    await page.context().close();
  });
});

describe('resuming', () => {
  it('counts what ended while the socket was down: the feed resumes from the last cursor it saw', async () => {
    const proxy = await startProxy(t.app.server!.port);
    try {
      const { page } = await open(t, '', {}, `http://127.0.0.1:${proxy.port}`);
      await page.locator('.dot[data-live="true"]').waitFor({ timeout: 30_000 });
      const total = '[data-testid="succeeded-total"]';
      await shows(page, total, /^\d+$/);
      // one event seen first, so the stream has a cursor of its own to resume from
      await waitFor(async () => (await statusOf(t, await invoke(t, { procedure: 'demo.add', arguments: { a: 0, b: 0 } }))) === 'SUCCEEDED', 30_000, 'a first call');
      await page.waitForFunction((selector) => Number(document.querySelector(selector)?.textContent) > 0, total);
      // calls of earlier tests may still end meanwhile: compare the page's count with the service's, both quiet
      const succeeded = async () => (await gqlData(t, '{ executions(filter: { status: [SUCCEEDED] }) { totalCount } }')).executions.totalCount as number;
      const quiet = await waitFor(async () => {
        const [pageBefore, serviceBefore] = [Number(await text(page, total)), await succeeded()];
        await sleep(500);
        return pageBefore === Number(await text(page, total)) && serviceBefore === (await succeeded()) ? { page: pageBefore, service: serviceBefore } : null;
      }, 30_000, 'a quiet moment');
      proxy.cut();
      await page.locator('.dot[data-live="false"]').waitFor({ timeout: 30_000 });
      const tokens = [];
      for (let i = 0; i < 3; i++) tokens.push(await invoke(t, { procedure: 'demo.add', arguments: { a: i, b: 1 } }));
      for (const token of tokens) await waitFor(async () => (await statusOf(t, token)) === 'SUCCEEDED', 30_000, 'the calls made while cut off');
      proxy.restore();
      await page.locator('.dot[data-live="true"]').waitFor({ timeout: 60_000 });
      // every call that succeeded since, the three made while cut off among them, and none twice
      let last = { since: 0, shown: 0 };
      try {
        await waitFor(async () => {
          last = { since: (await succeeded()) - quiet.service, shown: Number(await text(page, total)) };
          return last.since >= 3 && last.shown === quiet.page + last.since;
        }, 30_000, 'the page to count what succeeded while it was cut off, once each');
      } catch (error) {
        // what the page and the service said last, and any alert the page shows (a stream that failed)
        const alerts = await page.locator('[role="alert"]').allTextContents();
        throw new Error(`${(error as Error).message}: it showed ${quiet.page} before and ${last.shown} now; ${last.since} succeeded since; alerts: ${JSON.stringify(alerts)}`);
      }
      await page.context().close();
    } finally {
      await proxy.close();
    }
  });

  it('says when the service cannot be reached, and tries again when asked', async () => {
    const context = await browser.newContext();
    const page = await context.newPage();
    await context.route('**/graphql', (route) => route.abort('connectionrefused'));
    await page.goto(`${new URL(t.url).origin}/dashboard/`);
    await shows(page, '[role="alert"]', 'cannot be reached');
    assert.equal(await page.locator('input[name="credential"]').count(), 0, 'no sign-in form: credentials are not the problem');
    await context.unroute('**/graphql');
    await page.getByRole('button', { name: 'Try again' }).click();
    await page.locator('[data-queue="default"]').waitFor({ timeout: 30_000 });
    await context.close();
  });

  it("follows a running call's progress live", async () => {
    const sql = await cluster.connect(databaseUrl);
    const ledger = await holdLedger();
    const gate = await cluster.connect(databaseUrl);
    try {
      await sql.query(`create table if not exists demo.gate (x integer);
        create or replace procedure demo.two_halves() language plpgsql as $$
        begin
          perform asyncproc.progress(40, 'first half');
          insert into demo.ledger (tag) values ('two halves');
          perform asyncproc.progress(80, 'second half');
          insert into demo.gate values (1);
        end $$;
        select asyncproc.register('demo.two_halves()');`);
      await gate.query('begin');
      await gate.query('lock table demo.gate in access exclusive mode');
      const token = await invoke(t, { procedure: 'demo.two_halves' });
      const { page, errors } = await open(t, `#/execution/${token}`);
      const bar = '[aria-label="progress of the call"]';
      await shows(page, bar, '40% · first half');
      await ledger.release();
      await shows(page, bar, '80% · second half');
      assert.equal(await page.locator(bar).getAttribute('aria-valuenow'), '80');
      await gate.query('commit');
      await shows(page, '.facts [data-status]', 'SUCCEEDED');
      assert.deepEqual(errors, []);
      await page.context().close();
    } finally {
      await ledger.release().catch(() => {});
      await gate.end();
      await sql.end();
    }
  });
});

describe('signing in', () => {
  const SECRET = 'a-dashboard-test-secret-of-32-characters-or-more';
  let secured: TestApp;
  const jwt = (sub: string, roles: string[] = []) =>
    new SignJWT({ roles }).setProtectedHeader({ alg: 'HS256' }).setSubject(sub).setIssuedAt().setExpirationTime('10m').sign(new TextEncoder().encode(SECRET));

  before(async () => {
    secured = await startTestApp(await cluster.createDatabase(), { ASYNCPROC_JWT_SECRET: SECRET, ASYNCPROC_RATE_LIMIT: '1000' });
  });
  after(async () => {
    await secured?.stop();
  });

  async function signIn(page: Page, credential: string) {
    await page.locator('input[name="credential"]').fill(credential);
    await page.getByRole('button', { name: 'Sign in' }).click();
  }

  it('asks for credentials, refuses bad ones with a clear message, and signs in with a JWT', async () => {
    const { page, errors } = await open(secured);
    await shows(page, '.signin', 'asks for a JWT or an API key');
    assert.doesNotMatch(await text(page, '.signin'), /Signed out/, 'never signed in: not "signed out"');
    await signIn(page, 'not-a-jwt');
    await shows(page, '.signin [role="alert"]', /Signed out: .*(JWT|token)/i);
    await signIn(page, await jwt('olga', ['operator']));
    await shows(page, '.who', 'operator');
    await page.locator('[data-queue="default"]').waitFor();
    assert.ok(await page.evaluate(() => sessionStorage.getItem('asyncproc.authorization')?.startsWith('Bearer ')));
    await page.getByRole('button', { name: 'Sign out' }).click();
    await page.locator('input[name="credential"]').waitFor();
    assert.equal(await page.evaluate(() => sessionStorage.getItem('asyncproc.authorization')), null);
    // an API key, as typed (no scheme): sent as "ApiKey …"
    const admin = { authorization: `Bearer ${await jwt('ada', ['admin'])}` };
    const { createApiKey } = await gqlData(secured, 'mutation { createApiKey(input: { name: "night-shift", roles: ["operator"] }) { secret } }', {}, admin);
    await signIn(page, createApiKey.secret);
    await shows(page, '.who', 'operator');
    assert.match(await page.evaluate(() => sessionStorage.getItem('asyncproc.authorization') ?? ''), /^ApiKey apk_/);
    // the browser's own 401s on the way are expected; nothing else may fail
    assert.deepEqual(errors.filter((e) => !/status of 401/.test(e)), []);
    await page.context().close();
  });

  it("after a sign-out, the next caller's overview counts their own work only, not what the last one saw", async () => {
    const admin = { authorization: `Bearer ${await jwt('ada', ['admin'])}` };
    const token = await invoke(secured, { procedure: 'demo.noop' }, admin);
    await waitFor(async () => (await statusOf(secured, token, admin)) === 'SUCCEEDED', 30_000, "the admin's call");
    const { page, errors } = await open(secured);
    await signIn(page, await jwt('ada', ['admin']));
    await shows(page, '[data-testid="succeeded-total"]', /^[1-9]\d*$/);
    await page.getByRole('button', { name: 'Sign out' }).click();
    await signIn(page, await jwt('nora'));
    await shows(page, '.who', 'nora · caller');
    await shows(page, '[data-testid="succeeded-total"]', /^0$/);
    await sleep(1000);
    assert.equal(await text(page, '[data-testid="succeeded-total"]'), '0');
    assert.deepEqual(errors.filter((e) => !/status of 401/.test(e)), []);
    await page.context().close();
  });

  it('shows a plain caller no cancel button nor queue settings, and the server refuses them anyway', async () => {
    const admin = { authorization: `Bearer ${await jwt('ada', ['admin'])}` };
    const plain = `Bearer ${await jwt('paul')}`;
    await gqlData(secured, 'mutation { configureQueue(input: { name: "grouped", concurrency: 2, groupCommits: { size: 20 } }) { queue { name } } }', {}, admin);
    const token = await invoke(secured, { procedure: 'demo.sleep', arguments: { seconds: 600 } }, admin);
    await waitFor(async () => (await statusOf(secured, token, admin)) === 'RUNNING', 30_000, 'the call running');
    try {
      // an operator sees the call and may cancel it
      const operator = await open(secured, '#/running');
      await signIn(operator.page, await jwt('olga', ['operator']));
      await operator.page.locator(`tr[data-token="${token}"]`).getByRole('button', { name: 'Cancel' }).waitFor();
      await operator.page.context().close();

      const { page } = await open(secured, '#/running');
      await signIn(page, plain);
      await shows(page, '.who', 'paul · caller');
      await shows(page, 'main.page', 'Nothing runs now');
      assert.equal(await page.getByRole('button', { name: 'Cancel' }).count(), 0);
      await page.goto(`${new URL(secured.url).origin}/dashboard/#/execution/${token}`);
      await shows(page, 'main.page', 'not yours to see');
      assert.equal(await page.getByRole('button', { name: 'Cancel' }).count(), 0);
      await page.goto(`${new URL(secured.url).origin}/dashboard/#/queues`);
      await page.locator('[data-queue="default"]').waitFor();
      assert.equal(await page.locator('[data-queue] input').count(), 0, 'no concurrency nor grouping field');
      await shows(page, '[data-queue="grouped"] [data-setting="groupCommits"]', /^20 calls \/ 50 ms$/);
      await shows(page, '[data-queue="default"] [data-setting="groupCommits"]', /^off$/);
      await shows(page, 'main.page', 'Only admins');
      assert.equal(await page.getByRole('button', { name: 'Pause' }).count(), 0, 'no Pause button');
      await page.context().close();

      assert.equal((await cancel(secured, token, { authorization: plain })).errors?.[0]?.extensions?.code, 'NOT_FOUND');
      const configure = await secured.gql('mutation { configureQueue(input: { name: "default", concurrency: 1 }) { queue { name } } }', {}, { authorization: plain });
      assert.equal(configure.body.errors?.[0]?.extensions?.code, 'FORBIDDEN');
      const pause = await secured.gql('mutation { pauseQueue(name: "default") { queue { paused } } }', {}, { authorization: plain });
      assert.equal(pause.body.errors?.[0]?.extensions?.code, 'FORBIDDEN');
      assert.equal((await gqlData(secured, '{ queues { name paused } }', {}, admin)).queues.find((q: { name: string }) => q.name === 'default').paused, false);
      assert.equal(await statusOf(secured, token, admin), 'RUNNING');
    } finally {
      await cancel(secured, token, admin);
    }
  });
});
