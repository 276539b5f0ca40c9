/** GraphQL end to end: the real server over HTTP, graphql-ws and SSE, on a real PostgreSQL. */
import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import WebSocket from 'ws';
import { after, before, describe, it } from 'node:test';
import { printedSchema } from '../src/schema/index.js';
import { collect, startTestApp, type TestApp } from './support/app.js';
import { startTestCluster, waitFor, type TestCluster } from './support/database.js';

const EXECUTION = `token procedure arguments queue status attempts submittedAt startedAt finishedAt submittedBy worker sessionId
  error { number message } result { returnValue outputParameters rows }`;

let cluster: TestCluster;
let t: TestApp;

before(async () => {
  cluster = await startTestCluster();
  t = await startTestApp(await cluster.createDatabase(), {
    ASYNCPROC_MAX_BODY_BYTES: '20000',
    ASYNCPROC_MAX_CALLS: '5',
    ASYNCPROC_MAX_ARGUMENT_BYTES: '1000',
  });
});
after(async () => {
  await t?.stop();
  await cluster?.stop();
});

async function total(filter: Record<string, unknown> = {}): Promise<number> {
  const { body } = await t.gql(`query($f: ExecutionFilter) { executions(filter: $f) { totalCount } }`, { f: filter });
  return body.data.executions.totalCount;
}

async function invoke(input: Record<string, unknown>, headers?: Record<string, string>) {
  return t.gql(`mutation($input: InvokeInput!) { invoke(input: $input) { execution { ${EXECUTION} } } }`, { input }, headers);
}

async function finished(token: string) {
  return waitFor(async () => {
    const { body } = await t.gql(`query($t: ID!) { execution(token: $t) { ${EXECUTION} } }`, { t: token });
    const e = body.data?.execution;
    return e && ['SUCCEEDED', 'FAILED', 'CANCELLED'].includes(e.status) ? e : null;
  });
}

/** A GraphQL error with this code, answered with HTTP 200 (or 413), and nothing enqueued. */
async function expectCode(code: string, run: () => Promise<{ status: number; body: any }>, status = 200) {
  const before = await total();
  const { status: httpStatus, body } = await run();
  assert.equal(httpStatus, status, JSON.stringify(body));
  assert.ok(body.errors?.length, `expected errors, got ${JSON.stringify(body)}`);
  assert.equal(body.errors[0].extensions?.code, code, JSON.stringify(body.errors));
  assert.ok(body.errors[0].message.length > 0);
  assert.equal(await total(), before, 'nothing enqueued');
  return body.errors[0];
}

describe('queries and mutations over HTTP', () => {
  it('invoke returns the token at once; the execution runs and its outcome is queryable', async () => {
    const { status, body } = await invoke({ procedure: 'demo.add', arguments: { a: 20, b: 22 } }, { 'x-asyncproc-user': 'spa-user' });
    assert.equal(status, 200);
    const submitted = body.data.invoke.execution;
    assert.match(submitted.token, /^[0-9a-f-]{36}$/);
    assert.equal(submitted.procedure, 'demo.add');
    assert.deepEqual(submitted.arguments, { a: 20, b: 22 });
    assert.equal(submitted.queue, 'default');
    assert.equal(submitted.submittedBy, 'spa-user');
    const done = await finished(submitted.token);
    assert.equal(done.status, 'SUCCEEDED');
    assert.deepEqual(done.result.outputParameters, { total: 42 });
    assert.equal(done.attempts, 1);
    assert.ok(Date.parse(done.startedAt) <= Date.parse(done.finishedAt));
  });

  it('a failing call is FAILED with its error', async () => {
    const { body } = await invoke({ procedure: 'demo.fail', arguments: { message: 'kaput' } });
    const done = await finished(body.data.invoke.execution.token);
    assert.equal(done.status, 'FAILED');
    assert.equal(done.error.message, 'kaput');
    assert.equal(done.error.number, 'P0001');
  });

  it('invokeMany submits all in one transaction, or nothing', async () => {
    const ok = await t.gql(`mutation($i: [InvokeInput!]!) { invokeMany(inputs: $i) { executions { token status } } }`, {
      i: [
        { procedure: 'demo.add', arguments: { a: 1, b: 2 } },
        { procedure: 'demo.record', arguments: { tag: 'many' } },
      ],
    });
    assert.equal(ok.body.data.invokeMany.executions.length, 2);
    await expectCode('INVALID_ARGUMENTS', () =>
      t.gql(`mutation($i: [InvokeInput!]!) { invokeMany(inputs: $i) { executions { token } } }`, {
        i: [
          { procedure: 'demo.record', arguments: { tag: 'never' } },
          { procedure: 'demo.add', arguments: { a: 'x', b: 2 } },
        ],
      }),
    );
  });

  it('executions: a Relay connection, newest first, filtered, with totalCount', async () => {
    const tokens: string[] = [];
    for (let i = 0; i < 3; i++) tokens.push((await invoke({ procedure: 'demo.record', arguments: { tag: `page-${i}` } })).body.data.invoke.execution.token);
    const { body } = await t.gql(`{ executions(first: 2, filter: { procedure: "demo.record" }) {
      totalCount edges { cursor node { token procedure } } pageInfo { hasNextPage hasPreviousPage startCursor endCursor } } }`);
    const conn = body.data.executions;
    assert.ok(conn.totalCount >= 3);
    assert.deepEqual(conn.edges.map((e: any) => e.node.token), [tokens[2], tokens[1]]);
    assert.ok(conn.edges.every((e: any) => e.node.procedure === 'demo.record'));
    assert.equal(conn.pageInfo.hasNextPage, true);
    const next = await t.gql(`query($a: String) { executions(first: 1, after: $a, filter: { procedure: "demo.record" }) { edges { node { token } } pageInfo { hasPreviousPage } } }`, {
      a: conn.pageInfo.endCursor,
    });
    assert.equal(next.body.data.executions.edges[0].node.token, tokens[0]);
    assert.equal(next.body.data.executions.pageInfo.hasPreviousPage, true);
    const failed = await t.gql(`{ executions(filter: { status: [FAILED] }) { edges { node { status } } } }`);
    assert.ok(failed.body.data.executions.edges.every((e: any) => e.node.status === 'FAILED'));
  });

  it('procedures and queues describe what can be invoked and where', async () => {
    const { body } = await t.gql(`{ procedures { name queue maxAttempts parameters { name type mode hasDefault position } } queues { name concurrency pending running } }`);
    const add = body.data.procedures.find((p: any) => p.name === 'demo.add');
    assert.deepEqual(add.parameters, [
      { name: 'a', type: 'integer', mode: 'IN', hasDefault: false, position: 1 },
      { name: 'b', type: 'integer', mode: 'IN', hasDefault: false, position: 2 },
      { name: 'total', type: 'integer', mode: 'OUT', hasDefault: false, position: 3 },
    ]);
    const queue = body.data.queues.find((q: any) => q.name === 'default');
    assert.equal(queue.concurrency, 10);
    assert.equal(typeof queue.pending, 'number');
  });

  it('GraphiQL is served on /graphql to a browser', async () => {
    const response = await fetch(t.url, { headers: { accept: 'text/html' } });
    assert.equal(response.status, 200);
    assert.match(await response.text(), /graphiql/i);
  });
});

