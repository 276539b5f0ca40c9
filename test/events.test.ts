/**
 * "Every completion heard", tried as a hostile world would: clients that drop and resume
 * from their cursor all the time, database users that NOTIFY garbage on our channels,
 * notifications that are never sent, a notifier whose link goes half-open.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { createClient } from 'graphql-ws';
import WebSocket from 'ws';
import { Notifier } from '../src/engines/postgres/notifier.js';
import { silentLogger } from '../src/logger.js';
import { startDemoDatabase, sleep, waitFor, type DemoDatabase } from './support/database.js';
import { collect, startTestApp, type TestApp } from './support/app.js';
import { startProxy } from './support/proxy.js';

let db: DemoDatabase;
let t: TestApp;

before(async () => {
  db = await startDemoDatabase();
  t = await startTestApp(db.url);
});

after(async () => {
  await t?.stop();
  await db?.engine.close();
  await db?.sql.end();
  await db?.cluster.stop();
});

const EVENTS = `subscription($f: ExecutionFilter, $after: String) {
  executionEvents(filter: $f, after: $after) { cursor status execution { token status } } }`;

interface Resumer {
  tokens: Map<string, number>;
  resumes: number;
  stop(): Promise<void>;
  /** After `stop`: one more resume from the last cursor, kept open until `until` holds (or `ms` pass). */
  settle(until: () => boolean, ms: number): Promise<void>;
}

/**
 * A client that drops its WebSocket every 100–300 ms and resumes on a new one from the
 * cursor of the last event it saw, until stopped; counts what it received per token.
 */
function resumer(url: string, filter: Record<string, unknown>, start: string): Resumer {
  const tokens = new Map<string, number>();
  let cursor = start;
  let stopping = false;
  /** One connection from `cursor`, ended when `drop` resolves; counts what it hears. */
  const resume = async (drop: (iterator: AsyncIterableIterator<any>) => Promise<unknown>) => {
    const client = createClient({ url: url.replace(/^http/, 'ws'), webSocketImpl: WebSocket, retryAttempts: 0, lazy: true });
    const iterator: AsyncIterableIterator<any> = client.iterate({ query: EVENTS, variables: { f: filter, after: cursor } });
    const dropped = drop(iterator);
    try {
      for await (const result of iterator) {
        assert.equal(result.errors, undefined, JSON.stringify(result.errors));
        const event = (result.data as any).executionEvents;
        assert.equal(event.status, event.execution.status, 'an event describes its own moment');
        tokens.set(event.execution.token, (tokens.get(event.execution.token) ?? 0) + 1);
        cursor = event.cursor;
      }
    } finally {
      await dropped;
      await client.dispose();
    }
    state.resumes++;
  };
  const state: Resumer = {
    tokens,
    resumes: 0,
    stop: async () => {
      stopping = true;
      await running;
    },
    settle: (until, ms) =>
      resume(async (iterator) => {
        const deadline = Date.now() + ms;
        while (!until() && Date.now() < deadline) await sleep(50);
        await iterator.return?.();
      }),
  };
  const running = (async () => {
    while (!stopping) await resume((iterator) => sleep(100 + Math.random() * 200).then(() => iterator.return?.()));
  })();
  return state;
}

