/**
 * Every example in the README runs as a reader would run it: the SQL blocks top to bottom
 * in one psql-like session (each block as one multi-statement query), the GraphQL ones as
 * pasted into GraphiQL, against the real service.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { after, before, describe, it } from 'node:test';
import { collect, startTestApp, type TestApp } from './support/app.js';
import { startTestCluster, waitFor, type TestCluster } from './support/database.js';

const readme = readFileSync(new URL('../README.md', import.meta.url), 'utf8');
const examples = [...readme.matchAll(/```graphql\n([\s\S]*?)```/g)].map((m) => m[1]);
const sqlExamples = [...readme.matchAll(/```sql\n([\s\S]*?)```/g)].map((m) => m[1]);

let cluster: TestCluster;
let databaseUrl: string;
let t: TestApp;
let token: string;
let batchId: string;

before(async () => {
  cluster = await startTestCluster();
  databaseUrl = await cluster.createDatabase();
  t = await startTestApp(databaseUrl);
  const { body } = await t.gql(`mutation { invoke(input: { procedure: "demo.add", arguments: { a: 1, b: 2 } }) { execution { token } } }`);
  token = body.data.invoke.execution.token;
  await waitFor(async () => (await t.gql(`{ execution(token: "${token}") { status } }`)).body.data.execution.status === 'SUCCEEDED');
  const batch = await t.gql(`mutation { submitBatch(input: { stages: [[{ procedure: "demo.noop" }], [{ procedure: "demo.noop" }]] }) { batch { id } } }`);
  batchId = batch.body.data.submitBatch.batch.id;
});
after(async () => {
  await t?.stop();
  await cluster?.stop();
});

describe('README SQL examples, top to bottom', () => {
  it('there are SQL examples, and the first one sets up what the others use', () => {
    assert.ok(sqlExamples.length >= 5, `${sqlExamples.length} SQL examples`);
  });

  it('each runs in order in one session, and the calls they enqueue succeed', async () => {
    const sql = await cluster.connect(databaseUrl);
    try {
      for (const [i, example] of sqlExamples.entries()) {
        await sql.query(example).catch((error: Error) => {
          throw new Error(`SQL example ${i + 1} (${example.trim().split('\n')[0]}): ${error.message}`);
        });
      }
      // what the examples enqueued ran: the orders were charged, and 43 invoiced after it (the batch's stages)
      const orders = await waitFor(async () => {
        const { rows } = await sql.query(`select id, charged_at is not null as charged, invoiced_at is not null as invoiced from billing.orders order by id`);
        return rows.length === 3 && rows[1].invoiced && rows[2].charged ? rows : null;
      }, 30_000, 'the README orders to be charged and invoiced');
      assert.deepEqual(orders, [
        { id: '42', charged: true, invoiced: false },
        { id: '43', charged: true, invoiced: true },
        { id: '44', charged: true, invoiced: false },
      ]);
      // 44's transaction ran twice with one idempotency key: one call
      const { rows: charges } = await sql.query(`select count(*)::int as n from asyncproc.executions where arguments ->> 'order_id' = '44'`);
      assert.equal(charges[0].n, 1);
      const greeted = await waitFor(async () => {
        const { rows } = await sql.query(`select status, result from asyncproc.executions where procedure = 'myapp.greet' order by id limit 1`);
        return rows[0]?.status === 'SUCCEEDED' ? rows[0] : null;
      }, 30_000, 'myapp.greet to run');
      // by the body of step 1, or of step 6 when it started after the CREATE OR REPLACE
      assert.match(greeted.result.outputParameters.greeting, /^(Hello|Hi), Ada$/);
    } finally {
      await sql.end();
    }
  });
});

describe('README examples', () => {
  it('there are examples of queries, mutations and subscriptions', () => {
    assert.ok(examples.some((e) => /^\s*mutation/.test(e)));
    assert.ok(examples.some((e) => /^\s*(query|\{)/.test(e)));
    assert.ok(examples.some((e) => /^\s*subscription/.test(e)));
  });

  for (const [i, example] of examples.entries()) {
    const name = example.trim().split('\n')[0];
    it(`example ${i + 1}: ${name}`, async () => {
      let query = example.replaceAll('PUT-A-TOKEN-HERE', token).replaceAll('PUT-A-BATCH-ID-HERE', batchId);
      if (query.includes('PUT-A-RUNNING-TOKEN-HERE')) {
        // a call that reports progress while the example watches (demo.sleep reports as it wakes)
        const running = await t.gql(`mutation { invoke(input: { procedure: "demo.sleep", arguments: { seconds: 1 } }) { execution { token } } }`);
        query = query.replaceAll('PUT-A-RUNNING-TOKEN-HERE', running.body.data.invoke.execution.token);
      }
      if (/^\s*subscription/.test(query)) {
        const events = collect(t.ws().iterate({ query }), 1);
        // a live stream needs something to happen once it is open
        setTimeout(() => void t.gql(`mutation { invoke(input: { procedure: "demo.sleep", arguments: { seconds: 0.1 } }) { execution { token } } }`), 300);
        const [first] = await events;
        assert.equal(first.errors, undefined, JSON.stringify(first.errors));
        assert.ok(first.data);
        return;
      }
      const { status, body } = await t.gql(query);
      assert.equal(status, 200);
      assert.equal(body.errors, undefined, JSON.stringify(body.errors));
      assert.ok(body.data);
    });
  }
});
