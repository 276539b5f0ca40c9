/**
 * `npm run dashboard:screenshots`: the dashboard's main views, light and dark and at phone width, into
 * docs/dashboard-*.png, from the real service on a throwaway embedded PostgreSQL filled with work.
 */
import { mkdir } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import type { Page } from 'playwright-core';
import { startTestApp, type TestApp } from '../test/support/app.js';
import { launchChromium } from '../test/support/browser.js';
import { ensureDashboardBuilt } from '../test/support/dashboard.js';
import { sleep, startTestCluster, waitFor } from '../test/support/database.js';

const docs = fileURLToPath(new URL('../docs/', import.meta.url));

/** A procedure that reports its progress, for the live progress bars. */
const IMPORT = `
create or replace procedure demo.import_orders(batches integer default 400)
language plpgsql as $$
begin
  for i in 1..batches loop
    perform asyncproc.progress(100.0 * i / batches, format('batch %s of %s', i, batches));
    perform pg_sleep(0.5);
  end loop;
end $$;
select asyncproc.register('demo.import_orders(integer)', queue => 'imports');
`;

async function gql(t: TestApp, query: string, variables?: Record<string, unknown>) {
  const { body } = await t.gql(query, variables);
  if (body.errors) throw new Error(JSON.stringify(body.errors));
  return body.data;
}

const invoke = (t: TestApp, input: Record<string, unknown>) =>
  gql(t, 'mutation ($input: InvokeInput!) { invoke(input: $input) { execution { token } } }', { input }).then((d) => d.invoke.execution.token as string);

async function seed(t: TestApp, url: string, sql: (text: string) => Promise<unknown>) {
  for (const [name, concurrency] of [['imports', 2], ['reports', 2], ['billing', 8]] as const) {
    await gql(t, 'mutation ($input: ConfigureQueueInput!) { configureQueue(input: $input) { queue { name } } }', { input: { name, concurrency } });
  }
  await sql(IMPORT);
  // finished work spread over the last minute, so the charts have bars
  const now = Date.now();
  for (let i = 0; i < 40; i++) {
    const runAt = new Date(now + i * 1500).toISOString();
    if (i % 7 === 3) await invoke(t, { procedure: 'demo.fail', arguments: { message: 'insufficient funds on account 4471' }, runAt, queue: 'billing' });
    else await invoke(t, { procedure: 'demo.add', arguments: { a: i, b: 100 }, runAt, queue: 'billing' });
  }
  await invoke(t, { procedure: 'demo.fail', arguments: { message: 'duplicate key value violates unique constraint "orders_pkey"' }, maxAttempts: 2 });
  await invoke(t, { procedure: 'demo.import_orders', arguments: { batches: 400 } });
  await invoke(t, { procedure: 'demo.import_orders', arguments: { batches: 900 } });
  for (let i = 0; i < 4; i++) await invoke(t, { procedure: 'demo.sleep', arguments: { seconds: 900 + i }, queue: 'reports' });
  await invoke(t, { procedure: 'demo.sleep', arguments: { seconds: 600 } });
  await gql(t, 'mutation { createSchedule(input: { name: "nightly-ledger", procedure: "demo.record", arguments: { tag: "nightly" }, cron: "0 2 * * *", timezone: "Europe/Berlin" }) { schedule { name } } }');
  await gql(t, 'mutation { createSchedule(input: { name: "cleanup", procedure: "demo.noop", cron: "*/15 * * * *" }) { schedule { name } } }');
  await gql(t, 'mutation { pauseSchedule(name: "cleanup") { schedule { name } } }');
  void url;
}

async function shoot(page: Page, hash: string, file: string, ready: string) {
  await page.goto(`${new URL(page.url()).origin}/dashboard/${hash}`);
  await page.locator(ready).first().waitFor({ timeout: 30_000 });
  await sleep(800); // let the charts and ticking numbers settle for the picture
  await page.screenshot({ path: `${docs}${file}`, fullPage: true });
  console.log(`docs/${file}`);
}