describe('executionEvents under a reconnect storm', () => {
  it('20 clients that drop and resume from their cursor every ~200 ms while 3,000 calls run: each hears every completion, repeats at most once per resume', async () => {
    const filter = { procedure: 'demo.record', status: ['SUCCEEDED'] };
    const start = (await t.gql(`{ changeCursor }`)).body.data.changeCursor;
    const clients = Array.from({ length: 20 }, () => resumer(t.url, filter, start));
    const total = 3000;
    const submitted: string[] = [];
    const chunk = async (n: number) => {
      const inputs = Array.from({ length: 100 }, (_, i) => ({ procedure: 'demo.record', arguments: { tag: `storm-${n}-${i}` } }));
      const { body } = await t.gql(`mutation($i: [InvokeInput!]!) { invokeMany(inputs: $i) { executions { token } } }`, { i: inputs });
      assert.equal(body.errors, undefined, JSON.stringify(body.errors));
      submitted.push(...body.data.invokeMany.executions.map((e: { token: string }) => e.token));
    };
    // three submitters at once, so submissions and completions commit out of order
    for (let n = 0; n < total / 100; n += 3) await Promise.all([chunk(n), chunk(n + 1), chunk(n + 2)]);
    await waitFor(
      async () => (await db.engine.countExecutions({ procedure: 'demo.record', status: ['SUCCEEDED'] })) >= total,
      120_000,
      'every call to succeed',
    );
    try {
      // a timeout falls through: the assertions below name the client and what it missed
      await waitFor(async () => clients.every((c) => submitted.every((token) => c.tokens.has(token))), 60_000, 'every client to hear every completion').catch(() => undefined);
    } finally {
      await Promise.all(clients.map((c) => c.stop()));
    }
    // A client of a busy machine may drop each connection before its replay gets far: slow, not
    // lost. One last resume from its cursor, left open, tells the two apart: what it does not
    // hear now lies behind the cursor the service gave it, and was lost.
    await Promise.all(clients.map((c) => c.settle(() => submitted.every((token) => c.tokens.has(token)), 30_000)));
    let resumes = 0;
    for (const [i, client] of clients.entries()) {
      const missing = submitted.filter((token) => !client.tokens.has(token));
      assert.equal(missing.length, 0, `client ${i} never heard ${missing.length} completions`);
      const repeats = [...client.tokens.values()].reduce((sum, n) => sum + n - 1, 0);
      assert.ok(repeats <= client.resumes, `client ${i}: ${repeats} repeats over ${client.resumes} resumes`);
      resumes += client.resumes;
    }
    assert.ok(resumes >= 20 * 5, `the clients resumed ${resumes} times`);
  });
});

describe('a cursor the database never gave', () => {
  it('is refused with BAD_USER_INPUT when it cannot be a position at all (writer 0, out of order), never an internal error', async () => {
    // and a part of a writer the position sees already (3 < xmin 5; 7 not in progress), or no order
    for (const after of ['0:0:', '0:5:', '0:5:3', '5:4:', '3:9:9', '3:9:5,4', '5:9:;3:1', '5:9:6;7:1', '5:9:;9', '5:9:;9:', '5:9:;9:x', '5:9:;']) {
      const refused = await collect(t.ws().iterate({ query: EVENTS, variables: { f: {}, after } }), 1, 20_000).then(
        (results) => results,
        (errors: unknown) => errors,
      );
      // refused as it subscribes: one result with the error, no event
      assert.equal((refused as any)?.length, 1, `${after}: ${JSON.stringify(refused)}`);
      assert.equal((refused as any)[0].errors?.[0]?.extensions?.code, 'BAD_USER_INPUT', `${after}: ${JSON.stringify(refused)}`);
    }
  });


  it('is refused with CURSOR_AHEAD when it is ahead of the database (a failover that lost commits), never resumed from silently', async () => {
    const now = (await t.gql(`{ changeCursor }`)).body.data.changeCursor as string;
    const xmax = BigInt(now.split(':')[1]);
    // what a cursor of the old primary looks like to a new one that lost its last commits
    const ahead = `${xmax + 5000n}:${xmax + 5000n}:`;
    // the stream ends with the error (graphql-ws's client throws it)
    const refused = await collect(t.ws().iterate({ query: EVENTS, variables: { f: {}, after: ahead } }), 1, 20_000).then(
      (results) => results,
      (errors: unknown) => errors,
    );
    assert.equal((refused as any)?.[0]?.extensions?.code, 'CURSOR_AHEAD', JSON.stringify(refused));
    // the cursor it was given is still good
    const client = t.ws();
    const iterator = client.iterate({ query: EVENTS, variables: { f: { procedure: 'demo.record' }, after: now } });
    const { body } = await t.gql(`mutation { invoke(input: { procedure: "demo.record", arguments: { tag: "after-ahead" } }) { execution { token } } }`);
    const token = body.data.invoke.execution.token;
    for await (const event of iterator as AsyncIterable<any>) {
      assert.equal(event.errors, undefined, JSON.stringify(event.errors));
      if (event.data.executionEvents.execution.token === token) break;
    }
  });
});

