/**
 * What an operator sees: /ready says when the service cannot work (database gone, schema
 * behind, listener deaf), /metrics moves with the work done, and the log lines of one
 * execution carry its token and procedure.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import pino from 'pino';
import { CompletionHub } from '../src/completionHub.js';
import type { Closeable } from '../src/engine.js';
import { silentLogger } from '../src/logger.js';
import { Readiness } from '../src/readiness.js';
import { collect, startTestApp, type TestApp } from './support/app.js';
import { capturingLogger } from './support/logs.js';
import { sleep, startDemoDatabase, tearDown, waitFor, type DemoDatabase } from './support/database.js';

let db: DemoDatabase;
let t: TestApp;
/** Every line the service logged, parsed. */
const logged: Record<string, any>[] = [];

before(async () => {
  db = await startDemoDatabase();
  const logger = pino({ level: 'info' }, { write: (line: string) => void logged.push(JSON.parse(line)) });
  t = await startTestApp(db.url, {}, logger);
});
after(async () => {
  await tearDown([
    ['the app stop', () => t?.stop()],
    ['the test client end', () => db?.sql.end()],
    ['the engine close', () => db?.engine.close()],
    ['the cluster stop', () => db?.cluster.stop()],
  ]);
});

const base = () => t.url.replace(/\/graphql$/, '');

async function scrape(): Promise<string> {
  const response = await fetch(`${base()}/metrics`);
  assert.equal(response.status, 200);
  assert.match(response.headers.get('content-type') ?? '', /^text\/plain; version=0\.0\.4/);
  return response.text();
}