describe('bad input: a coded error, never a 500, nothing enqueued', () => {
  it('UNKNOWN_PROCEDURE', () => expectCode('UNKNOWN_PROCEDURE', () => invoke({ procedure: 'demo.nope' })));
  it('UNKNOWN_PROCEDURE for a routine that exists but is not registered', () =>
    expectCode('UNKNOWN_PROCEDURE', () => invoke({ procedure: 'pg_catalog.pg_sleep', arguments: { seconds: 1 } })));
  it('INVALID_ARGUMENTS: wrong type, unknown key, missing parameter, not an object', async () => {
    const error = await expectCode('INVALID_ARGUMENTS', () => invoke({ procedure: 'demo.add', arguments: { a: 'x', b: 1, z: 1 } }));
    assert.match(error.message, /"a"/);
    assert.match(error.message, /"z"/);
    await expectCode('INVALID_ARGUMENTS', () => invoke({ procedure: 'demo.add', arguments: { a: 1 } }));
    await expectCode('INVALID_ARGUMENTS', () => invoke({ procedure: 'demo.add', arguments: [1, 2] }));
    await expectCode('INVALID_ARGUMENTS', () => invoke({ procedure: 'demo.add', arguments: 'a=1' }));
  });
  it('UNKNOWN_QUEUE', () => expectCode('UNKNOWN_QUEUE', () => invoke({ procedure: 'demo.add', arguments: { a: 1, b: 1 }, queue: 'nowhere' })));
  it('BAD_USER_INPUT: a malformed token or cursor', async () => {
    await expectCode('BAD_USER_INPUT', () => t.gql(`{ execution(token: "not-a-token") { token } }`));
    await expectCode('BAD_USER_INPUT', () => t.gql(`{ executions(after: "x'; --") { totalCount } }`));
  });
  it('an unknown token reads as null', async () => {
    const { body } = await t.gql(`{ execution(token: "00000000-0000-4000-8000-000000000000") { token } }`);
    assert.equal(body.data.execution, null);
    assert.equal(body.errors, undefined);
  });
  it('PAYLOAD_TOO_LARGE: too large a body, too many calls, too large arguments', async () => {
    await expectCode('PAYLOAD_TOO_LARGE', () => invoke({ procedure: 'demo.record', arguments: { tag: 'x'.repeat(30_000) } }), 413);
    await expectCode('PAYLOAD_TOO_LARGE', () => invoke({ procedure: 'demo.record', arguments: { tag: 'x'.repeat(2000) } }));
    await expectCode('PAYLOAD_TOO_LARGE', () =>
      t.gql(`mutation($i: [InvokeInput!]!) { invokeMany(inputs: $i) { executions { token } } }`, {
        i: Array.from({ length: 6 }, () => ({ procedure: 'demo.noop' })),
      }),
    );
    // a schedule's arguments, which each firing submits: refused at create and at update, not at every fire
    await expectCode('PAYLOAD_TOO_LARGE', () =>
      t.gql(`mutation($a: JSON!) { createSchedule(input: { name: "too-large", procedure: "demo.record", arguments: $a, cron: "0 * * * *" }) { schedule { name } } }`, {
        a: { tag: 'x'.repeat(2000) },
      }),
    );
    assert.equal((await t.gql(`{ schedule(name: "too-large") { name } }`)).body.data.schedule, null, 'not created');
    await t.gql(`mutation { createSchedule(input: { name: "small", procedure: "demo.record", arguments: { tag: "x" }, cron: "0 * * * *" }) { schedule { name } } }`);
    await expectCode('PAYLOAD_TOO_LARGE', () =>
      t.gql(`mutation($a: JSON!) { updateSchedule(name: "small", input: { arguments: $a }) { schedule { name } } }`, { a: { tag: 'x'.repeat(2000) } }),
    );
    assert.deepEqual((await t.gql(`{ schedule(name: "small") { arguments } }`)).body.data.schedule.arguments, { tag: 'x' }, 'unchanged');
    await t.gql(`mutation { deleteSchedule(name: "small") { schedule { name } } }`);
  });
  it('a submission shares its mutation operation with no other field: refused before anything runs, so no committed call loses its token (HTTP, graphql-ws)', async () => {
    const refused = await expectCode('BAD_USER_INPUT', () =>
      t.gql(`mutation { a: invoke(input: { procedure: "demo.noop" }) { execution { token } } b: invoke(input: { procedure: "demo.nope" }) { execution { token } } }`),
    );
    assert.match(refused.message, /invoke, invoke must be the only field of its mutation operation/);
    // aliases of invokeMany would multiply ASYNCPROC_MAX_CALLS (5 here)
    const aliases = await expectCode('BAD_USER_INPUT', () =>
      t.gql(`mutation($i: [InvokeInput!]!) { ${Array.from({ length: 20 }, (_, n) => `a${n}: invokeMany(inputs: $i) { executions { token } }`).join(' ')} }`, {
        i: Array.from({ length: 5 }, () => ({ procedure: 'demo.noop' })),
      }),
    );
    assert.match(aliases.message, /this one has 20/);
    // beside another mutation, through a fragment, and the secret of a new key
    const fragment = await expectCode('BAD_USER_INPUT', () =>
      t.gql(`mutation { ...Both } fragment Both on Mutation { submitBatch(input: { stages: [[{ procedure: "demo.noop" }]] }) { batch { id } } configureQueue(input: { name: "one-field", concurrency: 2 }) { queue { name } } }`),
    );
    assert.match(fragment.message, /^submitBatch must be the only field/);
    assert.equal((await t.gql(`{ queues { name } }`)).body.data.queues.some((q: { name: string }) => q.name === 'one-field'), false, 'the other field did not run either');
    const keys = (await t.gql(`{ apiKeys { id } }`)).body.data?.apiKeys?.length;
    const twoKeys = await t.gql(`mutation { a: createApiKey(input: { name: "one-a", roles: [] }) { secret } b: createApiKey(input: { name: "one-b", roles: [] }) { secret } }`);
    assert.match(twoKeys.body.errors?.[0]?.message ?? '', /^createApiKey, createApiKey must be the only field/, JSON.stringify(twoKeys.body));
    assert.equal(typeof keys, 'number');
    assert.equal((await t.gql(`{ apiKeys { id } }`)).body.data.apiKeys.length, keys, 'no key created');
    const ws = t.ws();
    const overSocket = await collect(ws.iterate({ query: `mutation { a: invoke(input: { procedure: "demo.noop" }) { execution { token } } b: invokeMany(inputs: [{ procedure: "demo.noop" }]) { executions { token } } }` }));
    assert.match((overSocket[0] as any).errors?.[0]?.message ?? '', /^invoke, invokeMany must be the only field/, JSON.stringify(overSocket));

    // what still may share an operation: one submission left by @include/@skip, and other mutations together
    const before = await total();
    const chosen = await t.gql(
      `mutation($first: Boolean!) { a: invoke(input: { procedure: "demo.noop" }) @include(if: $first) { execution { token } } b: invoke(input: { procedure: "demo.noop" }) @skip(if: $first) { execution { token } } }`,
      { first: true },
    );
    assert.equal(chosen.body.errors, undefined, JSON.stringify(chosen.body.errors));
    assert.ok(chosen.body.data.a.execution.token);
    assert.equal(await total(), before + 1);
    // a variable not sent takes its declared default, as execution reads it (it was refused: "not provided a runtime value")
    const defaulted = await t.gql(
      `mutation($first: Boolean! = false) { a: invoke(input: { procedure: "demo.noop" }) @include(if: $first) { execution { token } } b: invoke(input: { procedure: "demo.noop" }) @skip(if: $first) { execution { token } } }`,
    );
    assert.equal(defaulted.body.errors, undefined, JSON.stringify(defaulted.body.errors));
    assert.ok(defaulted.body.data.b.execution.token);
    assert.equal(await total(), before + 2);
    // variables that do not coerce: execution's own error, with nothing run
    const wrong = await t.gql(
      `mutation($first: Boolean!) { a: invoke(input: { procedure: "demo.noop" }) @include(if: $first) { execution { token } } b: invoke(input: { procedure: "demo.noop" }) @skip(if: $first) { execution { token } } }`,
      { first: 'yes' },
    );
    assert.match(wrong.body.errors?.[0]?.message ?? '', /Variable "\$first" got invalid value/, JSON.stringify(wrong.body));
    assert.equal(await total(), before + 2);
    const queues = await t.gql(`mutation { a: configureQueue(input: { name: "one-field-a", concurrency: 1 }) { queue { name } } b: configureQueue(input: { name: "one-field-b", concurrency: 1 }) { queue { name } } }`);
    assert.equal(queues.body.errors, undefined, JSON.stringify(queues.body.errors));
    await ws.dispose();
  });

  it('a number beyond a double (1e400) is BAD_USER_INPUT, in a literal or a variable, never stored as null', async () => {
    await expectCode('BAD_USER_INPUT', () => t.gql(`mutation { invoke(input: { procedure: "demo.add", arguments: { a: 1e400, b: 1 } }) { execution { token } } }`));
    await expectCode('BAD_USER_INPUT', () => t.gql(`mutation { invoke(input: { procedure: "demo.add", arguments: { a: ${'9'.repeat(400)}, b: 1 } }) { execution { token } } }`));
    // JSON.stringify cannot write it: the body is sent as text, as any client may
    await expectCode('BAD_USER_INPUT', async () => {
      const response = await fetch(t.url, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: `{"query": "mutation($a: JSON!) { invoke(input: { procedure: \\"demo.add\\", arguments: { a: $a, b: 1 } }) { execution { token } } }", "variables": {"a": -1e400}}`,
      });
      return { status: response.status, body: await response.json() };
    });
    // a literal a double holds only rounded: it reached the procedure as 9007199254740992, or 0.30000000000000004 as 0.3
    for (const literal of ['9007199254740993', '0.300000000000000000001', '123456789.123456789123']) {
      const rounded = await t.gql(`mutation { invoke(input: { procedure: "demo.echo_money", arguments: { amount: ${literal} } }) { execution { token } } }`);
      assert.equal(rounded.body.errors?.[0]?.extensions?.code, 'BAD_USER_INPUT', literal);
      assert.match(rounded.body.errors[0].message, /would be rounded .*send it as a string/, literal);
    }
    // as a string it arrives exact
    const exact = await t.gql(`mutation { invoke(input: { procedure: "demo.echo_money", arguments: { amount: "123456789.1234" } }) { execution { token } } }`);
    assert.equal(exact.body.errors, undefined, JSON.stringify(exact.body.errors));
    // one a double holds goes through, intact: here to the procedure's own check (a is an integer)
    const large = await t.gql(`mutation { invoke(input: { procedure: "demo.add", arguments: { a: 1e300, b: 1 } }) { execution { token } } }`);
    assert.equal(large.body.errors?.[0]?.extensions?.code, 'INVALID_ARGUMENTS', JSON.stringify(large.body.errors));
    assert.match(large.body.errors[0].message, /1000000000000000000000/);
  });

  it('with auth off, an x-asyncproc-user that a database would not store as sent (NUL, a lone surrogate, too long) is refused at connect, not an internal error', async () => {
    const init = (user: string) =>
      new Promise<{ ack: boolean; code?: number }>((resolve, reject) => {
        const socket = new WebSocket(t.url.replace(/^http/, 'ws'), 'graphql-transport-ws');
        socket.on('open', () => socket.send(JSON.stringify({ type: 'connection_init', payload: { 'x-asyncproc-user': user } })));
        socket.on('message', (data) => {
          if (JSON.parse(String(data)).type === 'connection_ack') {
            resolve({ ack: true });
            socket.close();
          }
        });
        socket.on('close', (code) => resolve({ ack: false, code }));
        socket.on('error', reject);
      });
    for (const user of ['a\u0000b', 'me\ud800', 'x'.repeat(257)]) assert.deepEqual(await init(user), { ack: false, code: 4403 }, JSON.stringify(user).slice(0, 40));
    assert.equal((await init('spa-user')).ack, true);
    const long = await invoke({ procedure: 'demo.noop' }, { 'x-asyncproc-user': 'y'.repeat(257) });
    assert.equal(long.status, 401, JSON.stringify(long.body));
  });

  it('a variable that is not of its type is BAD_USER_INPUT (HTTP and graphql-ws), not an error without a code', async () => {
    const query = `mutation($n: Int!) { invoke(input: { procedure: "demo.noop", maxAttempts: $n }) { execution { token } } }`;
    for (const n of ['3', 2 ** 31, 1.5]) await expectCode('BAD_USER_INPUT', () => t.gql(query, { n }), 400);
    await expectCode('BAD_USER_INPUT', () => t.gql(query, {}), 400);
    await expectCode('BAD_USER_INPUT', () => t.gql(`mutation($r: DateTime) { invoke(input: { procedure: "demo.noop", runAt: $r }) { execution { token } } }`, { r: '2024-02-30T00:00:00Z' }), 400);
    const ws = t.ws();
    const [result] = await collect(ws.iterate({ query: `subscription($t: ID!) { executionCompleted(token: $t) { status } }`, variables: { t: 5.5 } }));
    assert.equal((result as any).errors?.[0]?.extensions?.code, 'BAD_USER_INPUT', JSON.stringify(result));
    await ws.dispose();
  });

  it('a malformed query is a GraphQL error, not a 500', async () => {
    const { status, body } = await t.gql(`{ executions( }`);
    assert.ok(status < 500);
    assert.ok(body.errors!.length);
  });
});