describe('notifications are hints, never trusted', () => {
  it('garbage NOTIFYs on our channels are ignored; the service stays up and still hears a change nobody notified', async () => {
    const hostile = [
      '3:null:SUCCEEDED',
      '1:99999999999:x',
      '999999999999999999999999:1:SUCCEEDED',
      '',
      ';;;',
      'x'.repeat(7990),
      '1:2:SUCCEEDED;oops',
    ];
    for (const payload of hostile) await db.sql.query(`select pg_notify('asyncproc_events', $1)`, [payload]);
    await db.sql.query(`select pg_notify('asyncproc_wake', 'no such queue'), pg_notify('asyncproc_queues', '\\x00garbage')`);
    await sleep(300);
    assert.equal((await fetch(new URL('/health', t.url))).status, 200, 'the service still answers');

    const client = t.ws();
    const heard = (async () => {
      for await (const result of client.iterate({ query: EVENTS, variables: { f: { procedure: 'demo.record', status: ['WAITING'] } } })) {
        return (result.data as any).executionEvents;
      }
    })();
    await sleep(500);
    // enqueued by plain SQL with quiet => true: no notification at all, so only the feed's own poll finds it
    const { rows } = await db.sql.query<{ token: string }>(
      `select token from asyncproc.submit('demo.record', '{"tag": "quiet"}', run_at => now() + interval '1 hour', quiet => true)`,
    );
    const event = await Promise.race([heard, sleep(10_000).then(() => null)]);
    assert.ok(event, 'the unnotified change reached the subscriber');
    assert.equal(event.execution.token, rows[0].token);
    await db.engine.cancelExecution(rows[0].token);
  });
});

describe('notifier', () => {
  it('a send lost on a half-open link is given up after its timeout and sent again', async () => {
    const port = Number(new URL(db.url).port);
    const proxy = await startProxy(port);
    const viaProxy = Object.assign(new URL(db.url), { port: String(proxy.port) }).toString();
    const notifier = new Notifier(viaProxy, silentLogger, 1000);
    const listener = new pg.Client({ connectionString: db.url });
    const heard: string[] = [];
    try {
      await listener.connect();
      listener.on('notification', (msg) => heard.push(msg.payload ?? ''));
      await listener.query('listen asyncproc_events');
      notifier.event('1', '1', 'SUCCEEDED');
      await waitFor(async () => heard.includes('1:1:SUCCEEDED'), 10_000, 'the first notification');
      proxy.blackhole();
      notifier.event('2', '2', 'SUCCEEDED');
      await sleep(2500); // the send times out meanwhile, and so does a reconnect through the dark link
      assert.ok(!heard.includes('2:2:SUCCEEDED'));
      proxy.restore();
      await waitFor(async () => heard.includes('2:2:SUCCEEDED'), 15_000, 'the notification sent again');
    } finally {
      await notifier.close();
      await listener.end();
      await proxy.close();
    }
  });
});