async function main() {
  ensureDashboardBuilt();
  await mkdir(docs, { recursive: true });
  const cluster = await startTestCluster();
  const url = await cluster.createDatabase();
  const t = await startTestApp(url);
  const client = await cluster.connect(url);
  const browser = await launchChromium();
  try {
    await seed(t, url, (text) => client.query(text));
    // wait for the spread-out calls to end
    await waitFor(async () => (await gql(t, '{ queues { name pending waiting } }')).queues.find((q: { name: string; waiting: number; pending: number }) => q.name === 'billing').waiting === 0 || null, 120_000, 'billing calls done');
    await sleep(3000);
    const failed = (await gql(t, '{ executions(first: 1, filter: { procedure: "demo.fail", queue: "default" }) { nodes { token status } } }')).executions.nodes[0];
    await waitFor(async () => (await gql(t, `{ execution(token: "${failed.token}") { status } }`)).execution.status === 'FAILED', 60_000, 'the failing call');
    const batch = (
      await gql(
        t,
        `mutation { submitBatch(input: { stages: [
          [{ procedure: "demo.add", arguments: { a: 1, b: 1 } }, { procedure: "demo.add", arguments: { a: 2, b: 2 } }, { procedure: "demo.sleep", arguments: { seconds: 0.5 } }],
          [{ procedure: "demo.sleep", arguments: { seconds: 900 } }, { procedure: "demo.add", arguments: { a: 3, b: 3 } }, { procedure: "demo.sleep", arguments: { seconds: 1 } }],
          [{ procedure: "demo.record", arguments: { tag: "close books" } }, { procedure: "demo.noop" }]
        ] }) { batch { id } } }`,
      )
    ).submitBatch.batch.id as string;
    await sleep(3000);
    const running = (await gql(t, '{ running(first: 1, queue: "imports") { execution { token } } }')).running[0].execution.token as string;

    for (const scheme of ['light', 'dark'] as const) {
      const context = await browser.newContext({ viewport: { width: 1280, height: 820 }, colorScheme: scheme, deviceScaleFactor: 1 });
      const page = await context.newPage();
      await page.goto(`${new URL(t.url).origin}/dashboard/`);
      const suffix = scheme === 'dark' ? '-dark' : '';
      await shoot(page, '#/overview', `dashboard-overview${suffix}.png`, '[data-queue="billing"]');
      if (scheme === 'light') {
        await shoot(page, '#/running', 'dashboard-running.png', 'tr[data-token]');
        await shoot(page, '#/executions', 'dashboard-executions.png', 'tr[data-token]');
        await shoot(page, `#/execution/${failed.token}`, 'dashboard-execution-failed.png', '[data-testid="history"]');
        await shoot(page, `#/execution/${running}`, 'dashboard-execution-progress.png', '.progress');
        await shoot(page, `#/batch/${batch}`, 'dashboard-batch.png', '.stagebar');
        await shoot(page, '#/procedure/demo.date_parts', 'dashboard-invoke.png', 'form.invoke');
        await shoot(page, '#/schedules', 'dashboard-schedules.png', 'tr.paused');
      } else {
        await shoot(page, `#/batch/${batch}`, 'dashboard-batch-dark.png', '.stagebar');
      }
      await context.close();
    }
    const phone = await browser.newContext({ viewport: { width: 390, height: 844 }, colorScheme: 'dark', deviceScaleFactor: 2, isMobile: true, hasTouch: true });
    const page = await phone.newPage();
    await page.goto(`${new URL(t.url).origin}/dashboard/`);
    await shoot(page, '#/running', 'dashboard-phone.png', 'tr[data-token]');
    await phone.close();
  } finally {
    // everything not ended, waiting and pending ones first: none starts while the running ones are stopped
    const open = await gql(t, '{ executions(first: 500, filter: { status: [WAITING, PENDING, RUNNING] }) { nodes { token status } } }');
    const nodes = (open.executions.nodes as { token: string; status: string }[]).sort((a, b) => Number(a.status === 'RUNNING') - Number(b.status === 'RUNNING'));
    for (const { token } of nodes) await t.gql('mutation ($token: ID!) { cancelExecution(token: $token) { execution { token } } }', { token });
    await browser.close();
    await client.end();
    await t.stop();
    await cluster.stop();
  }
}

await main();
