/**
 * Pausing a queue (pauseQueue / resumeQueue, PostgreSQL): from the pause on no call of the queue
 * starts in any process, also one that never heard of it; calls are taken meanwhile and wait; a
 * resume runs each of them once, and their subscribers hear the end.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import type pg from 'pg';
import type { Closeable } from '../src/engine.js';
import { collect, startTestApp, type TestApp } from './support/app.js';
import { sleep, startDemoDatabase, waitFor, type TestCluster } from './support/database.js';

let cluster: TestCluster;
let url: string;
let engine: Closeable;
let sql: pg.Client;
let a: TestApp;
let b: TestApp;

before(async () => {
  ({ cluster, url, engine, sql } = await startDemoDatabase());
  await sql.query(`create schema pause;
    create procedure pause.slow_record(tag text) language plpgsql as $$
    begin insert into demo.ledger (tag) values (tag); perform pg_sleep(0.05); end $$;
    select asyncproc.register('pause.slow_record(text)');`);
  a = await startTestApp(url);
  b = await startTestApp(url);
});
after(async () => {
  await a?.stop();
  await b?.stop();
  await sql?.end();
  await engine?.close();
  await cluster?.stop();
});

async function data<T = any>(app: TestApp, query: string, variables?: Record<string, unknown>): Promise<T> {
  const { status, body } = await app.gql<T>(query, variables);
  assert.equal(status, 200);
  assert.equal(body.errors, undefined, JSON.stringify(body.errors));
  return body.data!;
}

const QUEUE = '{ queue { name paused pending running } }';
const pause = (app: TestApp, name: string) => app.gql(`mutation ($name: String!) { pauseQueue(name: $name) ${QUEUE} }`, { name });
const resume = (app: TestApp, name: string) => app.gql(`mutation ($name: String!) { resumeQueue(name: $name) ${QUEUE} }`, { name });

/** Submit one slow_record call a tag to `queue` in one invokeMany; the tokens in order. */
async function submit(app: TestApp, queue: string, tags: string[]): Promise<string[]> {
  const inputs = tags.map((tag) => ({ procedure: 'pause.slow_record', arguments: { tag }, queue }));
  const { invokeMany } = await data(app, 'mutation ($inputs: [InvokeInput!]!) { invokeMany(inputs: $inputs) { executions { token } } }', { inputs });
  return invokeMany.executions.map((e: { token: string }) => e.token);
}

/** The queue's calls by status, and how many have started (ever), from the database. */
async function counts(queue: string): Promise<{ started: number; running: number; pending: number; succeeded: number; cancelled: number; ledger: number }> {
  const { rows } = await sql.query(
    `select count(*) filter (where started_at is not null)::int as started, count(*) filter (where status = 'RUNNING')::int as running,
            count(*) filter (where status = 'PENDING')::int as pending, count(*) filter (where status = 'SUCCEEDED')::int as succeeded,
            count(*) filter (where status = 'CANCELLED')::int as cancelled,
            (select count(*)::int from demo.ledger l where l.tag like $1 || '-%') as ledger
       from asyncproc.executions where queue = $1`,
    [queue],
  );
  return rows[0];
}

/** Every tag of `queue` the ledger holds more than once (a call run twice), and the tags it holds. */
async function ledger(queue: string): Promise<{ twice: string[]; tags: Set<string> }> {
  const { rows } = await sql.query<{ tag: string; n: number }>(`select tag, count(*)::int as n from demo.ledger where tag like $1 || '-%' group by tag`, [queue]);
  return { twice: rows.filter((r) => r.n > 1).map((r) => r.tag), tags: new Set(rows.map((r) => r.tag)) };
}