describe('a resume inside one large transaction', () => {
  const cases = [
    { name: "goes on after the last change it was given, not from the transaction's first: a client that always leaves midway still reaches the end, each change once", older: false },
    // the resumed position then misses an older writer too: the replay reads from it, and skips what was given of the large one
    { name: 'the same while an older transaction, open at first, commits between two connections', older: true },
  ];
  for (const c of cases) {
    it(c.name, async () => {
      const start = (await t.gql(`{ changeCursor }`)).body.data.changeCursor as string;
      // waiting for a runAt an hour away, so these stay their calls' latest changes
      const runAt = new Date(Date.now() + 3_600_000);
      let release = () => {};
      let olderToken: Promise<string> | null = null;
      let olderDone: Promise<unknown> = Promise.resolve();
      if (c.older) {
        const held = new Promise<void>((resolve) => (release = resolve));
        let resolveOlder: (token: string) => void = () => {};
        olderToken = new Promise((resolve) => (resolveOlder = resolve));
        // written (its writer numbered) before the large one, committed after the first connection
        olderDone = db.engine.withTransaction(async (tx) => {
          const execution = await db.engine.invoke(tx, { procedure: 'demo.record', arguments: { tag: 'older-writer' }, runAt });
          resolveOlder(execution.token);
          await held;
        });
      }
      const older = olderToken ? await olderToken : null;
      // 2,500 calls in one transaction: one writer
      const submitted = await db.engine.submit(Array.from({ length: 2500 }, (_, i) => ({ procedure: 'demo.record', arguments: { tag: `one-writer-${i}` }, runAt })));
      const expected = new Set([...submitted.map((e) => e.token), ...(older ? [older] : [])]);
      const heard = new Map<string, number>();
      let cursor = start;
      let connections = 0;
      // each connection takes 400 events and leaves, inside the large transaction's changes
      while (heard.size < expected.size && connections < 15) {
        connections++;
        const client = t.ws();
        let taken = 0;
        for await (const result of client.iterate({ query: EVENTS, variables: { f: { procedure: 'demo.record' }, after: cursor } }) as AsyncIterable<any>) {
          assert.equal(result.errors, undefined, JSON.stringify(result.errors));
          const event = result.data.executionEvents;
          if (expected.has(event.execution.token)) heard.set(event.execution.token, (heard.get(event.execution.token) ?? 0) + 1);
          cursor = event.cursor;
          if (++taken === 400 || heard.size === expected.size) break;
        }
        await client.dispose();
        if (connections === 1) {
          release();
          await olderDone;
        }
      }
      assert.equal(heard.size, expected.size, `heard ${heard.size} of ${expected.size} in ${connections} connections`);
      assert.deepEqual([...new Set(heard.values())], [1], 'each change once');
      assert.ok(connections <= 8, `${connections} connections of 400 events for ${expected.size} changes`);
    });
  }
});

describe('a cursor older than the retention (last: it purges the history)', () => {
  it('is refused with CURSOR_EXPIRED once a call it had not read is purged, never resumed with a gap; a cursor taken after the purge resumes', async () => {
    const before = (await t.gql(`{ changeCursor }`)).body.data.changeCursor as string;
    const { body } = await t.gql(`mutation { invoke(input: { procedure: "demo.record", arguments: { tag: "purged-unheard" } }) { execution { token } } }`);
    const token = body.data.invoke.execution.token;
    await waitFor(async () => (await db.engine.getExecution(token))?.status === 'SUCCEEDED', 10_000, 'the call to end');
    // retention of about nothing: the call's end goes before the subscriber holding `before` has heard it
    assert.ok((await db.engine.purge(0)) > 0);
    assert.equal(await db.engine.getExecution(token), null);
    const refused = await collect(t.ws().iterate({ query: EVENTS, variables: { f: {}, after: before } }), 1, 20_000).then(
      (results) => results,
      (errors: unknown) => errors,
    );
    assert.equal((refused as any)?.[0]?.extensions?.code, 'CURSOR_EXPIRED', JSON.stringify(refused));

    const since = (await t.gql(`{ changeCursor }`)).body.data.changeCursor as string;
    const iterator = t.ws().iterate({ query: EVENTS, variables: { f: { procedure: 'demo.record' }, after: since } });
    const next = await t.gql(`mutation { invoke(input: { procedure: "demo.record", arguments: { tag: "after-purge" } }) { execution { token } } }`);
    for await (const event of iterator as AsyncIterable<any>) {
      assert.equal(event.errors, undefined, JSON.stringify(event.errors));
      if (event.data.executionEvents.execution.token === next.body.data.invoke.execution.token) break;
    }
  });
});
