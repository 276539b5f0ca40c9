/** Every GraphQL example in the README runs, as pasted into GraphiQL, against the real service. */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { after, before, describe, it } from 'node:test';
import { collect, startTestApp, type TestApp } from './support/app.js';
import { startTestCluster, waitFor, type TestCluster } from './support/database.js';

const readme = readFileSync(new URL('../README.md', import.meta.url), 'utf8');
const examples = [...readme.matchAll(/```graphql\n([\s\S]*?)```/g)].map((m) => m[1]);

let cluster: TestCluster;
let t: TestApp;
let token: string;
let batchId: string;

before(async () => {
  cluster = await startTestCluster();
  t = await startTestApp(await cluster.createDatabase());
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

describe('README examples', () => {
  it('there are examples of queries, mutations and subscriptions', () => {
    assert.ok(examples.some((e) => /^\s*mutation/.test(e)));
    assert.ok(examples.some((e) => /^\s*(query|\{)/.test(e)));
    assert.ok(examples.some((e) => /^\s*subscription/.test(e)));
  });

  for (const [i, example] of examples.entries()) {
    const name = example.trim().split('\n')[0];
    it(`example ${i + 1}: ${name}`, async () => {
      const query = example.replaceAll('PUT-A-TOKEN-HERE', token).replaceAll('PUT-A-BATCH-ID-HERE', batchId);
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
