/**
 * Idempotency keys (InvokeInput.idempotencyKey, 0018_idempotency_keys.sql): a caller that cannot
 * tell whether its call was submitted sends it again with the same key, and exactly one execution
 * exists whatever happened to the first answer. Real signed tokens, real HTTP, two service
 * instances on one real PostgreSQL, and callers' own transactions racing on one key.
 */
import assert from 'node:assert/strict';
import { connect } from 'node:net';
import { after, before, describe, it } from 'node:test';
import { SignJWT } from 'jose';
import type pg from 'pg';
import { createPostgresEngine, type PostgresEngine } from '../src/engines/postgres/index.js';
import { EngineError, isReplayed } from '../src/engine.js';
import { startTestApp, type TestApp } from './support/app.js';
import { capturingLogger } from './support/logs.js';
import { startTestCluster, waitFor, type TestCluster } from './support/database.js';

const SECRET = 'a-test-secret-of-at-least-thirty-two-characters';
const AUTH = { ASYNCPROC_JWT_SECRET: SECRET, ASYNCPROC_RATE_LIMIT: '10000' };
const bearer = async (sub: string) => ({
  authorization: `Bearer ${await new SignJWT({}).setProtectedHeader({ alg: 'HS256' }).setSubject(sub).setIssuedAt().setExpirationTime('10m').sign(new TextEncoder().encode(SECRET))}`,
});

let cluster: TestCluster;
let url: string;
let sql: pg.Client;
let engine: PostgresEngine;
let one: TestApp;
let two: TestApp;
let alice: Record<string, string>;
let bob: Record<string, string>;

before(async () => {
  cluster = await startTestCluster();
  url = await cluster.createDatabase();
  one = await startTestApp(url, AUTH);
  two = await startTestApp(url, AUTH);
  engine = createPostgresEngine({ connectionString: url });
  sql = await cluster.connect(url);
  alice = await bearer('alice');
  bob = await bearer('bob');
});
after(async () => {
  await sql?.end();
  await engine?.close();
  await one?.stop();
  await two?.stop();
  await cluster?.stop();
});

const INVOKE = 'mutation($i: InvokeInput!) { invoke(input: $i) { execution { token status submittedBy } replayed } }';
async function invoke(app: TestApp, headers: Record<string, string>, input: Record<string, unknown>) {
  const { status, body } = await app.gql(INVOKE, { i: { procedure: 'demo.add', arguments: { a: 1, b: 2 }, ...input } }, headers);
  return {
    status,
    token: body.data?.invoke?.execution?.token as string | undefined,
    replayed: body.data?.invoke?.replayed as boolean | undefined,
    code: body.errors?.[0]?.extensions?.code as string | undefined,
    body,
  };
}
/**
 * A request sent again while it is answered IDEMPOTENCY_KEY_IN_USE, for up to 5 s, as a client does.
 * A refusal reaches the service when the database reports it, a moment before that transaction's
 * abort lets go of the key's lock (node-pg rejects at the ErrorResponse, not at ReadyForQuery): a
 * request right after a refusal can find the key still held. A key held for good fails.
 */
async function untilNotInUse<T extends { code?: string }>(send: () => Promise<T>): Promise<T> {
  for (const deadline = Date.now() + 5000; ; await new Promise((resolve) => setTimeout(resolve, 20))) {
    const answer = await send();
    if (answer.code !== 'IDEMPOTENCY_KEY_IN_USE' || Date.now() > deadline) return answer;
  }
}
/** Executions holding `key` (any caller's). */
const holding = async (key: string) =>
  (await sql.query<{ token: string; submitted_by: string | null }>('select token::text, submitted_by from asyncproc.executions where idempotency_key = $1 order by id', [key])).rows;
const executions = async () => Number((await sql.query('select count(*) as n from asyncproc.executions')).rows[0].n);

