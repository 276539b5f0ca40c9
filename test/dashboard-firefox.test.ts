/**
 * A smoke test of the dashboard in Firefox (the issue asks for "a current Chromium and Firefox";
 * test/dashboard.test.ts covers Chromium in depth): Debian's Firefox ESR, driven over WebDriver BiDi
 * by puppeteer-core (Playwright's Firefox needs Playwright's own patched build), against the service
 * on a real PostgreSQL. It loads from the service alone under the strict policy, follows a call live
 * on the executions list, and invokes a procedure from its form.
 *
 * Skipped, saying so, only when /usr/bin/firefox-esr is absent (CI installs it: .ci/run).
 */
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import type pg from 'pg';
import puppeteer, { type Browser, type Page } from 'puppeteer-core';
import { startTestApp, type TestApp } from './support/app.js';
import { ensureDashboardBuilt } from './support/dashboard.js';
import { startTestCluster, waitFor, type TestCluster } from './support/database.js';

const FIREFOX = '/usr/bin/firefox-esr';
const skip = existsSync(FIREFOX) ? false : `no Firefox at ${FIREFOX}: apt-get install firefox-esr (as .ci/run does) to run the dashboard's Firefox smoke test`;

/**
 * Keep Firefox off the network: puppeteer-core already turns off updates, Safe Browsing and health reports;
 * these cover what it leaves on (telemetry, captive portal and connectivity checks, DNS over HTTPS, region and
 * geolocation look-ups, prefetching, and remote settings, whose server override a release build ignores without
 * MOZ_REMOTE_SETTINGS_DEVTOOLS), any of which stalls or slows a run on a closed network. Checked under strace:
 * with these, Firefox opens no connection and asks no DNS question beyond 127.0.0.1.
 */
const OFFLINE_PREFS: Record<string, unknown> = {
  'app.normandy.enabled': false,
  'app.shield.optoutstudies.enabled': false,
  'app.update.auto': false,
  'app.update.enabled': false,
  'browser.aboutwelcome.enabled': false,
  'browser.discovery.enabled': false,
  'browser.newtabpage.activity-stream.feeds.telemetry': false,
  'browser.newtabpage.activity-stream.telemetry': false,
  'browser.ping-centre.telemetry': false,
  'browser.region.network.url': '',
  'browser.region.update.enabled': false,
  'browser.safebrowsing.provider.google4.updateURL': '',
  'browser.safebrowsing.provider.mozilla.updateURL': '',
  'browser.topsites.contile.enabled': false,
  'datareporting.policy.firstRunURL': '',
  'extensions.blocklist.enabled': false,
  'extensions.systemAddon.update.enabled': false,
  'geo.provider.network.url': '',
  'identity.fxaccounts.enabled': false,
  'media.gmp-gmpopenh264.enabled': false,
  'messaging-system.rsexperimentloader.enabled': false,
  'network.captive-portal-service.enabled': false,
  'network.connectivity-service.enabled': false,
  'network.dns.disablePrefetch': true,
  'network.predictor.enabled': false,
  'network.prefetch-next': false,
  'network.trr.mode': 5,
  // remote settings (blocklists and the like): a release build takes this override only with MOZ_REMOTE_SETTINGS_DEVTOOLS=1 (below)
  'services.settings.server': 'data:,#remote-settings-dummy/v1',
  'toolkit.telemetry.archive.enabled': false,
  'toolkit.telemetry.enabled': false,
  'toolkit.telemetry.server': '',
  'toolkit.telemetry.unified': false,
  'toolkit.telemetry.updatePing.enabled': false,
};

let cluster: TestCluster;
let t: TestApp;
let databaseUrl: string;
let browser: Browser;
let profile: string;
let origin: string;