describe('queues, delayed runs, retries and the execution log', () => {
  it('configureQueue creates and changes a queue; invoke can pick it; bad input is BAD_USER_INPUT', async () => {
    const configure = (name: string, concurrency: number) =>
      t.gql(`mutation($i: ConfigureQueueInput!) { configureQueue(input: $i) { queue { name concurrency pending running waiting } } }`, {
        i: { name, concurrency },
      });
    const { body } = await configure('reports', 2);
    assert.deepEqual(body.data.configureQueue.queue, { name: 'reports', concurrency: 2, pending: 0, running: 0, waiting: 0 });
    assert.equal((await configure('reports', 4)).body.data.configureQueue.queue.concurrency, 4);
    await expectCode('BAD_USER_INPUT', () => configure('bad name!', 2));
    await expectCode('BAD_USER_INPUT', () => configure('reports', 0));
    const queues = (await t.gql(`{ queues { name concurrency } }`)).body.data.queues;
    assert.deepEqual(queues.find((q: any) => q.name === 'reports'), { name: 'reports', concurrency: 4 });
    const invoked = await invoke({ procedure: 'demo.add', arguments: { a: 1, b: 1 }, queue: 'reports' });
    assert.equal(invoked.body.data.invoke.execution.queue, 'reports');
  });

  it('runAt keeps a call WAITING until due; maxAttempts retries with every attempt in history', async () => {
    const runAt = new Date(Date.now() + 1500).toISOString();
    const delayed = await t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { token status runAt } } }`, {
      i: { procedure: 'demo.add', arguments: { a: 1, b: 2 }, runAt },
    });
    assert.equal(delayed.body.data.invoke.execution.status, 'WAITING');
    assert.equal(delayed.body.data.invoke.execution.runAt, runAt);
    const retried = await invoke({ procedure: 'demo.fail', arguments: { message: 'twice' }, maxAttempts: 2 });
    const done = await finished(delayed.body.data.invoke.execution.token);
    assert.ok(Date.parse(done.startedAt) >= Date.parse(runAt));
    const failed = await waitFor(async () => {
      const { body } = await t.gql(`query($t: ID!) { execution(token: $t) { status attempts maxAttempts
        history { number status startedAt finishedAt worker sessionId error { number message } } } }`, {
        t: retried.body.data.invoke.execution.token,
      });
      return body.data.execution.status === 'FAILED' ? body.data.execution : null;
    }, 20_000);
    assert.equal(failed.attempts, 2);
    assert.equal(failed.maxAttempts, 2);
    assert.deepEqual(failed.history.map((a: any) => [a.number, a.status, a.error.message]), [
      [1, 'FAILED', 'twice'],
      [2, 'FAILED', 'twice'],
    ]);
    assert.ok(failed.history.every((a: any) => a.worker && a.sessionId));
    await expectCode('INVALID_ARGUMENTS', () => invoke({ procedure: 'demo.add', arguments: { a: 1, b: 1 }, maxAttempts: 0 }));
  });
});

describe('cancelExecution', () => {
  it('cancels a running call; its subscriber hears CANCELLED; finished, unknown and malformed tokens are refused', async () => {
    const { body } = await invoke({ procedure: 'demo.sleep', arguments: { seconds: 30 } });
    const token = body.data.invoke.execution.token;
    await waitFor(async () => (await t.gql(`{ execution(token: "${token}") { status } }`)).body.data.execution.status === 'RUNNING');
    const completion = collect(t.ws().iterate({ query: `subscription { executionCompleted(token: "${token}") { status } }` }));
    const cancelled = await t.gql(`mutation($t: ID!) { cancelExecution(token: $t) { execution { status finishedAt error { number } } } }`, { t: token });
    assert.equal(cancelled.body.data.cancelExecution.execution.status, 'CANCELLED');
    assert.equal(cancelled.body.data.cancelExecution.execution.error.number, '57014');
    assert.deepEqual((await completion).map((r) => r.data), [{ executionCompleted: { status: 'CANCELLED' } }]);
    const cancel = (t2: string) => () => t.gql(`mutation($t: ID!) { cancelExecution(token: $t) { execution { status } } }`, { t: t2 });
    await expectCode('ALREADY_FINISHED', cancel(token));
    await expectCode('NOT_FOUND', cancel('00000000-0000-4000-8000-000000000000'));
    await expectCode('BAD_USER_INPUT', cancel('abc'));
  });
});

const BATCH = `id batchId status onFailure currentStage stageCount submittedBy submittedAt finishedAt total succeeded failed cancelled
  stages { stage total waiting pending running succeeded failed cancelled }
  executions { nodes { token procedure status stage startedAt finishedAt batch { id } } }`;

function submitBatch(input: Record<string, unknown>, headers?: Record<string, string>) {
  return t.gql(`mutation($input: SubmitBatchInput!) { submitBatch(input: $input) { batch { ${BATCH} } } }`, { input }, headers);
}

describe('batches and monitoring', () => {
  it('submitBatch runs stages in order; batch(id) reports stages and executions; batchCompleted fires once', async () => {
    const { status, body } = await submitBatch(
      {
        stages: [
          [
            { procedure: 'demo.sleep', arguments: { seconds: 0.4 } },
            { procedure: 'demo.sleep', arguments: { seconds: 0.4 } },
          ],
          [{ procedure: 'demo.add', arguments: { a: 2, b: 3 } }],
        ],
      },
      { 'x-asyncproc-user': 'batch-user' },
    );
    assert.equal(status, 200, JSON.stringify(body));
    const submitted = body.data.submitBatch.batch;
    assert.match(submitted.batchId, /^[0-9a-f-]{36}$/);
    assert.equal(Buffer.from(submitted.id, 'base64').toString(), `Batch:${submitted.batchId}`, 'id: the global id');
    assert.equal(submitted.status, 'RUNNING');
    assert.equal(submitted.onFailure, 'CANCEL');
    assert.equal(submitted.submittedBy, 'batch-user');
    assert.deepEqual([submitted.stageCount, submitted.currentStage, submitted.total], [2, 1, 3]);
    assert.deepEqual(submitted.executions.nodes.map((e: any) => [e.stage, e.batch.id]), [
      [1, submitted.id],
      [1, submitted.id],
      [2, submitted.id],
    ]);
    assert.equal(submitted.executions.nodes[2].status, 'WAITING', 'stage 2 is held');

    const query = `subscription($id: ID!) { batchCompleted(id: $id) { id status finishedAt succeeded } }`;
    const live = await collect(t.ws().iterate({ query, variables: { id: submitted.id } }));
    assert.equal(live.length, 1, 'one event, then the stream ends');
    assert.equal((live[0].data as any).batchCompleted.status, 'SUCCEEDED');
    assert.equal((live[0].data as any).batchCompleted.succeeded, 3);

    const { body: read } = await t.gql(`query($id: ID!) { batch(id: $id) { ${BATCH} } }`, { id: submitted.id });
    const batch = read.data.batch;
    assert.equal(batch.status, 'SUCCEEDED');
    assert.equal(batch.currentStage, 2);
    assert.deepEqual(batch.stages.map((s: any) => [s.stage, s.total, s.succeeded]), [
      [1, 2, 2],
      [2, 1, 1],
    ]);
    const stageOneEnd = Math.max(...batch.executions.nodes.filter((e: any) => e.stage === 1).map((e: any) => Date.parse(e.finishedAt)));
    assert.ok(Date.parse(batch.executions.nodes[2].startedAt) >= stageOneEnd, 'stage 2 started after stage 1 ended');

    // a batch that ended before the subscription still delivers (graphql-ws and SSE)
    for (const client of [t.ws(), t.sse()]) {
      const late = await collect(client.iterate({ query, variables: { id: submitted.id } }));
      assert.deepEqual(late.map((r) => (r.data as any).batchCompleted.status), ['SUCCEEDED']);
    }
  });

  it('a failing stage cancels the rest; CONTINUE runs them; subscribers hear the end', async () => {
    const stages = [[{ procedure: 'demo.fail', arguments: { message: 'stage one' } }], [{ procedure: 'demo.add', arguments: { a: 1, b: 1 } }]];
    const cancelled = (await submitBatch({ stages })).body.data.submitBatch.batch;
    const continued = (await submitBatch({ stages, onFailure: 'CONTINUE' })).body.data.submitBatch.batch;
    const query = `subscription($id: ID!) { batchCompleted(id: $id) { status executions { nodes { stage status } } } }`;
    const [a, b] = await Promise.all([cancelled, continued].map((batch) => collect(t.sse().iterate({ query, variables: { id: batch.id } }))));
    assert.deepEqual((a[0].data as any).batchCompleted, {
      status: 'FAILED',
      executions: {
        nodes: [
          { stage: 1, status: 'FAILED' },
          { stage: 2, status: 'CANCELLED' },
        ],
      },
    });
    assert.deepEqual((b[0].data as any).batchCompleted, {
      status: 'FAILED',
      executions: {
        nodes: [
          { stage: 1, status: 'FAILED' },
          { stage: 2, status: 'SUCCEEDED' },
        ],
      },
    });
  });

  it('submitBatch refuses bad input as a whole, with its code', async () => {
    const mutation = (input: Record<string, unknown>) => () => submitBatch(input);
    await expectCode('INVALID_ARGUMENTS', mutation({ stages: [[{ procedure: 'demo.record', arguments: { tag: 'never' } }], [{ procedure: 'demo.add', arguments: { a: 'x', b: 1 } }]] }));
    await expectCode('UNKNOWN_PROCEDURE', mutation({ stages: [[{ procedure: 'demo.record', arguments: { tag: 'never' } }], [{ procedure: 'demo.nope' }]] }));
    await expectCode('UNKNOWN_QUEUE', mutation({ stages: [[{ procedure: 'demo.record', arguments: { tag: 'never' }, queue: 'nowhere' }]] }));
    await expectCode('BAD_USER_INPUT', mutation({ stages: [] }));
    await expectCode('BAD_USER_INPUT', mutation({ stages: [[{ procedure: 'demo.record', arguments: { tag: 'never' } }], []] }));
    const six = Array.from({ length: 3 }, () => ({ procedure: 'demo.record', arguments: { tag: 'never' } }));
    await expectCode('PAYLOAD_TOO_LARGE', mutation({ stages: [six, six] }));
    const error = await expectCode(
      'GRAPHQL_VALIDATION_FAILED',
      () => t.gql(`mutation { submitBatch(input: { stages: [[{ procedure: "demo.noop" }]], onFailure: SOMETIMES }) { batch { id } } }`),
      400,
    );
    assert.match(error.message, /SOMETIMES/);
  });

  it('cancelBatch cancels what has not started and stops what runs; codes for ended, unknown and malformed ids', async () => {
    const { body } = await submitBatch({
      stages: [[{ procedure: 'demo.sleep', arguments: { seconds: 30 } }], [{ procedure: 'demo.record', arguments: { tag: 'never-batch' } }]],
    });
    const id = body.data.submitBatch.batch.id;
    const token = body.data.submitBatch.batch.executions.nodes[0].token;
    await waitFor(async () => (await t.gql(`{ execution(token: "${token}") { status } }`)).body.data.execution.status === 'RUNNING');
    const completion = collect(t.ws().iterate({ query: `subscription($id: ID!) { batchCompleted(id: $id) { status } }`, variables: { id } }));
    const cancel = (batchId: string) => () => t.gql(`mutation($id: ID!) { cancelBatch(id: $id) { batch { status cancelled executions { nodes { status } } } } }`, { id: batchId });
    const { body: cancelled } = await cancel(id)();
    assert.deepEqual(cancelled.data.cancelBatch.batch, { status: 'CANCELLED', cancelled: 2, executions: { nodes: [{ status: 'CANCELLED' }, { status: 'CANCELLED' }] } });
    assert.deepEqual((await completion).map((r) => r.data), [{ batchCompleted: { status: 'CANCELLED' } }]);
    await expectCode('ALREADY_FINISHED', cancel(id));
    await expectCode('NOT_FOUND', cancel('00000000-0000-4000-8000-000000000000'));
    await expectCode('BAD_USER_INPUT', cancel('batch-1'));
  });

  it('batch(id): null for an unknown id, BAD_USER_INPUT for a malformed one; batchCompleted: NOT_FOUND and BAD_USER_INPUT', async () => {
    const unknown = '00000000-0000-4000-8000-000000000000';
    assert.equal((await t.gql(`query($id: ID!) { batch(id: $id) { id } }`, { id: unknown })).body.data.batch, null);
    await expectCode('BAD_USER_INPUT', () => t.gql(`{ batch(id: "not-a-uuid") { id } }`));
    for (const [id, code] of [
      [unknown, 'NOT_FOUND'],
      ['nope', 'BAD_USER_INPUT'],
    ]) {
      const results = await collect(t.ws().iterate({ query: `subscription($id: ID!) { batchCompleted(id: $id) { id } }`, variables: { id } })).catch(
        (errors) => [{ errors }],
      );
      assert.equal((results[0] as any).errors[0].extensions.code, code, JSON.stringify(results));
    }
    const { body } = await invoke({ procedure: 'demo.add', arguments: { a: 1, b: 1 } });
    const token = body.data.invoke.execution.token;
    const single = await t.gql(`query($t: ID!) { execution(token: $t) { stage batch { id } } }`, { t: token });
    assert.deepEqual(single.body.data.execution, { stage: null, batch: null }, 'a call on its own has no batch');
  });

  it('running lists what runs now with elapsed time; queues report recent outcomes', async () => {
    const queue = `mon-${Date.now()}`;
    await t.gql(`mutation($q: String!) { configureQueue(input: { name: $q, concurrency: 2 }) { queue { name } } }`, { q: queue });
    const slow = (await invoke({ procedure: 'demo.sleep', arguments: { seconds: 1.5 }, queue })).body.data.invoke.execution.token;
    await waitFor(async () => (await t.gql(`{ execution(token: "${slow}") { status } }`)).body.data.execution.status === 'RUNNING');
    const { body } = await t.gql(`query($q: String) { running(queue: $q) { elapsedMs execution { token worker sessionId startedAt } } }`, { q: queue });
    assert.equal(body.data.running.length, 1);
    assert.equal(body.data.running[0].execution.token, slow);
    assert.ok(body.data.running[0].execution.worker && body.data.running[0].execution.sessionId);
    assert.ok(body.data.running[0].elapsedMs >= 0 && body.data.running[0].elapsedMs < 10_000);
    const failing = (await invoke({ procedure: 'demo.fail', arguments: { message: 'counted' }, queue })).body.data.invoke.execution.token;
    await finished(slow);
    await finished(failing);
    const queues = await t.gql(`{ queues { name pending running recentSeconds recent { succeeded failed cancelled } } }`);
    const mine = queues.body.data.queues.find((q: any) => q.name === queue);
    assert.deepEqual(mine, { name: queue, pending: 0, running: 0, recentSeconds: 3600, recent: { succeeded: 1, failed: 1, cancelled: 0 } });
    await expectCode('BAD_USER_INPUT', () => t.gql(`{ queues(recentSeconds: 0) { name } }`));
    await expectCode('BAD_USER_INPUT', () => t.gql(`{ running(first: 0) { elapsedMs } }`));
  });
});

describe('subscriptions', () => {
  it('executionCompleted over graphql-ws: one event when it finishes, then the stream ends', async () => {
    const { body } = await invoke({ procedure: 'demo.sleep', arguments: { seconds: 0.5 } });
    const token = body.data.invoke.execution.token;
    const results = await collect(t.ws().iterate({ query: `subscription($t: ID!) { executionCompleted(token: $t) { token status finishedAt } }`, variables: { t: token } }));
    assert.equal(results.length, 1);
    assert.equal((results[0].data as any).executionCompleted.token, token);
    assert.equal((results[0].data as any).executionCompleted.status, 'SUCCEEDED');
  });

  it('executionCompleted after the execution already finished still delivers it (graphql-ws and SSE)', async () => {
    const { body } = await invoke({ procedure: 'demo.add', arguments: { a: 1, b: 1 } });
    const token = body.data.invoke.execution.token;
    await finished(token);
    const query = `subscription($t: ID!) { executionCompleted(token: $t) { status result { outputParameters } } }`;
    for (const client of [t.ws(), t.sse()]) {
      const results = await collect(client.iterate({ query, variables: { t: token } }));
      assert.equal(results.length, 1);
      assert.deepEqual((results[0].data as any).executionCompleted, { status: 'SUCCEEDED', result: { outputParameters: { total: 2 } } });
    }
  });

  it('executionCompleted over SSE while the call runs', async () => {
    const { body } = await invoke({ procedure: 'demo.fail', arguments: { message: 'sse-fail' } });
    const token = body.data.invoke.execution.token;
    const results = await collect(t.sse().iterate({ query: `subscription($t: ID!) { executionCompleted(token: $t) { status error { message } } }`, variables: { t: token } }));
    assert.deepEqual(results.map((r) => r.data), [{ executionCompleted: { status: 'FAILED', error: { message: 'sse-fail' } } }]);
  });

  it('executionCompleted: NOT_FOUND for an unknown token, BAD_USER_INPUT for a malformed one', async () => {
    for (const [token, code] of [
      ['00000000-0000-4000-8000-000000000000', 'NOT_FOUND'],
      ['nope', 'BAD_USER_INPUT'],
    ]) {
      const results = await collect(t.ws().iterate({ query: `subscription($t: ID!) { executionCompleted(token: $t) { status } }`, variables: { t: token } })).catch((errors) => [{ errors }]);
      const errors = (results[0] as any).errors;
      assert.equal(errors[0].extensions.code, code, JSON.stringify(errors));
    }
  });

  it('executionEvents: status changes live (each event as its execution was then), then a replay from a cursor', async () => {
    const filter = { procedure: 'demo.sleep' };
    const query = `subscription($f: ExecutionFilter, $after: String) { executionEvents(filter: $f, after: $after) { cursor status execution { token procedure status } } }`;
    const live = t.ws().iterate({ query, variables: { f: filter } });
    const seen: any[] = [];
    const reading = (async () => {
      for await (const result of live) {
        seen.push((result.data as any).executionEvents);
        if (seen.some((e) => e.status === 'SUCCEEDED')) break;
      }
    })();
    await new Promise((resolve) => setTimeout(resolve, 300)); // let the subscription start
    const token = (await invoke({ procedure: 'demo.sleep', arguments: { seconds: 0.5 } })).body.data.invoke.execution.token;
    await invoke({ procedure: 'demo.add', arguments: { a: 1, b: 2 } }); // filtered out
    await reading;
    const statuses = seen.map((e) => e.status);
    // a state replaced before the feed was read is skipped (PENDING lasts a millisecond); RUNNING lasts half a second
    assert.ok(['PENDING,RUNNING,SUCCEEDED', 'RUNNING,SUCCEEDED'].includes(statuses.join()), statuses.join());
    assert.ok(seen.every((e) => e.execution.token === token && e.execution.procedure === 'demo.sleep'));
    assert.ok(seen.every((e) => e.execution.status === e.status), 'an event describes its own moment');
    const filterRecord = { procedure: 'demo.record' };

    // while nobody listens, two more calls finish; a client resuming from its cursor gets them
    const cursor = seen.at(-1).cursor;
    const missed = [
      (await invoke({ procedure: 'demo.record', arguments: { tag: 'missed-1' } })).body.data.invoke.execution.token,
      (await invoke({ procedure: 'demo.record', arguments: { tag: 'missed-2' } })).body.data.invoke.execution.token,
    ];
    for (const m of missed) await finished(m);
    const replayed = await collect(t.ws().iterate({ query, variables: { f: filterRecord, after: cursor } }), 2);
    // in the order they ended, which two worker slots need not keep
    assert.deepEqual(
      replayed.map((r) => [(r.data as any).executionEvents.execution.token, (r.data as any).executionEvents.status]).sort(),
      missed.map((m) => [m, 'SUCCEEDED']).sort(),
    );
  });
});

describe('schema', () => {
  it('schema/schema.graphql is what the code prints', async () => {
    const onDisk = await readFile(new URL('../schema/schema.graphql', import.meta.url), 'utf8');
    assert.equal(onDisk, printedSchema(), 'run `npm run schema:print` and commit schema/schema.graphql');
  });
});