describe('an idempotency key', () => {
  it('sent again with the same call returns the first execution and submits nothing, however many times and on whichever instance', async () => {
    const first = await invoke(one, alice, { idempotencyKey: 'order-1' });
    assert.equal(first.status, 200);
    assert.ok(first.token, JSON.stringify(first.body));
    assert.equal(first.replayed, false);
    // it runs to its end meanwhile: a replay answers with the execution as it is now
    const ended = await waitFor(async () => {
      const { rows } = await sql.query('select status from asyncproc.executions where token = $1', [first.token]);
      return rows[0]?.status === 'SUCCEEDED' && rows[0].status;
    });
    for (const app of [one, two, one]) {
      const again = await invoke(app, alice, { idempotencyKey: 'order-1' });
      assert.equal(again.token, first.token);
      assert.equal(again.replayed, true, 'the answer says nothing was submitted');
      assert.equal(again.body.data.invoke.execution.status, ended);
    }
    // the same key twice in one request: one execution for both
    const many = () =>
      one.gql(
        'mutation($i: [InvokeInput!]!) { invokeMany(inputs: $i) { executions { token } replayed } }',
        { i: [1, 2].map(() => ({ procedure: 'demo.add', arguments: { a: 5, b: 5 }, idempotencyKey: 'order-2' })) },
        alice,
      );
    const { body } = await many();
    const [a, b] = body.data.invokeMany.executions.map((e: { token: string }) => e.token);
    assert.equal(a, b);
    // made by this request: neither is a replay
    assert.deepEqual(body.data.invokeMany.replayed, [false, false]);
    assert.deepEqual((await many()).body.data.invokeMany.replayed, [true, true]);
    assert.deepEqual((await holding('order-1')).map((r) => r.token), [first.token]);
    assert.deepEqual((await holding('order-2')).map((r) => r.token), [a]);
  });

  it("a replay is told apart: the library's isReplayed, and the log says replayed, not submitted", async () => {
    const client = await cluster.connect(url);
    try {
      await client.query('begin');
      const made = await engine.invoke(client, { procedure: 'demo.noop', arguments: {}, submittedBy: 'svc', idempotencyKey: 'told-1' });
      assert.equal(isReplayed(made), false);
      // in the same transaction, a later statement: the call this transaction made
      assert.equal(isReplayed(await engine.invoke(client, { procedure: 'demo.noop', arguments: {}, submittedBy: 'svc', idempotencyKey: 'told-1' })), true);
      await client.query('commit');
    } finally {
      await client.end();
    }
    const [again] = await engine.submit([{ procedure: 'demo.noop', arguments: {}, submittedBy: 'svc', idempotencyKey: 'told-1' }]);
    assert.equal(isReplayed(again), true);
    assert.equal(isReplayed((await engine.getExecution(again.token))!), false, 'a read is not a replay');
    const { logger, lines } = capturingLogger('info');
    const logged = await startTestApp(url, AUTH, logger);
    try {
      for (let i = 0; i < 2; i++) assert.ok((await invoke(logged, alice, { idempotencyKey: 'told-2' })).token);
      const mine = lines.filter((l) => l.by === 'alice' && (l.msg === 'execution submitted' || l.msg === 'execution replayed'));
      assert.deepEqual(mine.map((l) => l.msg), ['execution submitted', 'execution replayed']);
    } finally {
      await logged.stop();
    }
  });

  it('sent with another call is refused (IDEMPOTENCY_KEY_REUSED), naming the execution it made, and nothing is written', async () => {
    const first = await invoke(one, alice, { idempotencyKey: 'order-3' });
    const before = await executions();
    for (const other of [{ arguments: { a: 1, b: 3 } }, { procedure: 'demo.noop', arguments: {} }, { maxAttempts: 3 }, { runAt: new Date(Date.now() + 60_000).toISOString() }, { queue: 'default' }]) {
      const refused = await untilNotInUse(() => invoke(two, alice, { idempotencyKey: 'order-3', ...other }));
      assert.equal(refused.status, 200);
      assert.equal(refused.code, 'IDEMPOTENCY_KEY_REUSED', `${JSON.stringify(other)}: ${JSON.stringify(refused.body)}`);
      assert.match(refused.body.errors?.[0]?.message, new RegExp(first.token!));
    }
    // two calls of one request with one key: refused whole, without naming an execution that is rolled back with it
    const twice = await one.gql(
      'mutation($i: [InvokeInput!]!) { invokeMany(inputs: $i) { executions { token } } }',
      { i: [{ a: 1, b: 1 }, { a: 2, b: 2 }].map((args) => ({ procedure: 'demo.add', arguments: args, idempotencyKey: 'order-3b' })) },
      alice,
    );
    assert.equal(twice.body.errors?.[0]?.extensions?.code, 'IDEMPOTENCY_KEY_REUSED', JSON.stringify(twice.body));
    assert.match(twice.body.errors[0].message, /two different calls in one transaction/);
    assert.doesNotMatch(twice.body.errors[0].message, /[0-9a-f]{8}-[0-9a-f]{4}-/);
    // the same JSON with its keys in another order is the same call
    assert.equal((await invoke(one, alice, { idempotencyKey: 'order-3', arguments: { b: 2, a: 1 } })).token, first.token);
    assert.equal(await executions(), before);
  });

  it("is the caller's own: another caller's same key makes another execution, and learns nothing of the first", async () => {
    const mine = await invoke(one, alice, { idempotencyKey: 'shared-name' });
    const theirs = await invoke(one, bob, { idempotencyKey: 'shared-name', arguments: { a: 7, b: 7 } });
    assert.ok(theirs.token && theirs.token !== mine.token, JSON.stringify(theirs.body));
    assert.deepEqual((await holding('shared-name')).map((r) => r.submitted_by), ['alice', 'bob']);
  });

  it('malformed, or on a batch call, is refused with BAD_USER_INPUT and writes nothing', async () => {
    const before = await executions();
    for (const key of ['', 'x'.repeat(129), 'tab\there', 'nul\u0000', 'half\ud800']) {
      const refused = await invoke(one, alice, { idempotencyKey: key });
      assert.equal(refused.code, 'BAD_USER_INPUT', `${JSON.stringify(key)}: ${JSON.stringify(refused.body)}`);
    }
    assert.ok((await invoke(one, alice, { idempotencyKey: 'ü'.repeat(128) })).token, '128 characters are taken');
    const batch = await one.gql(
      'mutation($s: [[InvokeInput!]!]!) { submitBatch(input: { stages: $s }) { batch { id } } }',
      { s: [[{ procedure: 'demo.noop', idempotencyKey: 'batch-1' }]] },
      alice,
    );
    assert.equal(batch.body.errors?.[0]?.extensions?.code, 'BAD_USER_INPUT', JSON.stringify(batch.body));
    await assert.rejects(engine.submitBatch([[{ procedure: 'demo.noop', arguments: {}, idempotencyKey: 'batch-2' }]]), { code: 'BAD_USER_INPUT' });
    // a plain SQL caller of invoke_batch is refused by the database itself
    await assert.rejects(sql.query(`select asyncproc.invoke_batch('[[{"procedure": "demo.noop", "idempotencyKey": "batch-3"}]]')`), { code: 'AP004' });
    assert.equal(await executions(), before + 1);
    assert.equal(Number((await sql.query('select count(*) as n from asyncproc.batches')).rows[0].n), 0);
  });

  it('held by a client whose connection dropped before the answer: its retry gets the call the first request committed', async () => {
    const body = JSON.stringify({ query: INVOKE, variables: { i: { procedure: 'demo.add', arguments: { a: 2, b: 2 }, idempotencyKey: 'dropped-1' } } });
    const { port } = new URL(one.url);
    // the whole request, then the socket reset at once: the client never reads an answer
    await new Promise<void>((resolve, reject) => {
      const socket = connect(Number(port), '127.0.0.1', () => {
        socket.write(
          `POST /graphql HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\nContent-Type: application/json\r\nAuthorization: ${alice.authorization}\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`,
          () => setTimeout(() => (socket.resetAndDestroy(), resolve()), 5),
        );
      });
      socket.on('error', reject);
    });
    // the service committed it though the client left (what the client cannot know)
    const [committed] = await waitFor(async () => {
      const rows = await holding('dropped-1');
      return rows.length > 0 && rows;
    }, 10_000, 'the dropped request to commit');
    const retried = await invoke(two, alice, { idempotencyKey: 'dropped-1', arguments: { a: 2, b: 2 } });
    assert.equal(retried.token, committed.token);
    assert.equal((await holding('dropped-1')).length, 1);
  });

  it('sent by 40 requests at once to two instances makes exactly one execution: each request gets its token, or IDEMPOTENCY_KEY_IN_USE while another holds the key and then its token', async (t) => {
    let inUse = 0;
    const answers = await Promise.all(
      Array.from({ length: 40 }, async (_, i) => {
        for (;;) {
          const answer = await invoke(i % 2 ? one : two, alice, { idempotencyKey: 'race-1' });
          if (answer.code !== 'IDEMPOTENCY_KEY_IN_USE') return answer;
          inUse++;
          await new Promise((resolve) => setTimeout(resolve, 5));
        }
      }),
    );
    const tokens = new Set(answers.map((a) => a.token));
    assert.equal(tokens.size, 1, JSON.stringify(answers.map((a) => a.body).filter((b) => b.errors)));
    assert.deepEqual((await holding('race-1')).map((r) => r.token), [...tokens]);
    t.diagnostic(`${inUse} answers of IDEMPOTENCY_KEY_IN_USE before the tokens`);
  });

  it("held by a caller's open transaction: the service refuses it at once (IDEMPOTENCY_KEY_IN_USE) and nobody else waits; another caller's transaction waits for it, then gets its call if it commits, or makes its own if it rolls back", async () => {
    for (const outcome of ['commit', 'rollback'] as const) {
      const key = `tx-${outcome}`;
      const [first, second] = [await cluster.connect(url), await cluster.connect(url)];
      try {
        await first.query('begin');
        const mine = await engine.invoke(first, { procedure: 'demo.noop', arguments: {}, submittedBy: 'alice', idempotencyKey: key });
        // the same key over GraphQL, refused at once; calls without a key on the same instances go
        // on (one statement waiting for the key froze them all)
        assert.equal((await invoke(one, alice, { procedure: 'demo.noop', arguments: {}, idempotencyKey: key })).code, 'IDEMPOTENCY_KEY_IN_USE');
        const others = await Promise.race([
          Promise.all([one, two, one, two].map((app) => invoke(app, bob, {}))),
          new Promise<never>((_, reject) => setTimeout(() => reject(new Error('calls without a key waited for the held one')), 10_000)),
        ]);
        assert.ok(others.every((o) => o.token), JSON.stringify(others.map((o) => o.body)));
        // a caller's own transaction waits for it, as for a row lock (a procedure a worker runs
        // cannot pause and send again)
        await second.query('begin');
        let settled = false;
        const waiting = engine.invoke(second, { procedure: 'demo.noop', arguments: {}, submittedBy: 'alice', idempotencyKey: key }).finally(() => (settled = true));
        await new Promise((resolve) => setTimeout(resolve, 300));
        assert.equal(settled, false, 'the second transaction waits for the first');
        await first.query(outcome);
        const theirs = await waiting;
        await second.query('commit');
        if (outcome === 'commit') assert.equal(theirs.token, mine.token);
        else assert.notEqual(theirs.token, mine.token);
        assert.equal((await invoke(two, alice, { procedure: 'demo.noop', arguments: {}, idempotencyKey: key })).token, theirs.token);
        assert.deepEqual((await holding(key)).map((r) => r.token), [theirs.token]);
      } finally {
        await first.end();
        await second.end();
      }
    }
  });

  it("a key refused as in use is transient for the engine: a library caller's retry on isTransient sends it again", async () => {
    const client = await cluster.connect(url);
    try {
      await client.query('begin');
      await engine.invoke(client, { procedure: 'demo.noop', arguments: {}, submittedBy: 'carol', idempotencyKey: 'transient-1' });
      const refused = await engine.submit([{ procedure: 'demo.noop', arguments: {}, submittedBy: 'carol', idempotencyKey: 'transient-1' }]).catch((e: unknown) => e);
      assert.ok(refused instanceof EngineError && refused.code === 'IDEMPOTENCY_KEY_IN_USE', String(refused));
      assert.equal(engine.isTransient(refused), true);
      assert.equal(engine.isTransient(new EngineError('IDEMPOTENCY_KEY_REUSED', 'x')), false, 'another call under the key is not');
      await client.query('commit');
    } finally {
      await client.end();
    }
  });

  it("refused in a caller's transaction leaves that transaction usable, and the SQL interface (invoke_once) keeps its keys too", async () => {
    const client = await cluster.connect(url);
    try {
      await client.query('begin');
      const first = await engine.invoke(client, { procedure: 'demo.noop', arguments: {}, submittedBy: 'svc', idempotencyKey: 'lib-1' });
      const refused = await engine.invoke(client, { procedure: 'demo.add', arguments: { a: 1, b: 1 }, submittedBy: 'svc', idempotencyKey: 'lib-1' }).catch((e: unknown) => e);
      assert.ok(refused instanceof EngineError && refused.code === 'IDEMPOTENCY_KEY_REUSED', String(refused));
      await client.query('commit');
      assert.deepEqual((await holding('lib-1')).map((r) => r.token), [first.token]);
    } finally {
      await client.end();
    }
    const once = async (key: string | null, a = 1) =>
      (await sql.query(`select asyncproc.invoke_once($1, 'demo.add', jsonb_build_object('a', $2::int, 'b', 1), submitted_by => 'svc') as t`, [key, a])).rows[0].t;
    const token = await once('sql-1');
    assert.equal(await once('sql-1'), token);
    await assert.rejects(once('sql-1', 2), { code: 'AP012' });
    await assert.rejects(once(null), { code: 'AP004' }, 'invoke_once takes a key');
    // the same key of the library's caller 'svc' is one scope with the SQL caller's 'svc'
    assert.deepEqual((await holding('sql-1')).map((r) => r.token), [token]);
  });

  it('is freed by retention with its execution: sent after the purge, it makes a new one', async () => {
    const first = await invoke(one, alice, { idempotencyKey: 'kept-1' });
    await waitFor(async () => (await sql.query('select 1 from asyncproc.executions where token = $1 and finished_at is not null', [first.token])).rowCount);
    assert.equal((await invoke(one, alice, { idempotencyKey: 'kept-1' })).token, first.token, 'held while its execution is kept');
    assert.ok((await engine.purge(0)) >= 1);
    const after = await invoke(one, alice, { idempotencyKey: 'kept-1' });
    assert.ok(after.token && after.token !== first.token, JSON.stringify(after.body));
    assert.deepEqual((await holding('kept-1')).map((r) => r.token), [after.token]);
  });
});