describe('the dashboard in Firefox', { skip }, () => {
  before(async () => {
    ensureDashboardBuilt();
    cluster = await startTestCluster();
    databaseUrl = await cluster.createDatabase();
    t = await startTestApp(databaseUrl);
    origin = new URL(t.url).origin;
    profile = await mkdtemp(path.join(tmpdir(), 'asyncproc-firefox-'));
    browser = await puppeteer.launch({
      browser: 'firefox',
      executablePath: FIREFOX,
      headless: true,
      userDataDir: profile,
      timeout: 60_000,
      protocolTimeout: 120_000,
      extraPrefsFirefox: OFFLINE_PREFS,
      // no crash reporter, no talking to an already running Firefox (the same account's, say), and the remote settings server above
      env: { ...process.env, MOZ_CRASHREPORTER_DISABLE: '1', MOZ_NO_REMOTE: '1', MOZ_REMOTE_SETTINGS_DEVTOOLS: '1' },
    });
  });
  after(async () => {
    await browser?.close();
    if (profile) await rm(profile, { recursive: true, force: true });
    await t?.stop();
    await cluster?.stop();
  });

  interface Opened {
    page: Page;
    /** Every URL the page requested. */
    requested: string[];
    /** What the service answered, by URL: status and content type. */
    answered: Map<string, { status: number; type: string | undefined }>;
    /** Console errors and uncaught exceptions (the page reports a CSP violation as a console error). */
    errors: string[];
  }

  /** A fresh browsing context (its own cookies and storage) on the dashboard; requests that leave the service are refused, as offline. */
  async function open(hash = ''): Promise<Opened> {
    const context = await browser.createBrowserContext();
    const page = await context.newPage();
    const opened: Opened = { page, requested: [], answered: new Map(), errors: [] };
    page.on('console', (message) => {
      if (message.type() === 'error') opened.errors.push(message.text());
    });
    page.on('pageerror', (error) => opened.errors.push(error instanceof Error ? error.message : String(error)));
    page.on('response', (response) => opened.answered.set(response.url(), { status: response.status(), type: response.headers()['content-type'] }));
    // Firefox writes CSP violations to its own console, not to the page's: the page's event reports them
    await page.evaluateOnNewDocument(() =>
      document.addEventListener('securitypolicyviolation', (e) => console.error(`CSP violation: ${e.violatedDirective} ${e.blockedURI}`)),
    );
    await page.setRequestInterception(true);
    page.on('request', (request) => {
      opened.requested.push(request.url());
      if (new URL(request.url()).origin === origin) void request.continue();
      else void request.abort('internetdisconnected');
    });
    await page.goto(`${origin}/dashboard/${hash}`, { timeout: 60_000 });
    return opened;
  }

  async function close({ page }: Opened) {
    await page.browserContext().close();
  }

  /** Wait until the first element matching `selector` shows the text (the page updating itself: nothing here reloads it). */
  async function shows(page: Page, selector: string, expected: RegExp | string, timeoutMs = 30_000) {
    const pattern = typeof expected === 'string' ? new RegExp(expected.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')) : expected;
    try {
      await page.waitForFunction(
        (sel: string, source: string, flags: string) => {
          const element = document.querySelector<HTMLElement>(sel);
          return !!element && new RegExp(source, flags).test(element.innerText.trim());
        },
        { timeout: timeoutMs, polling: 100 },
        selector,
        pattern.source,
        pattern.flags,
      );
    } catch (error) {
      const now = await page.evaluate((sel: string) => document.querySelector<HTMLElement>(sel)?.innerText.trim() ?? '(absent)', selector).catch(() => '(page gone)');
      throw new Error(`${selector} never showed ${pattern}; it shows: ${now}`, { cause: error });
    }
  }

  /** Marks the document; a reload or a navigation away from the page loses the mark. */
  const mark = (page: Page) => page.evaluate(() => void ((window as unknown as { mark: string }).mark = 'unchanged'));
  const marked = (page: Page) => page.evaluate(() => (window as unknown as { mark?: string }).mark);

  async function gqlData<T = any>(query: string, variables?: Record<string, unknown>): Promise<T> {
    const { body } = await t.gql<T>(query, variables);
    assert.equal(body.errors, undefined, JSON.stringify(body.errors));
    return body.data!;
  }

  const statusOf = async (token: string): Promise<string> => (await gqlData('query ($token: ID!) { execution(token: $token) { status } }', { token })).execution.status;

  /** Holds demo.ledger so that demo.record(tag) calls run until released: a call that is RUNNING for as long as the test wants. */
  async function holdLedger(): Promise<{ release(): Promise<void> }> {
    const client: pg.Client = await cluster.connect(databaseUrl);
    await client.query('begin');
    await client.query('lock table demo.ledger in access exclusive mode');
    let released = false;
    return {
      release: async () => {
        if (released) return;
        released = true;
        await client.query('commit');
        await client.end();
      },
    };
  }

  it('loads the overview with every asset from the service, under its policy, and follows the feed', async () => {
    const opened = await open();
    const { page, requested, answered, errors } = opened;
    // the page's scripts have run by its load event: a module script refused (a wrong type, the policy) shows here first
    const html = await (await fetch(`${origin}/dashboard/`)).text();
    const assets = [...html.matchAll(/<(?:script|link)\b[^>]*\b(?:src|href)="([^"]+)"/g)].map((m) => new URL(m[1]!, `${origin}/dashboard/`).href);
    const script = assets.find((a) => a.endsWith('.js'));
    const sheet = assets.find((a) => a.endsWith('.css'));
    assert.ok(script && sheet, assets.join(' '));
    assert.deepEqual(errors, [], 'no CSP violation nor error while loading');
    assert.match(answered.get(script)?.type ?? '(not loaded)', /^text\/javascript/, script);
    assert.match(answered.get(sheet)?.type ?? '(not loaded)', /^text\/css/, sheet);
    await page.waitForSelector('[data-queue="default"]', { timeout: 60_000 });
    await page.waitForSelector('.dot[data-live="true"]', { timeout: 30_000 });
    // every asset the page names (the icon comes after the load event), requested by Firefox and served by the service
    await waitFor(async () => assets.every((asset) => answered.has(asset)), 30_000, `answers for ${assets.join(' ')}; requested: ${requested.join(' ')}`);
    for (const asset of assets) assert.equal(answered.get(asset)?.status, 200, asset);
    assert.deepEqual(
      requested.filter((url) => new URL(url).origin !== origin),
      [],
      'requests that left the service',
    );
    // the style sheet applies (the policy allows it) and the app drew the overview's parts
    assert.notEqual(await page.evaluate(() => getComputedStyle(document.documentElement).getPropertyValue('--accent').trim()), '');
    assert.ok(await page.$('[data-testid="succeeded-total"]'), 'the throughput totals');
    assert.deepEqual(errors, []);
    await close(opened);
  });

  it('shows a call invoked through GraphQL on the executions list, live, until it turns SUCCEEDED', async () => {
    const ledger = await holdLedger();
    try {
      const opened = await open('#/executions');
      const { page, errors } = opened;
      await page.waitForSelector('.dot[data-live="true"]', { timeout: 30_000 });
      await shows(page, 'main.page section.card:nth-of-type(2) h2', /^Executions \(\d+\)$/);
      await mark(page);
      const { invoke } = await gqlData('mutation ($input: InvokeInput!) { invoke(input: $input) { execution { token } } }', {
        input: { procedure: 'demo.record', arguments: { tag: 'seen in Firefox' } },
      });
      const token: string = invoke.execution.token;
      const row = `tr[data-token="${token}"] [data-status]`;
      await shows(page, row, 'RUNNING');
      await ledger.release();
      await shows(page, row, 'SUCCEEDED');
      assert.equal(await statusOf(token), 'SUCCEEDED');
      assert.equal(await marked(page), 'unchanged', 'the list updated itself, without a reload');
      assert.deepEqual(errors, []);
      await close(opened);
    } finally {
      await ledger.release().catch(() => {});
    }
  });

  it("invokes a procedure from its form and shows the call's outcome on its page", async () => {
    const opened = await open('#/procedure/demo.add');
    const { page, errors } = opened;
    await page.locator('input[name="a"]').fill('19');
    await page.locator('input[name="b"]').fill('23');
    await page.locator('form.invoke button[type="submit"]').click();
    await page.waitForFunction(() => /^#\/execution\/[0-9a-f-]{36}$/.test(location.hash), { timeout: 30_000, polling: 100 });
    const token = /execution\/([0-9a-f-]{36})$/.exec(page.url())![1]!;
    await shows(page, '.facts [data-status]', 'SUCCEEDED');
    const { execution } = await gqlData('query ($token: ID!) { execution(token: $token) { procedure arguments status } }', { token });
    assert.deepEqual(execution, { procedure: 'demo.add', arguments: { a: 19, b: 23 }, status: 'SUCCEEDED' });
    // the arguments typed in and the output parameter the call returned
    const tables = await page.$$eval('table.kv', (found) => found.map((table) => (table as HTMLElement).innerText.replace(/\s+/g, ' ').trim()));
    assert.ok(tables.includes('a 19 b 23'), `arguments: ${tables.join(' | ')}`);
    await waitFor(async () => (await page.$$eval('table.kv', (found) => found.map((table) => (table as HTMLElement).innerText.replace(/\s+/g, ' ').trim()))).includes('total 42'), 30_000, 'the output parameter total 42');
    assert.deepEqual(errors, []);
    await close(opened);
  });
});
