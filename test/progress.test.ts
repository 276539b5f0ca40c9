/**
 * Live progress, end to end: a procedure calls asyncproc.progress(); the report travels as a
 * NOTICE to its worker, is stored outside the call's transaction and announced, and reaches
 * graphql-ws subscribers of executionProgress and readers of Execution.progress while the
 * call still runs and its own writes are not yet visible. Real PostgreSQL, real service.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { hostname } from 'node:os';
import { createClient as createWsClient } from 'graphql-ws';
import { SignJWT } from 'jose';
import type pg from 'pg';
import WebSocket from 'ws';
import { collect, startTestApp, type TestApp } from './support/app.js';
import { freePort, startTestCluster, waitFor, type TestCluster } from './support/database.js';
import { healthy, postGraphql, startProcess, stopProcess, type ServiceProcess } from './support/service.js';

const SECRET = 'a-test-secret-of-at-least-thirty-two-characters-long';

let cluster: TestCluster;
let t: TestApp;
let sql: pg.Client;
let alice: Record<string, string>;
let bob: Record<string, string>;

const bearer = async (sub: string) => ({
  authorization: `Bearer ${await new SignJWT({ roles: [] }).setProtectedHeader({ alg: 'HS256' }).setSubject(sub).setIssuedAt().setExpirationTime('10m').sign(new TextEncoder().encode(SECRET))}`,
});

before(async () => {
  cluster = await startTestCluster();
  const url = await cluster.createDatabase();
  t = await startTestApp(url, { ASYNCPROC_JWT_SECRET: SECRET, ASYNCPROC_RATE_LIMIT: '1000' });
  sql = await cluster.connect(url);
  await sql.query(`
    create schema progress_test;
    create table progress_test.marks (note text);
    create procedure progress_test.steps(pause double precision)
    language plpgsql as $$
    begin
      insert into progress_test.marks values ('written');
      perform asyncproc.progress(50, 'half');
      perform pg_sleep(pause);
      perform asyncproc.progress(100, 'done');
    end $$;
    create procedure progress_test.chatty(reports integer)
    language plpgsql as $$
    begin
      for i in 1..reports loop
        perform asyncproc.progress(i * 100.0 / reports, 'step ' || i);
        perform pg_sleep(0.002);
      end loop;
    end $$;
    -- a procedure that raises notices shaped as asyncproc.progress's, naming other calls (the
    -- victim, then made-up ids from made_from on): a caller can have any procedure that echoes
    -- its input do as much
    create procedure progress_test.forge(victim bigint, made_from bigint, made integer)
    language plpgsql as $$
    begin
      raise notice 'asyncproc.progress %', json_build_object('percent', 7, 'message', 'forged', 'execution', victim::text);
      for i in 0..made - 1 loop
        raise notice 'asyncproc.progress %', json_build_object('percent', 7, 'message', 'forged', 'execution', (made_from + i)::text);
      end loop;
      perform pg_sleep(0.3);
    end $$;
    select asyncproc.register('progress_test.steps');
    select asyncproc.register('progress_test.chatty');
    select asyncproc.register('progress_test.forge');
    create procedure progress_test.half_then_fail()
    language plpgsql as $$
    begin
      perform asyncproc.progress(50, 'half');
      perform pg_sleep(0.5);
      raise exception 'broke at half';
    end $$;
    select asyncproc.register('progress_test.half_then_fail');
  `);
  alice = await bearer('alice');
  bob = await bearer('bob');
});
after(async () => {
  await sql?.end();
  await t?.stop();
  await cluster?.stop();
});

async function invoke(procedure: string, args: Record<string, unknown>, headers = alice): Promise<string> {
  const { body } = await t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { token } } }`, { i: { procedure, arguments: args } }, headers);
  assert.equal(body.errors, undefined, JSON.stringify(body.errors));
  return body.data.invoke.execution.token;
}

const PROGRESS = `subscription($t: ID!) { executionProgress(token: $t) { token status progress { percent message at } } }`;

interface ProgressEvent {
  token: string;
  status: string;
  progress: { percent: number; message: string | null; at: string };
}

describe('live progress (PostgreSQL)', () => {
  it('a report reaches subscribers while the call runs and before its writes commit; the stream ends with the call', async () => {
    const token = await invoke('progress_test.steps', { pause: 3 });
    const iterator = t.ws({ Authorization: alice.authorization }).iterate({ query: PROGRESS, variables: { t: token } });
    const events: ProgressEvent[] = [];
    let atFirst: { status: string; marks: number; field: unknown } | null = null;
    for await (const result of iterator) {
      assert.equal(result.errors, undefined, JSON.stringify(result.errors));
      const event = (result.data as { executionProgress: ProgressEvent }).executionProgress;
      events.push(event);
      if (events.length === 1) {
        // at the moment the first report arrives: still RUNNING, its row not visible to others
        const status = (await sql.query(`select status from asyncproc.executions where token = $1`, [token])).rows[0].status;
        const marks = Number((await sql.query(`select count(*) as n from progress_test.marks`)).rows[0].n);
        const { body } = await t.gql(`query($t: ID!) { execution(token: $t) { status progress { percent message } } }`, { t: token }, alice);
        atFirst = { status, marks, field: body.data.execution };
      }
    }
    assert.deepEqual(atFirst, { status: 'RUNNING', marks: 0, field: { status: 'RUNNING', progress: { percent: 50, message: 'half' } } });
    const seen = events.map((e) => [e.status, e.progress.percent, e.progress.message]);
    assert.deepEqual(seen[0], ['RUNNING', 50, 'half']);
    assert.deepEqual(seen.at(-1), ['SUCCEEDED', 100, 'done'], 'the last event says how the call ended');
    // the last report may be read before the call's end was: then the end comes as one more event
    assert.ok(seen.length === 2 || (seen.length === 3 && JSON.stringify(seen[1]) === JSON.stringify(['RUNNING', 100, 'done'])), JSON.stringify(seen));
    assert.ok(Date.parse(events[1].progress.at) > Date.parse(events[0].progress.at));
    // the call ended, its writes are there, and the field keeps the last report
    const { body } = await t.gql(`query($t: ID!) { execution(token: $t) { status progress { percent message } } }`, { t: token }, alice);
    assert.deepEqual(body.data.execution, { status: 'SUCCEEDED', progress: { percent: 100, message: 'done' } });
    assert.equal(Number((await sql.query(`select count(*) as n from progress_test.marks`)).rows[0].n), 1);
  });

  it('a chatty procedure is throttled: a few events a second, the last report wins', async () => {
    const started = Date.now();
    const token = await invoke('progress_test.chatty', { reports: 1000 });
    const results = await collect(t.ws({ Authorization: alice.authorization }).iterate({ query: PROGRESS, variables: { t: token } }));
    const seconds = (Date.now() - started) / 1000;
    const events = results.map((r) => (r.data as { executionProgress: ProgressEvent }).executionProgress);
    assert.ok(seconds >= 2, `the loop sleeps 2 s in all, took ${seconds}`);
    // at most 4 stored a second, plus the first and the last
    assert.ok(events.length >= 2 && events.length <= Math.ceil(seconds * 4) + 2, `${events.length} events in ${seconds} s`);
    const percents = events.map((e) => e.progress.percent);
    assert.deepEqual(percents, [...percents].sort((a, b) => a - b), 'in order');
    assert.deepEqual(events.at(-1)!.progress, { ...events.at(-1)!.progress, percent: 100, message: 'step 1000' });
    const stored = await sql.query(
      `select p.percent::float8 as percent, p.message from asyncproc.execution_progress p join asyncproc.executions e on e.id = p.execution_id where e.token = $1`,
      [token],
    );
    assert.deepEqual(stored.rows, [{ percent: 100, message: 'step 1000' }]);
  });

  it('100 subscribers of one call share its reads: one read a poll, not one each', async () => {
    const token = await invoke('progress_test.steps', { pause: 4 });
    const engine = t.app.engine as { getProgress?: (ids: string[]) => Promise<unknown> };
    const original = engine.getProgress!.bind(engine);
    let reads = 0;
    // counted on the way to the real database
    engine.getProgress = (ids) => (reads++, original(ids));
    const clients = [t.ws({ Authorization: alice.authorization }), t.ws({ Authorization: alice.authorization })];
    const iterators = Array.from({ length: 100 }, (_, i) => clients[i % 2].iterate({ query: PROGRESS, variables: { t: token } }));
    try {
      const firsts = await Promise.all(iterators.map((iterator) => iterator.next()));
      assert.ok(firsts.every((step) => (step.value?.data as { executionProgress: ProgressEvent } | undefined)?.executionProgress.progress.percent === 50));
      // two polls with every subscriber in: each reads the report once for all of them
      const before = reads;
      await new Promise((resolve) => setTimeout(resolve, 2_100));
      assert.ok(reads - before <= 10, `${reads - before} reads in two polls for 100 subscribers`);
    } finally {
      engine.getProgress = original;
      await Promise.all(iterators.map((iterator) => iterator.return?.()));
    }
  });

  it("the stream's last event says how the call ended, also when no report came after the end: FAILED at 50 %, CANCELLED before it started", async () => {
    const events = async (token: string) =>
      (await collect(t.ws({ Authorization: alice.authorization }).iterate({ query: PROGRESS, variables: { t: token } }))).map((r) => {
        assert.equal(r.errors, undefined, JSON.stringify(r.errors));
        const e = (r.data as { executionProgress: ProgressEvent }).executionProgress;
        return [e.status, e.progress?.percent ?? null];
      });
    const failing = await invoke('progress_test.half_then_fail', {});
    assert.deepEqual(await events(failing), [['RUNNING', 50], ['FAILED', 50]]);
    // not started (waiting for its runAt), cancelled while watched: no report, one event
    const { body } = await t.gql(`mutation($i: InvokeInput!) { invoke(input: $i) { execution { token } } }`, { i: { procedure: 'progress_test.steps', arguments: { pause: 0 }, runAt: new Date(Date.now() + 3_600_000).toISOString() } }, alice);
    const waiting = body.data.invoke.execution.token as string;
    const watched = events(waiting);
    await new Promise((resolve) => setTimeout(resolve, 500));
    const cancelled = await t.gql(`mutation($t: ID!) { cancelExecution(token: $t) { execution { status } } }`, { t: waiting }, alice);
    assert.equal(cancelled.body.data?.cancelExecution?.execution?.status, 'CANCELLED', JSON.stringify(cancelled.body));
    assert.deepEqual(await watched, [['CANCELLED', null]]);
    // subscribed after the end: the end, once
    assert.deepEqual(await events(waiting), [['CANCELLED', null]]);
  });

  it("a notice that names another call writes no one's progress: not a finished call of another caller's, nor thousands of made-up ones", async () => {
    const victim = await invoke('progress_test.steps', { pause: 0 }, bob);
    const ended = await collect(t.ws({ Authorization: bob.authorization }).iterate({ query: PROGRESS, variables: { t: victim } }));
    assert.equal((ended.at(-1)!.data as { executionProgress: ProgressEvent }).executionProgress.progress.percent, 100);
    const idOf = async (token: string) => (await sql.query<{ id: string }>('select id::text from asyncproc.executions where token = $1', [token])).rows[0].id;
    const victimId = await idOf(victim);
    const made = Array.from({ length: 3000 }, (_, i) => String(10_000_000 + i));
    const forger = await invoke('progress_test.forge', { victim: Number(victimId), made_from: Number(made[0]), made: made.length });
    // the forger's call ends, its notices all heard by its worker
    await waitFor(async () => (await sql.query('select status from asyncproc.executions where token = $1', [forger])).rows[0].status === 'SUCCEEDED', 20_000, 'the forger to end');
    await new Promise((resolve) => setTimeout(resolve, 500)); // longer than the throttle's interval: what it would write is written
    const stored = await sql.query<{ execution_id: string; percent: number; message: string }>(
      'select execution_id::text, percent::float8 as percent, message from asyncproc.execution_progress where execution_id = any($1::bigint[]) or message = $2',
      [[victimId, ...made, await idOf(forger)], 'forged'],
    );
    assert.deepEqual(stored.rows, [{ execution_id: victimId, percent: 100, message: 'done' }], 'only the victim\'s own last report');
  });

  it('Execution.progress is null for a call that reported none', async () => {
    const token = await invoke('demo.add', { a: 1, b: 2 });
    const done = await waitFor(async () => {
      const { body } = await t.gql(`query($t: ID!) { execution(token: $t) { status progress { percent } } }`, { t: token }, alice);
      return body.data.execution.status === 'SUCCEEDED' ? body.data.execution : null;
    });
    assert.deepEqual(done, { status: 'SUCCEEDED', progress: null });
  });

  it("another caller's token is NOT_FOUND, as an unknown one is", async () => {
    const token = await invoke('progress_test.steps', { pause: 0.5 });
    for (const [who, tokenAsked] of [
      [bob, token],
      [alice, '00000000-0000-4000-8000-000000000000'],
    ] as const) {
      const results = await collect(t.ws({ Authorization: who.authorization }).iterate({ query: PROGRESS, variables: { t: tokenAsked } })).catch(
        (errors) => [{ errors }],
      );
      const errors = (results[0] as { errors?: { extensions?: { code?: string } }[] }).errors;
      assert.equal(errors?.[0]?.extensions?.code, 'NOT_FOUND', JSON.stringify(results));
    }
    // its owner sees it
    const own = await collect(t.ws({ Authorization: alice.authorization }).iterate({ query: PROGRESS, variables: { t: token } }));
    assert.ok(own.length >= 1 && own.every((r) => r.errors === undefined), JSON.stringify(own));
  });

  it('asyncproc.progress refuses a percent outside 0–100; outside a worker it is only a notice', async () => {
    await assert.rejects(sql.query(`select asyncproc.progress(101)`), /between 0 and 100/);
    // outside a worker it is only a notice
    await sql.query(`select asyncproc.progress(10, 'from psql')`);
  });
});

describe('live progress across processes (PostgreSQL)', () => {
  it('a call run by a `worker` process reports to a subscriber of a `serve` process while it runs, before its writes commit', async () => {
    const url = await cluster.createDatabase();
    const db = await cluster.connect(url);
    // no worker pool in the service: the call can only run in the worker process
    const service = startProcess('serve', url, await freePort(), { ASYNCPROC_ACTIVATOR: 'false', ASYNCPROC_DEMO: 'true' });
    let worker: ServiceProcess | undefined;
    const tag = `across-${Date.now()}`;
    const ws = createWsClient({ url: `ws://127.0.0.1:${service.port}/graphql`, webSocketImpl: WebSocket, retryAttempts: 0 });
    try {
      await waitFor(() => healthy(service.port), 60_000, `/health of serve:\n${service.output()}`);
      worker = startProcess('worker', url);
      const invoke = async (procedure: string, args: Record<string, unknown>) => {
        const { data, errors } = await postGraphql(service.port, `mutation($i: InvokeInput!) { invoke(input: $i) { execution { token } } }`, {
          i: { procedure, arguments: args },
        });
        assert.equal(errors, undefined, JSON.stringify(errors));
        return data.invoke.execution.token as string;
      };
      // demo.halfway records its tag, reports 50 % and holds until tag/go is recorded
      const token = await invoke('demo.halfway', { tag });
      const iterator = ws.iterate({ query: `subscription($t: ID!) { executionProgress(token: $t) { status worker progress { percent message } } }`, variables: { t: token } });
      const first = await iterator.next();
      assert.ok(!first.done, 'a report arrives while the call runs (the stream ended without one)');
      assert.equal(first.value.errors, undefined, JSON.stringify(first.value));
      const event = (first.value.data as { executionProgress: { status: string; worker: string; progress: { percent: number; message: string } } }).executionProgress;
      // at the moment the report arrives: RUNNING in the worker process, its own write not visible
      const row = (await db.query(`select status from asyncproc.executions where token = $1`, [token])).rows[0];
      const written = Number((await db.query(`select count(*) as n from demo.ledger where tag = $1`, [tag])).rows[0].n);
      assert.deepEqual(
        { event, status: row.status, written },
        { event: { ...event, status: 'RUNNING', progress: { percent: 50, message: 'half way' } }, status: 'RUNNING', written: 0 },
      );
      assert.ok(event.worker.startsWith(`${hostname()}:${worker.child.pid}/`), `run by the worker process (pid ${worker.child.pid}), not ${event.worker}`);
      await invoke('demo.record', { tag: `${tag}/go` });
      const rest = await collect(iterator as AsyncIterableIterator<{ data?: any; errors?: unknown }>);
      const last = rest.at(-1)!.data.executionProgress;
      assert.deepEqual(last.progress, { percent: 100, message: 'done' }, JSON.stringify(rest));
      assert.equal(Number((await db.query(`select count(*) as n from demo.ledger where tag = $1`, [tag])).rows[0].n), 1);
    } finally {
      // a failed assertion must not leave demo.halfway holding the worker's shutdown for two minutes
      await db.query(`insert into demo.ledger (tag) values ($1)`, [`${tag}/go`]).catch(() => undefined);
      await ws.dispose();
      if (worker) await stopProcess(worker.child, 'SIGTERM');
      await stopProcess(service.child, 'SIGTERM');
      await db.end();
    }
  });
});