describe("a batch's idempotency key (SubmitBatchInput.idempotencyKey, 0020_batch_idempotency_keys.sql)", () => {
  const SUBMIT = 'mutation($i: SubmitBatchInput!) { submitBatch(input: $i) { batch { id status stageCount } replayed } }';
  /** The batch's id as the database keeps it (GraphQL's is a global id, `Batch:<uuid>` in base64url; either is taken). */
  const uuidOf = (id: string | undefined) => (id ? Buffer.from(id, 'base64url').toString().split(':')[1] : undefined);
  async function submitBatch(app: TestApp, headers: Record<string, string>, input: Record<string, unknown>) {
    const { status, body } = await app.gql(SUBMIT, { i: input }, headers);
    return { status, id: uuidOf(body.data?.submitBatch?.batch?.id), code: body.errors?.[0]?.extensions?.code as string | undefined, body };
  }
  /** Two stages of demo.record calls, tagged `${name}-a`, `-b` (stage 1) and `-c` (stage 2). */
  const stages = (name: string) => [
    [
      { procedure: 'demo.record', arguments: { tag: `${name}-a` } },
      { procedure: 'demo.record', arguments: { tag: `${name}-b` } },
    ],
    [{ procedure: 'demo.record', arguments: { tag: `${name}-c` } }],
  ];
  const batchesHolding = async (key: string) =>
    (await sql.query<{ id: string; submitted_by: string | null }>('select id::text, submitted_by from asyncproc.batches where idempotency_key = $1 order by submitted_at', [key])).rows;
  const batches = async () => Number((await sql.query('select count(*) as n from asyncproc.batches')).rows[0].n);
  /** How many times each call tagged `${name}-…` ran. */
  const ran = async (name: string) =>
    Object.fromEntries((await sql.query<{ tag: string; n: number }>(`select tag, count(*)::int as n from demo.ledger where tag like $1 || '-%' group by tag order by tag`, [name])).rows.map((r) => [r.tag, r.n]));

  it('sent again with the same batch returns the first batch and submits nothing, on whichever instance; each call runs once', async () => {
    const first = await submitBatch(one, alice, { stages: stages('bk1'), idempotencyKey: 'batch-key-1' });
    assert.ok(first.id, JSON.stringify(first.body));
    await waitFor(async () => (await sql.query(`select status from asyncproc.batches where id = $1`, [first.id])).rows[0].status === 'SUCCEEDED', 30_000, 'the batch to end');
    const count = await executions();
    assert.equal(first.body.data.submitBatch.replayed, false);
    for (const app of [two, one, two]) {
      const again = await submitBatch(app, alice, { stages: stages('bk1'), idempotencyKey: 'batch-key-1' });
      assert.equal(again.id, first.id, JSON.stringify(again.body));
      assert.equal(again.body.data.submitBatch.batch.status, 'SUCCEEDED');
      assert.equal(again.body.data.submitBatch.replayed, true);
    }
    assert.equal(await executions(), count, 'nothing submitted by the replays');
    assert.deepEqual(await ran('bk1'), { 'bk1-a': 1, 'bk1-b': 1, 'bk1-c': 1 });
    assert.equal((await batchesHolding('batch-key-1')).length, 1);
  });

  it('sent with another batch, or another onFailure, is refused (IDEMPOTENCY_KEY_REUSED) naming the first batch, and nothing is written', async () => {
    const first = await submitBatch(one, alice, { stages: stages('bk2'), idempotencyKey: 'batch-key-2' });
    assert.ok(first.id, JSON.stringify(first.body));
    const [count, made] = [await executions(), await batches()];
    for (const input of [
      { stages: stages('bk2-other'), idempotencyKey: 'batch-key-2' },
      { stages: stages('bk2'), onFailure: 'CONTINUE', idempotencyKey: 'batch-key-2' },
      { stages: [stages('bk2')[0]], idempotencyKey: 'batch-key-2' },
    ]) {
      const refused = await untilNotInUse(() => submitBatch(two, alice, input));
      assert.equal(refused.code, 'IDEMPOTENCY_KEY_REUSED', JSON.stringify(refused.body));
      assert.match(refused.body.errors?.[0]?.message, new RegExp(first.id!));
    }
    assert.equal(await executions(), count);
    assert.equal(await batches(), made);
  });

  it("is apart from single calls' keys, and the caller's own: the same key on an invoke, and another caller's, make their own", async () => {
    const batch = await submitBatch(one, alice, { stages: stages('bk3'), idempotencyKey: 'shared-3' });
    const call = await invoke(one, alice, { idempotencyKey: 'shared-3' });
    const bobs = await submitBatch(two, bob, { stages: stages('bk3'), idempotencyKey: 'shared-3' });
    assert.ok(batch.id && call.token && bobs.id, JSON.stringify([batch.body, call.body, bobs.body]));
    assert.notEqual(bobs.id, batch.id);
    assert.deepEqual((await batchesHolding('shared-3')).map((b) => b.submitted_by), ['alice', 'bob']);
    assert.equal((await holding('shared-3')).length, 1);
  });

  it('malformed is refused with BAD_USER_INPUT, and writes nothing', async () => {
    const [count, made] = [await executions(), await batches()];
    for (const key of ['', 'x'.repeat(129), ' lead', 'nul\u0000', 'half\ud800']) {
      const refused = await submitBatch(one, alice, { stages: stages('bk4'), idempotencyKey: key });
      assert.equal(refused.code, 'BAD_USER_INPUT', `${JSON.stringify(key)}: ${JSON.stringify(refused.body)}`);
    }
    await assert.rejects(sql.query(`select asyncproc.invoke_batch_once(' lead', '[[{"procedure": "demo.noop"}]]')`), { code: 'AP004' });
    await assert.rejects(sql.query(`select asyncproc.invoke_batch_once(null, '[[{"procedure": "demo.noop"}]]')`), { code: 'AP004' }, 'invoke_batch_once takes a key');
    assert.equal(await executions(), count);
    assert.equal(await batches(), made);
  });

  it('sent by 20 requests at once to two instances makes exactly one batch: each request gets it, some after IDEMPOTENCY_KEY_IN_USE', async (t) => {
    let inUse = 0;
    const answers = await Promise.all(
      Array.from({ length: 20 }, async (_, i) => {
        for (;;) {
          const answer = await submitBatch(i % 2 ? one : two, alice, { stages: stages('bk5'), idempotencyKey: 'batch-race-5' });
          if (answer.code !== 'IDEMPOTENCY_KEY_IN_USE') return answer;
          inUse++;
          await new Promise((resolve) => setTimeout(resolve, 5));
        }
      }),
    );
    const ids = new Set(answers.map((a) => a.id));
    assert.equal(ids.size, 1, JSON.stringify(answers.map((a) => a.body).filter((b) => b.errors)));
    assert.deepEqual((await batchesHolding('batch-race-5')).map((b) => b.id), [...ids]);
    await waitFor(async () => Object.keys(await ran('bk5')).length === 3, 30_000, 'the batch to run');
    assert.deepEqual(await ran('bk5'), { 'bk5-a': 1, 'bk5-b': 1, 'bk5-c': 1 });
    t.diagnostic(`${inUse} answers of IDEMPOTENCY_KEY_IN_USE before the batch`);
  });

  it("held by a caller's open transaction (invoke_batch_once): the service refuses it at once, then gets that batch once committed; invoke_batch_once replays and refuses as the service does", async () => {
    const client = await cluster.connect(url);
    const once = (db: pg.Client, key: string, name: string, onFailure = 'CANCEL') =>
      db.query(`select asyncproc.invoke_batch_once($1, $2::jsonb, $3, 'alice') as id`, [key, JSON.stringify(stages(name)), onFailure]).then((r) => r.rows[0].id as string);
    try {
      await client.query('begin');
      const mine = await once(client, 'batch-tx-6', 'bk6');
      const held = await submitBatch(one, alice, { stages: stages('bk6'), idempotencyKey: 'batch-tx-6' });
      assert.equal(held.code, 'IDEMPOTENCY_KEY_IN_USE', JSON.stringify(held.body));
      await client.query('commit');
      assert.equal((await submitBatch(two, alice, { stages: stages('bk6'), idempotencyKey: 'batch-tx-6' })).id, mine);
      assert.equal(await once(client, 'batch-tx-6', 'bk6'), mine);
      await assert.rejects(once(client, 'batch-tx-6', 'bk6', 'CONTINUE'), { code: 'AP012' });
      assert.equal((await batchesHolding('batch-tx-6')).length, 1);
    } finally {
      await client.end();
    }
  });

  it('is freed by retention with its batch: sent after the purge, it makes a new one', async () => {
    const first = await submitBatch(one, alice, { stages: stages('bk7'), idempotencyKey: 'batch-kept-7' });
    await waitFor(async () => (await sql.query(`select 1 from asyncproc.batches where id = $1 and finished_at is not null`, [first.id])).rowCount, 30_000, 'the batch to end');
    assert.equal((await submitBatch(one, alice, { stages: stages('bk7'), idempotencyKey: 'batch-kept-7' })).id, first.id, 'held while its batch is kept');
    assert.ok((await engine.purge(0)) >= 3);
    const after = await submitBatch(one, alice, { stages: stages('bk7'), idempotencyKey: 'batch-kept-7' });
    assert.ok(after.id && after.id !== first.id, JSON.stringify(after.body));
    assert.deepEqual((await batchesHolding('batch-kept-7')).map((b) => b.id), [after.id]);
  });
});