/** The value of one sample of a scrape (0 when the series is not there yet). */
function sample(text: string, name: string, labels: Record<string, string> = {}): number {
  const wanted = Object.entries(labels).map(([key, value]) => `${key}="${value}"`);
  for (const line of text.split('\n')) {
    const match = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$/.exec(line);
    if (!match || match[1] !== name) continue;
    const have = match[2] ? match[2].split(/,(?=[a-zA-Z_]\w*=")/) : [];
    if (wanted.length === have.length && wanted.every((pair) => have.includes(pair))) return Number(match[3]);
  }
  return 0;
}

const INVOKE = `mutation Submit($input: InvokeInput!) { invoke(input: $input) { execution { token } } }`;

async function invoke(input: Record<string, unknown>): Promise<string> {
  const { body } = await t.gql(INVOKE, { input });
  assert.ok(body.data, JSON.stringify(body.errors));
  return body.data.invoke.execution.token;
}

async function ready(url = base()): Promise<{ status: number; body: any }> {
  const response = await fetch(`${url}/ready`);
  return { status: response.status, body: await response.json() };
}

/** The first 503 answer of /ready (polled until `timeoutMs`). */
function unready(url = base(), timeoutMs = 5000): Promise<{ status: number; body: any }> {
  return waitFor(async () => {
    const answer = await ready(url);
    return answer.status === 503 ? answer : null;
  }, timeoutMs, '503');
}

describe('/metrics', () => {
  it('moves with the calls that ran: counters, histograms, queue gauges, subscribers, reconnects', async () => {
    const before = await scrape();
    assert.ok(sample(before, 'asyncproc_process_cpu_user_seconds_total') > 0, 'default process metrics, prefixed');

    const client = t.ws();
    const events = collect(client.iterate({ query: `subscription { executionEvents(filter: { procedure: "demo.noop", status: [SUCCEEDED] }) { status } }` }), 1);
    await waitFor(async () => t.app.hub!.size === 1, 5000, 'the event stream open');
    await invoke({ procedure: 'demo.noop' });
    assert.equal((await events).length, 1);
    const added = await Promise.all([1, 2, 3].map((a) => invoke({ procedure: 'demo.add', arguments: { a, b: 1 } })));
    const failed = await Promise.all([1, 2].map(() => invoke({ procedure: 'demo.fail', arguments: { message: 'no' }, maxAttempts: 1 })));
    const later = await invoke({ procedure: 'demo.add', arguments: { a: 0, b: 0 }, runAt: new Date(Date.now() + 3_600_000).toISOString() });
    await waitFor(async () => (await db.engine.getExecutions([...added, ...failed])).every((e) => ['SUCCEEDED', 'FAILED'].includes(e.status)), 30_000, 'calls done');

    // one subscriber on the call that waits, one that gets its completion at once
    const pending = client.iterate({ query: `subscription { executionCompleted(token: "${later}") { status } }` });
    void pending.next();
    const done = await collect(client.iterate({ query: `subscription($t: ID!) { executionCompleted(token: $t) { status } }`, variables: { t: added[0] } }));
    assert.equal(done.length, 1);
    await waitFor(async () => t.app.hub!.size === 1, 5000, 'the waiting subscription open');

    const diff = (text: string, name: string, labels?: Record<string, string>) => sample(text, name, labels) - sample(before, name, labels);
    const now = await waitFor(
      async () => {
        const text = await scrape();
        const counted = diff(text, 'asyncproc_executions_finished_total', { procedure: 'demo.add', status: 'SUCCEEDED' }) === 3;
        return counted && sample(text, 'asyncproc_queue_executions', { queue: 'default', status: 'waiting' }) === 1 ? text : null;
      },
      20_000,
      'the completions counted and the waiting call in the queue gauge',
    );
    assert.equal(diff(now, 'asyncproc_executions_finished_total', { procedure: 'demo.fail', status: 'FAILED' }), 2);
    assert.equal(diff(now, 'asyncproc_execution_run_seconds_count', { procedure: 'demo.add' }), 3);
    assert.equal(diff(now, 'asyncproc_execution_run_seconds_count', { procedure: 'demo.fail' }), 2);
    assert.equal(diff(now, 'asyncproc_execution_wait_seconds_count', { queue: 'default' }), 6);
    assert.ok(diff(now, 'asyncproc_execution_run_seconds_sum', { procedure: 'demo.add' }) >= 0);
    assert.equal(sample(now, 'asyncproc_queue_executions', { queue: 'default', status: 'running' }), 0);
    assert.ok(sample(now, 'asyncproc_queue_concurrency', { queue: 'default' }) >= 1);
    assert.equal(diff(now, 'asyncproc_graphql_operation_duration_seconds_count', { type: 'mutation', name: 'Submit' }), 7);
    assert.equal(diff(now, 'asyncproc_graphql_operation_duration_seconds_count', { type: 'subscription', name: 'anonymous' }), 3);
    assert.equal(diff(now, 'asyncproc_events_delivered_total'), 2, 'one event, one completion');
    assert.equal(sample(now, 'asyncproc_subscriptions'), 1);
    assert.equal(sample(now, 'asyncproc_websocket_connections'), 1);
    assert.ok(sample(now, 'asyncproc_listener_lag_seconds') < 15, 'the listener heard from the database within its heartbeat');
    assert.ok(sample(now, 'asyncproc_feed_lag_seconds') < 5, 'the hub read the feed lately');
    await pending.return?.();

    // the listener's connection cut: counted, and it hears again
    const cut = await db.sql.query(`select pg_terminate_backend(pid) from pg_stat_activity where datname = current_database() and application_name = 'asyncproc listener'`);
    assert.equal(cut.rowCount, 1);
    await waitFor(async () => diff(await scrape(), 'asyncproc_listener_reconnects_total') === 1, 10_000, 'the reconnect counted');
  });

  it('counts each open subscription once, however many executions it watches (a batch subscriber watches every member)', async () => {
    const runAt = new Date(Date.now() + 3_600_000).toISOString();
    const submitted = await t.gql(
      `mutation($stage: [InvokeInput!]!) { submitBatch(input: { stages: [$stage] }) { batch { id executions(first: 1) { nodes { token } } } } }`,
      { stage: Array.from({ length: 50 }, () => ({ procedure: 'demo.noop', runAt })) },
    );
    assert.equal(submitted.body.errors, undefined, JSON.stringify(submitted.body.errors));
    const { id, executions } = submitted.body.data.submitBatch.batch;
    const token = executions.nodes[0].token as string;
    const before = sample(await scrape(), 'asyncproc_subscriptions');
    const client = t.ws();
    const streams = [
      client.iterate({ query: `subscription($id: ID!) { batchCompleted(id: $id) { status } }`, variables: { id } }),
      client.iterate({ query: `subscription($t: ID!) { executionCompleted(token: $t) { status } }`, variables: { t: token } }),
      client.iterate({ query: `subscription($t: ID!) { executionProgress(token: $t) { status } }`, variables: { t: token } }),
    ];
    const pulls = streams.map((stream) => stream.next());
    try {
      await waitFor(async () => sample(await scrape(), 'asyncproc_subscriptions') - before === 3, 10_000, 'three subscriptions counted');
      assert.equal(t.app.hub!.size, before + 3);
    } finally {
      await Promise.all(streams.map((stream) => stream.return?.()));
      await client.dispose();
      void Promise.allSettled(pulls);
    }
    await waitFor(async () => sample(await scrape(), 'asyncproc_subscriptions') === before, 10_000, 'all three gone');
  });

  it('keeps operation names to a bounded set of labels', async () => {
    for (let i = 0; i < 120; i++) await t.gql(`query Probe${i} { __typename }`);
    const text = await scrape();
    const names = new Set([...text.matchAll(/^asyncproc_graphql_operation_duration_seconds_count\{[^}]*name="([^"]*)"/gm)].map((m) => m[1]));
    assert.ok(names.has('other') && names.size <= 101, `${names.size} names: the first 100 and "other"`);
    assert.ok(sample(text, 'asyncproc_graphql_operation_duration_seconds_count', { type: 'query', name: 'other' }) > 0);
  });

  it('is not served with ASYNCPROC_METRICS=false', async () => {
    const off = await startTestApp(db.url, { ASYNCPROC_METRICS: 'false' });
    try {
      const response = await fetch(off.url.replace(/\/graphql$/, '/metrics'));
      assert.equal(response.status, 404);
      await response.body?.cancel();
    } finally {
      await off.stop();
    }
  });
});

describe('/ready', () => {
  it('is 200 when database, schema and listener are there; /health stays 200', async () => {
    const { status, body } = await ready();
    assert.equal(status, 200, JSON.stringify(body));
    assert.equal(body.status, 'ready');
    assert.deepEqual(body.failed, []);
    assert.equal(body.checks.migrations.applied, body.checks.migrations.expected);
    assert.equal((await fetch(`${base()}/health`)).status, 200);
  });

  it('is 503 naming "migrations" while the database is behind the service (say, restored from an older backup)', async () => {
    const { rows } = await db.sql.query<{ version: number; name: string }>('delete from asyncproc.migrations where version = (select max(version) from asyncproc.migrations) returning version, name');
    try {
      const { body } = await unready();
      assert.deepEqual(body.failed, ['migrations']);
      assert.equal(body.checks.migrations.applied, rows[0].version - 1);
    } finally {
      await db.sql.query('insert into asyncproc.migrations (version, name) values ($1, $2)', [rows[0].version, rows[0].name]);
    }
    await waitFor(async () => (await ready()).status === 200, 5000, 'ready again');
  });

  it('is 503 naming "migrations" while a table every call goes through is missing (renamed by hand), though asyncproc.migrations says all is applied', async () => {
    await db.sql.query('alter table asyncproc.executions rename to executions_aside');
    try {
      const { body } = await unready();
      assert.deepEqual(body.failed, ['migrations']);
      assert.equal(body.checks.migrations.applied, null);
    } finally {
      await db.sql.query('alter table asyncproc.executions_aside rename to executions');
    }
    await waitFor(async () => (await ready()).status === 200, 5000, 'ready again');
  });

  it('is 503 naming "database" while the database is down, and 200 again when it is back', async () => {
    const other = await startDemoDatabase();
    await other.sql.end();
    await other.engine.close();
    const log = capturingLogger();
    const app = await startTestApp(other.url, {}, log.logger);
    const url = app.url.replace(/\/graphql$/, '');
    try {
      assert.equal((await ready(url)).status, 200);
      const { body: invoked } = await app.gql('mutation { invoke(input: { procedure: "demo.noop", arguments: {} }) { execution { token } } }');
      const token = invoked.data.invoke.execution.token as string;
      await other.cluster.server.stop();
      const down = await unready(url, 10_000);
      assert.deepEqual(down.body.failed, ['database'], JSON.stringify(down.body));
      assert.equal(down.body.checks.migrations.ok, null, 'the schema is not known, not missing');
      assert.equal(down.body.status, 'unready');
      assert.equal((await fetch(`${url}/health`)).status, 200, 'liveness is not readiness');
      // a request meanwhile is told the database is away, with a code a client can retry on (it was "Unexpected error.")
      for (const query of ['{ executions(first: 1) { totalCount } }', 'mutation { invoke(input: { procedure: "demo.noop", arguments: {} }) { execution { token } } }']) {
        const { status, body } = await app.gql(query);
        assert.equal(status, 503, JSON.stringify(body));
        assert.equal(body.errors?.[0]?.extensions?.code, 'SERVICE_UNAVAILABLE', JSON.stringify(body));
        assert.match(body.errors[0].message, /try again/);
      }
      // a subscription over SSE too: its response would start only once the database answers (a proxy's timeout cuts it in silence)
      for (const field of [`executionCompleted(token: "${token}") { status }`, `executionProgress(token: "${token}") { status }`]) {
        const sse = await fetch(app.url, {
          method: 'POST',
          headers: { 'content-type': 'application/json', accept: 'text/event-stream' },
          body: JSON.stringify({ query: `subscription { ${field} }` }),
          signal: AbortSignal.timeout(10_000),
        });
        assert.equal(sse.status, 503, field);
        assert.match(await sse.text(), /SERVICE_UNAVAILABLE/, field);
      }
      // logged as what it is, once: a warning, not an error (yoga logged each one again at error level)
      assert.deepEqual(log.lines.filter((line) => line.level >= 50).map((line) => line.msg), [], 'no error-level line');
      assert.ok(log.lines.some((line) => line.level === 40 && line.msg === 'database unavailable for a request'));
      // away long enough for the listener to try again several times (100, 200, 400, 800 ms, …)
      await sleep(3000);
      await other.cluster.server.start();
      await waitFor(async () => (await ready(url)).status === 200, 30_000, 'ready again');
      const reconnects = sample(await (await fetch(`${url}/metrics`)).text(), 'asyncproc_listener_reconnects_total');
      assert.equal(reconnects, 1, 'one lost connection, however many attempts it took to connect again');
    } finally {
      await tearDown([
        ['the stop of the app whose database went away', () => app.stop()],
        ['the stop of its cluster, started again', () => other.cluster.stop()],
      ]);
    }
  });

  it('fails "listener" until the listener has heard from the database, and again once it has been silent too long', async () => {
    const hub = new CompletionHub(db.engine, silentLogger);
    const readiness = new Readiness({ engine: db.engine, hub, logger: silentLogger, cacheMs: 0, listenerStaleMs: 1000 });
    assert.deepEqual((await readiness.check()).failed, ['listener']);
    const listener: Closeable = await db.engine.startListener(hub);
    try {
      assert.deepEqual((await readiness.check()).failed, [], 'heard on connect');
      // the PostgreSQL listener probes every 10 s: silent for longer than the 1 s allowed here
      await waitFor(async () => (await readiness.check()).failed.includes('listener'), 5000, 'listener stale');
    } finally {
      await listener.close();
    }
  });
});

describe('log lines of one execution', () => {
  it('carry its token and procedure: submitted, finished (as the hub read it), cancelled', async () => {
    await scrape(); // the hub reads every change while metrics are scraped
    const token = await invoke({ procedure: 'demo.add', arguments: { a: 40, b: 2 } });
    const story = () => logged.filter((line) => line.token === token);
    await waitFor(
      async () => story().some((line) => line.msg === 'execution finished') && story().some((line) => line.msg === 'execution ended'),
      20_000,
      'the finish logged by the hub and the end by the worker',
    );
    const lines = story();
    const messages = lines.map((line) => line.msg);
    // the service's lines and the worker's (the activator runs in this process here; a `worker` process logs the same)
    assert.deepEqual([...messages].sort(), ['execution ended', 'execution finished', 'execution started', 'execution submitted']);
    assert.equal(messages[0], 'execution submitted');
    assert.ok(messages.indexOf('execution started') < messages.indexOf('execution ended'));
    assert.ok(lines.every((line) => line.procedure === 'demo.add'));
    assert.equal(lines.find((line) => line.msg === 'execution finished')!.status, 'SUCCEEDED');
    assert.equal(lines.find((line) => line.msg === 'execution ended')!.status, 'SUCCEEDED');
    assert.equal(lines.find((line) => line.msg === 'execution started')!.queue, 'default');

    const failing = await invoke({ procedure: 'demo.fail', arguments: { message: 'kaput' }, maxAttempts: 1 });
    await waitFor(async () => logged.some((line) => line.token === failing && line.msg === 'execution finished'), 20_000, 'the failure logged');
    const failure = logged.find((line) => line.token === failing && line.msg === 'execution finished')!;
    assert.equal(failure.status, 'FAILED');
    assert.match(failure.error.message, /kaput/);

    // a retry says which attempt failed, and why
    const retried = await invoke({ procedure: 'demo.fail', arguments: { message: 'flaky once' }, maxAttempts: 2 });
    const retry = await waitFor(async () => logged.find((line) => line.token === retried && line.msg === 'execution will retry'), 20_000, 'the retry logged');
    assert.equal(retry.procedure, 'demo.fail');
    assert.equal(retry.attempt, 1);
    assert.match(retry.error.message, /flaky once/);

    const later = await invoke({ procedure: 'demo.add', arguments: { a: 1, b: 1 }, runAt: new Date(Date.now() + 3_600_000).toISOString() });
    const { body } = await t.gql(`mutation($t: ID!) { cancelExecution(token: $t) { execution { status } } }`, { t: later });
    assert.equal(body.data.cancelExecution.execution.status, 'CANCELLED');
    const cancelled = logged.find((line) => line.token === later && line.msg === 'execution cancelled');
    assert.equal(cancelled?.procedure, 'demo.add');
  });

  it("a schedule's call too: its submit is logged with the schedule's name, so its story starts there", async () => {
    await db.engine.createSchedule({ name: 'logged-every-second', procedure: 'demo.add', arguments: { a: 1, b: 2 }, cron: '* * * * * *' });
    try {
      const submitted = await waitFor(
        async () => logged.find((line) => line.msg === 'execution submitted' && line.schedule === 'logged-every-second'),
        20_000,
        "a schedule's submit logged",
      );
      assert.equal(submitted.procedure, 'demo.add');
      assert.equal(submitted.queue, 'default');
      const [execution] = await db.engine.getExecutions([submitted.token]);
      assert.equal(execution.schedule, 'logged-every-second', 'the token logged is the call the schedule started');
      await waitFor(async () => logged.some((line) => line.token === submitted.token && line.msg === 'execution ended'), 20_000, 'its end logged');
    } finally {
      await db.engine.deleteSchedule('logged-every-second');
    }
  });

  it('name a worker pool of its own for each instance, also two instances in one process', async () => {
    const second = await startTestApp(db.url);
    try {
      const pools = async () =>
        (await db.sql.query<{ name: string }>(`select distinct application_name as name from pg_stat_activity where datname = current_database() and application_name like 'asyncproc activator %'`)).rows.map((r) => r.name);
      await waitFor(async () => (await pools()).length === 2, 20_000, 'both instances listening for work');
      const [a, b] = (await pools()).map((name) => name.replace('asyncproc activator ', ''));
      assert.notEqual(a, b);
      for (const name of [a, b]) assert.match(name, new RegExp(`^[^:]+:${process.pid}(-\\d+)?$`), name);
    } finally {
      await second.stop();
    }
  });

  it('carry its token and procedure when its worker was lost and it runs again', async () => {
    const token = await invoke({ procedure: 'demo.add', arguments: { a: 2, b: 3 }, runAt: new Date(Date.now() + 3_600_000).toISOString() });
    // a worker that claimed it and died: RUNNING, and nobody holds its lock
    await db.sql.query(`update asyncproc.executions set status = 'RUNNING', started_at = now(), run_at = null, attempts = attempts + 1 where token = $1`, [token]);
    await waitFor(async () => logged.some((line) => line.token === token && line.msg === 'execution ended'), 20_000, 'the call run again to its end');
    const story = logged.filter((line) => line.token === token).map((line) => line.msg);
    const recovered = logged.find((line) => line.token === token && line.msg.startsWith('execution recovered'));
    assert.ok(recovered, JSON.stringify(story));
    assert.equal(recovered.procedure, 'demo.add');
    assert.equal(recovered.status, 'PENDING');
    // and its run after the recovery (the two lines come from two paths: the worker the recovery
    // woke may log its start before the housekeeping that recovered it logs that, so no order)
    assert.ok(story.includes('execution started'), JSON.stringify(story));
  });
});