describe('a paused queue', () => {
  it('starts none of its calls on either instance, nor on one started meanwhile; takes and cancels calls; a resume runs each once and its subscribers hear it', async () => {
    await data(a, 'mutation { configureQueue(input: { name: "pz", concurrency: 4 }) { queue { name } } }');
    const tags = Array.from({ length: 120 }, (_, i) => `pz-${i}`);
    const tokens = await submit(a, 'pz', tags);
    await waitFor(async () => (await counts('pz')).succeeded >= 10, 30_000, '10 calls run before the pause');

    const paused = await pause(a, 'pz');
    assert.equal(paused.body.errors, undefined, JSON.stringify(paused.body.errors));
    assert.equal(paused.body.data.pauseQueue.queue.paused, true);
    // the calls running at the pause end as they would; then nothing starts
    await waitFor(async () => (await counts('pz')).running === 0, 30_000, 'the running calls ended');
    // the workers of the queue give their connections back (told by the pause's notification)
    const workers = async () => (await sql.query(`select count(*)::int as n from pg_stat_activity where application_name like 'asyncproc worker %/pz#%'`)).rows[0].n;
    await waitFor(async () => (await workers()) === 0, 30_000, "no worker connection of the paused queue");
    const atPause = await counts('pz');
    assert.ok(atPause.pending > 50, `most calls still wait: ${JSON.stringify(atPause)}`);
    assert.equal(atPause.ledger, atPause.succeeded);

    // taken meanwhile, through the other instance: they wait too
    const later = await submit(b, 'pz', ['pz-late-0', 'pz-late-1', 'pz-late-2']);
    for (const token of later) assert.equal((await data(b, `{ execution(token: "${token}") { status } }`)).execution.status, 'PENDING');
    // a cancel goes on, and its subscriber hears it
    const unstarted = (await sql.query(`select token::text from asyncproc.executions where queue = 'pz' and status = 'PENDING' order by id desc limit 4`)).rows.map((r) => r.token as string);
    const [cancelled, ...watched] = unstarted;
    const cancelledEnd = collect(a.ws().iterate({ query: `subscription { executionCompleted(token: "${cancelled}") { status } }` }), 1);
    const ends = watched.map((token) => collect(a.ws().iterate({ query: `subscription { executionCompleted(token: "${token}") { status } }` }), 1));
    await sleep(300);
    assert.equal((await data(b, `mutation { cancelExecution(token: "${cancelled}") { execution { status } } }`)).cancelExecution.execution.status, 'CANCELLED');
    assert.deepEqual(await cancelledEnd, [{ data: { executionCompleted: { status: 'CANCELLED' } } }]);

    // an instance started while the queue is paused starts none of its calls either
    await b.stop();
    b = await startTestApp(url);
    assert.equal((await data(b, '{ queues { name paused } }')).queues.find((q: { name: string }) => q.name === 'pz').paused, true);
    await sleep(1500);
    const stillPaused = await counts('pz');
    assert.equal(stillPaused.started, atPause.started, 'no call started while paused');
    assert.equal(stillPaused.ledger, atPause.ledger);

    const metrics = await (await fetch(a.url.replace(/\/graphql$/, '/metrics'))).text();
    assert.match(metrics, /^asyncproc_queue_paused\{queue="pz"\} 1$/m);
    assert.match(metrics, /^asyncproc_queue_paused\{queue="default"\} 0$/m);

    assert.equal(await workers(), 0);
    const resumed = await resume(b, 'pz');
    assert.equal(resumed.body.data.resumeQueue.queue.paused, false);
    await waitFor(async () => (await counts('pz')).succeeded === tokens.length + later.length - 1, 60_000, 'every call but the cancelled one ran');
    for (const end of await Promise.all(ends)) assert.deepEqual(end, [{ data: { executionCompleted: { status: 'SUCCEEDED' } } }]);
    const { twice, tags: ran } = await ledger('pz');
    assert.deepEqual(twice, [], 'no call ran twice');
    const cancelledTag = (await sql.query(`select arguments->>'tag' as tag from asyncproc.executions where token = $1`, [cancelled])).rows[0].tag;
    assert.equal(ran.has(cancelledTag), false, 'the cancelled call never ran');
    assert.equal(ran.size, tokens.length + later.length - 1);
    assert.equal((await counts('pz')).cancelled, 1);
  });

  it('holds in a process that never heard of the pause: each claim reads it, in the statement that takes the call', async () => {
    await data(a, 'mutation { configureQueue(input: { name: "deaf", concurrency: 4 }) { queue { name } } }');
    await submit(a, 'deaf', Array.from({ length: 80 }, (_, i) => `deaf-${i}`));
    await waitFor(async () => (await counts('deaf')).succeeded >= 5, 30_000, 'calls run before the pause');
    // paused behind the service's back: no notification, so no activator drops its slots (it
    // reads the queues again only once a minute); only the claims' own check stops the calls
    await sql.query(`update asyncproc.queues set paused = true where name = 'deaf'`);
    await waitFor(async () => (await counts('deaf')).running === 0, 30_000, 'the running calls ended');
    const atPause = await counts('deaf');
    assert.ok(atPause.pending > 20, JSON.stringify(atPause));
    await sleep(2500);
    assert.equal((await counts('deaf')).started, atPause.started, 'no call started while paused');

    // the same check, alone: a ready call is not taken while its queue is paused, and is once resumed
    await sql.query('begin');
    try {
      assert.equal((await sql.query(`select asyncproc.take_ready('deaf', 0) as id`)).rows[0].id, null);
      await sql.query(`update asyncproc.queues set paused = false where name = 'deaf'`);
      assert.notEqual((await sql.query(`select asyncproc.take_ready('deaf', 0) as id`)).rows[0].id, null);
    } finally {
      await sql.query('rollback');
    }
    await resume(a, 'deaf');
    await waitFor(async () => (await counts('deaf')).succeeded === 80, 60_000, 'every call ran once resumed');
    assert.deepEqual((await ledger('deaf')).twice, []);
  });

  it('keeps its pause when its concurrency changes, and a resume of a queue not paused changes nothing', async () => {
    await data(a, 'mutation { configureQueue(input: { name: "kept", concurrency: 2 }) { queue { name } } }');
    assert.equal((await pause(a, 'kept')).body.data.pauseQueue.queue.paused, true);
    assert.equal((await pause(b, 'kept')).body.data.pauseQueue.queue.paused, true, 'a second pause answers the same');
    const { configureQueue } = await data(a, 'mutation { configureQueue(input: { name: "kept", concurrency: 5 }) { queue { concurrency paused } } }');
    assert.deepEqual(configureQueue.queue, { concurrency: 5, paused: true });
    assert.equal((await resume(a, 'kept')).body.data.resumeQueue.queue.paused, false);
    const again = await resume(a, 'kept');
    assert.equal(again.body.errors, undefined);
    assert.equal(again.body.data.resumeQueue.queue.paused, false);
  });

  it('refuses an unknown queue name with NOT_FOUND, text no name can hold with BAD_USER_INPUT, and changes nothing', async () => {
    const before = (await sql.query('select name, paused from asyncproc.queues order by name')).rows;
    const names: [string, string][] = [['nope', 'NOT_FOUND'], ['', 'NOT_FOUND'], [' default', 'NOT_FOUND'], ['DEFAULT', 'NOT_FOUND'], ['x'.repeat(10_000), 'NOT_FOUND'], ['default\u0000', 'BAD_USER_INPUT'], ['\ud800', 'BAD_USER_INPUT']];
    for (const [name, code] of names) {
      for (const send of [pause, resume]) {
        const { status, body } = await send(a, name);
        assert.equal(status, 200, name.slice(0, 20));
        assert.equal(body.errors?.[0]?.extensions?.code, code, `${JSON.stringify(name.slice(0, 20))}: ${JSON.stringify(body.errors)}`);
        assert.equal(body.data ?? null, null);
      }
    }
    assert.deepEqual((await sql.query('select name, paused from asyncproc.queues order by name')).rows, before);
  });
});
